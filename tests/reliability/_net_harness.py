"""A plugin process for the network-fault tests, and the outside views a node offers of it.

``plugin_process`` runs ``_net_plugin_main.py`` as a real process (``plugin_process.spawned``:
SIGTERM, a bounded wait and a kill when the test ends); ``http_get`` is one request as the
kubelet's httpGet probe makes it (a short timeout, a fresh connection); ``fd_count`` and
``FdPeak`` read ``/proc``, as an operator would.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
from plugin_process import PluginProcess, spawned

PLUGIN_MAIN = Path(__file__).with_name("_net_plugin_main.py")
RESOURCE = "reliability.example.com/dev"
SOCKET = "reliability.example.com_dev.sock"


class NetPlugin(PluginProcess):
    """A running ``_net_plugin_main.py``: its HTTP port and what ``/proc`` shows of it."""

    @property
    def http_port(self) -> int:
        [line] = self.lines("http-port ", "stdout")  # printed once serving: "http-port N"
        return int(line.split()[1])

    def fds(self) -> int:
        """Open file descriptors of the plugin process."""
        return fd_count(self.pid)

    def umask(self) -> str:
        """The process's umask as ``/proc`` shows it (``0022``)."""
        with open(f"/proc/{self.pid}/status") as status:
            return next(line.split()[1] for line in status if line.startswith("Umask:"))

    def rss_mib(self) -> float:
        with open(f"/proc/{self.pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        return 0.0

    async def status(self) -> dict[str, Any]:
        """The plugin's ``/status`` document."""
        reply = await http_get(self.http_port, "/status", timeout=5.0)
        assert reply is not None
        assert reply[0] == 200, reply
        document: dict[str, Any] = json.loads(reply[1])
        return document


@asynccontextmanager
async def plugin_process(*args: str) -> AsyncIterator[NetPlugin]:
    """Start ``_net_plugin_main.py`` with ``args``; yield it once its HTTP port is known.

    On exit a process still running gets SIGTERM and a bounded wait, then SIGKILL.
    """
    async with spawned(
        [sys.executable, str(PLUGIN_MAIN), *args],
        ready="http-port ",
        ready_stream="stdout",
        handle=NetPlugin,
    ) as plugin:
        yield plugin


async def http_get(port: int, path: str, timeout: float = 1.0) -> tuple[int, str] | None:
    """GET ``path`` on a fresh connection as the kubelet's httpGet probe does; None when no
    answer came within ``timeout`` seconds (the probe then counts a failure)."""
    with anyio.move_on_after(timeout):
        try:
            async with await anyio.connect_tcp("127.0.0.1", port) as stream:
                await stream.send(f"GET {path} HTTP/1.1\r\nHost: probe\r\n\r\n".encode())
                data = b""
                try:
                    while True:
                        data += await stream.receive()
                except anyio.EndOfStream:
                    pass
        except OSError:
            return None
        head, _, body = data.partition(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 "):
            return None
        return int(head.split()[1]), body.decode()
    return None


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


class FdPeak:
    """Samples a process's open file descriptors in the background; keeps the highest count."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak = 0

    async def run(self, interval: float = 0.02) -> None:
        while True:
            try:
                self.peak = max(self.peak, fd_count(self.pid))
            except OSError:
                return  # the process is gone
            await anyio.sleep(interval)  # a sampling period, not a wait for an event
