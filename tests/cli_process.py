"""Run the ``devplugin`` command as a user does: a subprocess, its output read line by line.

``devplugin(...)`` runs one command to its end; ``running(...)`` keeps one running for the body
of an ``async with`` (``plugin_process.spawned``: stopped with SIGTERM, then killed, on the way
out) and lets the test wait for a line of its output.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path

from plugin_process import PluginProcess, spawned

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


@asynccontextmanager
async def running(
    *args: str,
    cwd: Path | None = None,
    script: str | None = None,
    env: Mapping[str, str] | None = None,
) -> AsyncIterator[PluginProcess]:
    """Run ``python -m devplugin_sdk ARGS`` (or the console ``script``) for the block, in
    ``environment()`` unless ``env`` is given (see ``plugin_process.spawned``)."""
    command = [script] if script is not None else [sys.executable, "-m", "devplugin_sdk"]
    async with spawned(
        [*command, *args], cwd=cwd, env=environment() if env is None else env
    ) as process:
        yield process
