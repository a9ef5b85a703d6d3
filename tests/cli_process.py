"""Run the ``devplugin`` command as a user does: a subprocess, its output read line by line.

``devplugin(...)`` runs one command to its end; ``running(...)`` keeps one running for the body
of an ``async with`` (stopped with SIGTERM, then killed, on the way out) and lets the test wait
for a line of its output.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import anyio.abc
from process_output import ProcessOutput

ROOT = Path(__file__).resolve().parents[1]


def environment() -> dict[str, str]:
    """The test's environment, with tests/ importable (for ``cli_target``)."""
    path = os.environ.get("PYTHONPATH", "")
    return {**os.environ, "PYTHONPATH": f"{ROOT / 'tests'}{os.pathsep}{path}"}


def devplugin(
    *args: str, cwd: Path | None = None, timeout: float = 30
) -> subprocess.CompletedProcess[str]:
    """Run ``python -m devplugin_sdk ARGS`` to its end."""
    return subprocess.run(
        [sys.executable, "-m", "devplugin_sdk", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env=environment(),
        stdin=subprocess.DEVNULL,
        check=False,
    )


def error_line(result: subprocess.CompletedProcess[str]) -> str:
    """The one stderr line of a command that failed with exit code 2."""
    assert result.returncode == 2, (result.returncode, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


class Running(ProcessOutput):
    """A running command; ``stdout``/``stderr`` fill up line by line."""

    def __init__(self, process: anyio.abc.Process) -> None:
        super().__init__(process)
        self.output_open = True  # until both streams end

    async def wait_for(
        self, text: str, *, stream: str = "stderr", count: int = 1, timeout: float = 15
    ) -> list[str]:
        """Wait until ``count`` lines of ``stream`` contain ``text``; return them."""
        lines = self.stdout if stream == "stdout" else self.stderr
        try:
            with anyio.fail_after(timeout):
                while True:
                    found = [line for line in lines if text in line]
                    if len(found) >= count:
                        return found
                    if not self.output_open:
                        break
                    await self._changed.wait()
        except TimeoutError:
            pass
        raise AssertionError(
            f"no {count} {stream} line(s) with {text!r} (exit {self.process.returncode});\n"
            f"stdout:\n{self.text('stdout')}\nstderr:\n{self.text('stderr')}"
        )

    def lines(self, text: str, stream: str = "stderr") -> list[str]:
        return [
            line for line in (self.stdout if stream == "stdout" else self.stderr) if text in line
        ]

    def text(self, stream: str = "stderr") -> str:
        return "\n".join(self.stdout if stream == "stdout" else self.stderr)

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


@asynccontextmanager
async def running(
    *args: str,
    cwd: Path | None = None,
    script: str | None = None,
    env: Mapping[str, str] | None = None,
) -> AsyncIterator[Running]:
    """Run ``python -m devplugin_sdk ARGS`` (or the console ``script``) for the block, in
    ``environment()`` unless ``env`` is given."""
    command = [script] if script is not None else [sys.executable, "-m", "devplugin_sdk"]
    process = await anyio.open_process(
        [*command, *args],
        stdin=subprocess.DEVNULL,
        cwd=cwd,
        env=dict(env) if env is not None else environment(),
    )
    run = Running(process)
    assert process.stdout is not None
    assert process.stderr is not None

    async def collect_both() -> None:
        assert process.stdout is not None
        assert process.stderr is not None
        async with anyio.create_task_group() as inner:
            inner.start_soon(run.collect, process.stdout, run.stdout)
            inner.start_soon(run.collect, process.stderr, run.stderr)
        run.output_open = False
        run._wake()

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(collect_both)
            try:
                yield run
            finally:
                with anyio.CancelScope(shield=True):
                    if process.returncode is None:
                        process.send_signal(signal.SIGTERM)
                        with anyio.move_on_after(10):
                            await process.wait()
                    if process.returncode is None:
                        process.kill()
                    await process.wait()
    finally:
        with anyio.CancelScope(shield=True):
            await process.aclose()
