"""``run()`` in a script that sets up no logging says what it does (issue 27, item 3).

``python acme_plugin.py`` printed nothing at all, success or not: ``run()`` left logging
unconfigured, so Python's last-resort handler dropped every INFO line. Now ``run()`` logs at
INFO to stderr when the program configured no logging, and leaves a program's own setup alone.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest
from plugin_process import spawned

from devplugin_sdk.testing import FakeKubelet

RESOURCE = "acme.com/widget"

PLUGIN = """
import logging
import sys
from pathlib import Path

from devplugin_sdk import Device, Settings, run
from devplugin_sdk.testing import StaticPlugin

{setup}
run(
    StaticPlugin("acme.com/widget", [Device("w0")]),
    settings=Settings(device_plugin_dir=Path(sys.argv[1]), registration="kubelet"),
)
"""


def _script(tmp_path: Path, setup: str = "") -> Path:
    script = tmp_path / "acme_plugin.py"
    script.write_text(PLUGIN.format(setup=setup))
    return script


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


async def test_run_logs_at_info_when_the_program_configured_no_logging(
    tmp_path: Path, short_dir: Path
) -> None:
    (short_dir / "kubelet").mkdir()  # the kubelet's directory, and no kubelet yet
    command = [sys.executable, str(_script(tmp_path)), str(short_dir / "kubelet")]
    async with spawned(command, env=_env(), cwd=tmp_path) as plugin:
        line = await plugin.wait_for_line("acme.com/widget: discovered 1 devices")
        assert " INFO " in line
        await plugin.wait_for_line("acme.com/widget: waiting for the kubelet: no ")
        async with FakeKubelet(directory=short_dir / "kubelet") as kubelet:
            await kubelet.wait_for_allocatable(RESOURCE, 1)
            plugin.signal(signal.SIGTERM)
            assert await plugin.exited() == 0
    assert plugin.lines("received SIGTERM; shutting down")


@pytest.mark.parametrize("setup", ["logging.basicConfig(level=logging.WARNING)"])
async def test_run_leaves_a_programs_own_logging_alone(
    tmp_path: Path, short_dir: Path, setup: str
) -> None:
    command = [sys.executable, str(_script(tmp_path, setup)), str(short_dir / "kubelet")]
    async with (
        FakeKubelet(directory=short_dir / "kubelet") as kubelet,
        spawned(command, env=_env(), cwd=tmp_path) as plugin,
    ):
        await kubelet.wait_for_allocatable(RESOURCE, 1)  # serving: its signal handler is set
        plugin.signal(signal.SIGTERM)
        assert await plugin.exited() == 0
    assert plugin.text() == ""
