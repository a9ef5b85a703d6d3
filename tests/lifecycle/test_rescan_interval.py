"""Periodic rediscovery (issue 27, item 3): a device created after the start is seen.

``discover()`` ran once, so a plugin without a ``watch()`` of its own never saw a device that
appeared later (squat's generic plugin rescans every 5 s). Every plugin is now rediscovered
every ``Settings.rescan_interval`` seconds (10 s by default; 0 turns it off), and a plugin's
``rescan_interval`` attribute wins; ``rescanInterval`` sets it in ``devplugin run``'s file.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from devplugin_sdk import Device, DeviceNode, DevicePlugin, Settings
from devplugin_sdk.cli.runfile import parse_run_config
from devplugin_sdk.errors import ConfigError
from devplugin_sdk.testing import FakeKubelet, serving

RESOURCE = "acme.com/widget"


class Widgets(DevicePlugin):
    """Every ``acme*`` file of a directory is a widget (the quickstart's plugin, short)."""

    resource_name = RESOURCE

    def __init__(self, dev: Path, rescan_interval: float | None = None) -> None:
        super().__init__()
        self.dev = dev
        self.rescan_interval = rescan_interval
        self.discovered = 0

    async def discover(self) -> Sequence[Device]:
        self.discovered += 1
        return [Device(p.name, device_nodes=(DeviceNode(str(p)),)) for p in self.dev.glob("acme*")]


def test_the_default_is_stated_and_zero_turns_it_off() -> None:
    assert Settings().rescan_interval == 10.0
    assert Settings(rescan_interval=0).rescan_interval == 0
    with pytest.raises(ValueError, match=r"Settings.rescan_interval must be >= 0, got -1"):
        Settings(rescan_interval=-1)


async def test_a_device_created_after_the_start_is_seen(
    kubelet: FakeKubelet, tmp_path: Path
) -> None:
    (tmp_path / "acme0").touch()
    plugin = Widgets(tmp_path)
    async with serving(plugin, settings=kubelet.settings(rescan_interval=0.05)):
        await kubelet.wait_for_allocatable(RESOURCE, 1)
        (tmp_path / "acme1").touch()
        await kubelet.wait_for_allocatable(RESOURCE, 2)
        (tmp_path / "acme0").unlink()
        await kubelet.wait_for(lambda: kubelet.devices(RESOURCE).keys() == {"acme1"})


async def test_the_plugins_own_interval_wins(kubelet: FakeKubelet, tmp_path: Path) -> None:
    plugin = Widgets(tmp_path, rescan_interval=0.05)
    async with serving(plugin, settings=kubelet.settings(rescan_interval=0)):
        await kubelet.wait_for_registrations(RESOURCE, 1)
        (tmp_path / "acme0").touch()
        await kubelet.wait_for_allocatable(RESOURCE, 1)


async def test_a_bad_interval_on_the_plugin_is_refused_before_serving(
    kubelet: FakeKubelet, tmp_path: Path
) -> None:
    with pytest.raises(ValueError, match=r"acme.com/widget: rescan_interval must be >= 0"):
        async with serving(Widgets(tmp_path, rescan_interval=-2), settings=kubelet.settings()):
            pass


def test_the_run_file_sets_it() -> None:
    assert parse_run_config({"rescanInterval": 2.5}).rescan_interval == 2.5
    assert parse_run_config({"rescanInterval": 0}).rescan_interval == 0
    assert parse_run_config({}).rescan_interval is None
    with pytest.raises(ConfigError, match=r"^rescanInterval: must be a number of seconds >= 0"):
        parse_run_config({"rescanInterval": "5s"})
    assert "rescanInterval" in parse_run_config({"rescanInterval": 1}).restart_needed(
        parse_run_config({"rescanInterval": 2})
    )
