"""A child process whose output the test reads line by line, as it comes.

The base of the tests' process handles (``cli_process.Running`` and the reliability suite's
plugin processes): ``collect`` fills ``stdout`` or ``stderr`` from one of the process's pipes
and wakes whoever waits for a line.
"""

from __future__ import annotations

import signal

import anyio
import anyio.abc


class ProcessOutput:
    """A running process; ``stdout``/``stderr`` fill up line by line while ``collect`` runs."""

    def __init__(self, process: anyio.abc.Process) -> None:
        self.process = process
        self.stdout: list[str] = []
        self.stderr: list[str] = []
        self._changed = anyio.Event()

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def error_output(self) -> str:
        return "\n".join(self.stderr)

    async def collect(self, stream: anyio.abc.ByteReceiveStream, lines: list[str]) -> None:
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

    def _wake(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    def signal(self, signum: signal.Signals) -> None:
        self.process.send_signal(signum)
