"""A plugin (or any ``devplugin`` command) run as a real process, its output read line by line.

``spawned(command)`` starts it for the body of an ``async with``, collects stdout and stderr
as they come, and, when given ``ready=TEXT``, yields only once a line with that text shows that
it serves. On the way out a process still running gets SIGTERM (or ``leave_with``), a bounded
wait, then SIGKILL. ``PluginProcess`` lets the test wait for lines or JSON log records, stop the
process with SIGTERM and read its exit status: the one harness of the suite and the examples.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import anyio
import anyio.abc

T = TypeVar("T")
STOP_WAIT = 10.0  # seconds a process left running at the block's end gets after its signal


class PluginProcess:
    """A running process; ``stdout``/``stderr`` fill up line by line."""

    def __init__(self, process: anyio.abc.Process) -> None:
        self.process = process
        self.stdout: list[str] = []
        self.stderr: list[str] = []
        self.output_open = True  # until both streams end
        self._changed = anyio.Event()

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def error_output(self) -> str:
        return self.text("stderr")

    def text(self, stream: str = "stderr") -> str:
        return "\n".join(self._lines(stream))

    def lines(self, text: str, stream: str = "stderr") -> list[str]:
        """The lines of ``stream`` so far that contain ``text``."""
        return [line for line in self._lines(stream) if text in line]

    def records(self) -> list[dict[str, Any]]:
        """The JSON log so far (stderr), one object per line; fails on any other line."""
        return [json.loads(line) for line in self.stderr if line.strip()]

    def signal(self, signum: signal.Signals) -> None:
        self.process.send_signal(signum)

    async def wait_for(
        self, text: str, *, stream: str = "stderr", count: int = 1, timeout: float = 15
    ) -> list[str]:
        """Wait until ``count`` lines of ``stream`` contain ``text``; return them.

        Raises:
            AssertionError: the output ended or the timeout passed first (with the output).
        """
        return await self._until(
            lambda: found if len(found := self.lines(text, stream)) >= count else None,
            f"no {count} {stream} line(s) with {text!r}",
            timeout,
        )

    async def wait_for_line(self, text: str, *, stream: str = "stderr", timeout: float = 15) -> str:
        """Wait for a line of ``stream`` containing ``text``; return the first."""
        return (await self.wait_for(text, stream=stream, timeout=timeout))[0]

    async def wait_for_record(
        self, check: Callable[[dict[str, Any]], bool], timeout: float = 15
    ) -> dict[str, Any]:
        """Wait for a JSON log record that ``check`` accepts; return it."""
        return await self._until(
            lambda: next((record for record in self.records() if check(record)), None),
            "no log record as expected",
            timeout,
        )

    async def stop(self, timeout: float = 15) -> int:
        """SIGTERM, then wait for the exit (and the last output); return the exit status."""
        if self.process.returncode is None:
            self.process.send_signal(signal.SIGTERM)
        return await self.exited(timeout)

    async def exited(self, timeout: float = 15) -> int:
        """Wait for the exit (and the last output) without signalling; return the exit status."""
        with anyio.fail_after(timeout):
            status = await self.process.wait()
            while self.output_open:
                await self._changed.wait()
        return status

    async def _until(self, found: Callable[[], T | None], what: str, timeout: float) -> T:
        with anyio.move_on_after(timeout):
            while True:
                if (result := found()) is not None:
                    return result
                if not self.output_open:
                    break
                await self._changed.wait()
        raise AssertionError(
            f"{what} (exit {self.process.returncode});\n"
            f"stdout:\n{self.text('stdout')}\nstderr:\n{self.text('stderr')}"
        )

    def _lines(self, stream: str) -> list[str]:
        return self.stdout if stream == "stdout" else self.stderr

    async def _collect(self, stream: anyio.abc.ByteReceiveStream, lines: list[str]) -> None:
        """Read ``stream`` to its end into ``lines``, a line at a time."""
        pending = b""
        async for chunk in stream:
            pending += chunk
            *complete, pending = pending.split(b"\n")
            lines.extend(line.decode(errors="replace") for line in complete)
            self._wake()
        if pending:
            lines.append(pending.decode(errors="replace"))
        self._wake()

    async def _collect_both(self) -> None:
        assert self.process.stdout is not None
        assert self.process.stderr is not None
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._collect, self.process.stdout, self.stdout)
            tg.start_soon(self._collect, self.process.stderr, self.stderr)
        self.output_open = False
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()


P = TypeVar("P", bound=PluginProcess)


@asynccontextmanager
async def spawned(
    command: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    ready: str | None = None,
    ready_stream: str = "stderr",
    ready_timeout: float = 15,
    leave_with: signal.Signals = signal.SIGTERM,
    handle: Callable[[anyio.abc.Process], P] = PluginProcess,  # type: ignore[assignment]
) -> AsyncIterator[P]:
    """Run ``command`` for the body of an ``async with``; yield its ``PluginProcess``.

    Args:
        command: the program and its arguments.
        env: the whole environment (the test's own when None).
        cwd: the working directory.
        ready: yield only once a line of ``ready_stream`` contains this text (the process's own
            word that it serves); at once when None.
        leave_with: the signal for a process still running when the block ends (SIGKILL for a
            test that wants no clean shutdown); SIGKILL follows if it is still there after
            ``STOP_WAIT`` seconds.
        handle: what to wrap the process in (a ``PluginProcess`` subclass).
    """
    process = await anyio.open_process(
        list(command),
        stdin=subprocess.DEVNULL,
        cwd=cwd,
        env=dict(env) if env is not None else dict(os.environ),
    )
    plugin = handle(process)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(plugin._collect_both)
            try:
                if ready is not None:
                    await plugin.wait_for(ready, stream=ready_stream, timeout=ready_timeout)
                yield plugin
            finally:
                with anyio.CancelScope(shield=True):
                    if process.returncode is None:
                        process.send_signal(leave_with)
                        with anyio.move_on_after(STOP_WAIT):
                            await process.wait()
                    if process.returncode is None:
                        process.kill()
                    await process.wait()
    finally:
        with anyio.CancelScope(shield=True):
            await process.aclose()
