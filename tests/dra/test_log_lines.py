"""Names from outside never forge a log line (issue 36, row 23).

A claim's namespace and name come from the API server and the kubelet; an API server that does
not validate them (or one of its errors) can carry a newline or a terminal escape. Every outside
string in the DRA driver's log lines goes through ``printable``: before, the sweep's ``cannot
check claim`` line and the preparer's ``claim ...: allocate() returned annotations`` line wrote
them raw (2 forged lines, a raw ESC). Since row 4 such a name is refused before it is prepared,
and the refusal's line escapes it too.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import anyio
import pytest
from dra_helpers import DRIVER
from sdk_helpers import RESOURCE, figures, widgets

from devplugin_sdk import Allocation, Device
from devplugin_sdk.dra._claims import cleanup
from devplugin_sdk.dra.resources import ResourceClaim
from devplugin_sdk.errors import KubeApiError
from devplugin_sdk.kubelet.fake_dra import PodPreparationError
from devplugin_sdk.testing import DraNode, MemoryApi, StaticPlugin

EVIL = "evil\x1b[2J\nDRA acme.com: FORGED"


class _Annotating(StaticPlugin):
    """Its ``allocate()`` returns annotations, which DRA drops with a warning naming the claim."""

    async def allocate(self, devices: Sequence[Device]) -> Allocation:
        got = await super().allocate(devices)
        return Allocation(got.device_nodes, got.mounts, got.env, {"acme.com/x": "1"})


class _Reads:
    """The driver's client of ``memory``: its claim reads hang once ``hang`` is set (an API
    server that stopped answering), or fail with a reason carrying a newline."""

    def __init__(self, memory: MemoryApi) -> None:
        self.memory = memory
        self.hang = False
        self.refuse: str | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.memory, name)

    async def read_claim(self, namespace: str, name: str) -> ResourceClaim:
        if self.hang:
            await anyio.sleep_forever()
        if self.refuse is not None:
            reason, self.refuse = self.refuse, None
            raise KubeApiError(500, reason)
        return await self.memory.read_claim(namespace, name)


@contextmanager
def _records() -> Iterator[list[logging.LogRecord]]:
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("devplugin_sdk")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


async def test_claim_names_with_escapes_never_forge_a_log_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(cleanup, "_READ_TIMEOUT", 0.2)  # the sweep's bound on one read
    memory = MemoryApi(nodes=["node-1"])
    reads = _Reads(memory)
    plugin = _Annotating(RESOURCE, widgets(2))
    with _records() as records:
        async with DraNode(
            plugin, driver=DRIVER, memory=memory, api=reads, cleanup_interval=0.2
        ) as node:
            # A claim so named is refused before any file or log line takes its name raw.
            bad = node.pod(EVIL, namespace=EVIL)
            node.claim(EVIL, ["w1"], pods=[bad], namespace=EVIL)
            with pytest.raises(PodPreparationError):
                await node.prepare(bad)
            pod = node.pod("c1")
            node.claim("c1", ["w0"], pods=[pod])
            await node.prepare(pod)
            reads.refuse = "the server\nDRA acme.com: FORGED too\x1b[31m"
            await node.kubelet.wait_for(
                lambda: any("cannot check claim" in r.getMessage() for r in records),
                what="the sweep's refused read",
            )
            reads.hang = True
            await node.kubelet.wait_for(
                lambda: any("(timed out)" in r.getMessage() for r in records),
                what="the sweep's read timing out",
            )
    lines = [r.getMessage() for r in records]
    said = [m for m in lines if "evil" in m]
    assert any("not a valid namespace" in m for m in said), said
    assert any("allocate() returned annotations" in m for m in lines), lines
    assert sum("cannot check claim" in m for m in lines) >= 2, lines
    forged = [m for m in lines if "\n" in m or "\x1b" in m]
    assert not forged, forged
    figures("row 23", lines_naming_the_claim=len(said), forged=len(forged))
