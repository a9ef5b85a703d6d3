"""What an operator meets running ``devplugin run`` (issue 27, items 1 and 6).

An explicit device-plugin directory wins over a plugins_registry that a kubelet (or an earlier
``--registration watcher`` run) left on the machine; the one startup line says the version, the
registration path and why, and the effective configuration; every option of ``run`` can come
from a ``DEVPLUGIN_<OPTION>`` variable, the command line winning over it.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from cli_process import devplugin, environment, error_line, running
from plugin_process import spawned

import devplugin_sdk
from devplugin_sdk.api import constants
from devplugin_sdk.settings import Settings
from devplugin_sdk.testing import FakeKubelet

RESOURCE = "example.com/widget"


def _generic_config(tmp_path: Path, count: int = 2) -> Path:
    devices = tmp_path / "dev"
    devices.mkdir()
    for i in range(count):
        (devices / f"widget{i}").touch()
    config = tmp_path / "widgets.yaml"
    config.write_text(f"resources:\n  - resourceName: {RESOURCE}\n    paths: ['{devices}/w*']\n")
    return config


def _private_var_lib() -> bool:
    """Whether this machine lets a test give a process a /var/lib of its own (a mount namespace:
    root, or a user namespace), where /var/lib/kubelet/plugins_registry exists as on a node."""
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(
        ["unshare", "-m", "sh", "-c", "mount -t tmpfs none /var/lib"],
        capture_output=True,
        check=False,
        timeout=30,
    )
    return probe.returncode == 0


@pytest.mark.skipif(not _private_var_lib(), reason="needs a mount namespace (unshare -m)")
async def test_an_explicit_device_plugin_dir_wins_over_an_existing_plugins_registry(
    kubelet: FakeKubelet, tmp_path: Path
) -> None:
    """Before: ``auto`` saw /var/lib/kubelet/plugins_registry and served there, so the fake
    kubelet in --device-plugin-dir never heard from the plugin (and a real kubelet did)."""
    config = _generic_config(tmp_path)
    registry = constants.PLUGINS_REGISTRY_PATH
    command = (
        f"mount -t tmpfs none /var/lib && mkdir -p {registry} && exec {sys.executable} -m "
        f"devplugin_sdk run generic --config {config} --device-plugin-dir {kubelet.directory}"
    )
    async with spawned(["unshare", "-m", "sh", "-c", command], env=environment()) as plugin:
        await kubelet.wait_for_allocatable(RESOURCE, 2, timeout=15)
        line = await plugin.wait_for_line("starting:")
        assert (
            f"registering through kubelet.sock at {kubelet.directory}/kubelet.sock "
            "(registration auto: the device-plugin directory was given)"
        ) in line
        assert await plugin.stop() == 0, plugin.error_output


def test_auto_resolves_to_the_directory_that_was_given(tmp_path: Path) -> None:
    given = Settings(device_plugin_dir=tmp_path)
    assert given.registration_choice() == (
        "kubelet",
        "registration auto: the device-plugin directory was given",
    )
    assert not given.uses_plugin_watcher()
    registry = tmp_path / "plugins_registry"
    registry.mkdir()
    both = Settings(device_plugin_dir=tmp_path, plugins_registry_dir=registry)
    assert both.registration_choice() == ("watcher", f"registration auto: {registry} exists")
    forced = Settings(device_plugin_dir=tmp_path, registration="watcher")
    assert forced.registration_choice() == ("watcher", "registration watcher")


async def test_every_run_option_comes_from_the_environment_with_one_startup_line(
    kubelet: FakeKubelet, tmp_path: Path
) -> None:
    config = _generic_config(tmp_path)
    env = {
        **environment(),
        "DEVPLUGIN_BACKEND": "generic",
        "DEVPLUGIN_CONFIG": str(config),
        "DEVPLUGIN_DEVICE_PLUGIN_DIR": str(kubelet.directory),
        "DEVPLUGIN_REGISTRATION": "kubelet",
        "DEVPLUGIN_PLUGINS_REGISTRY_DIR": str(tmp_path / "nowhere"),
        "DEVPLUGIN_METRICS_PORT": "0",
        "DEVPLUGIN_METRICS_HOST": "127.0.0.1",
        "DEVPLUGIN_STUCK_AFTER": "12",
        "DEVPLUGIN_LOG_LEVEL": "info",
        "DEVPLUGIN_LOG_FORMAT": "json",
    }
    async with running("run", env=env) as plugin:
        await kubelet.wait_for_allocatable(RESOURCE, 2, timeout=15)
        record = await plugin.wait_for_record(lambda r: "starting:" in r["message"])
        assert await plugin.stop() == 0, plugin.error_output
    assert record["message"] == (
        f"devplugin-sdk {devplugin_sdk.__version__} starting: {RESOURCE}; api devicePlugin; "
        f"registering through kubelet.sock at {kubelet.directory}/kubelet.sock "
        f"(registration kubelet); config {config}; http 127.0.0.1:0"
    )
    starting = [r for r in plugin.records() if "starting:" in r["message"]]
    assert len(starting) == 1


async def test_the_command_line_wins_over_the_environment(
    kubelet: FakeKubelet, tmp_path: Path
) -> None:
    config = _generic_config(tmp_path, count=1)
    env = {
        **environment(),
        "DEVPLUGIN_DEVICE_PLUGIN_DIR": str(tmp_path / "not-the-kubelet"),
        "DEVPLUGIN_CONFIG": "/nonexistent.yaml",
        "DEVPLUGIN_METRICS_PORT": "",  # empty: unset (a Helm template's blank)
    }
    async with running(
        "run", "generic", "--config", str(config), "--device-plugin-dir", str(kubelet.directory),
        env=env,
    ) as plugin:  # fmt: skip
        await kubelet.wait_for_allocatable(RESOURCE, 1, timeout=15)
        assert await plugin.stop() == 0, plugin.error_output
    assert "http" not in plugin.text().split("starting:")[1].splitlines()[0]


@pytest.mark.parametrize(
    ("name", "value", "reason"),
    [
        ("DEVPLUGIN_METRICS_PORT", "http", "must be a TCP port number (0-65535), got 'http'"),
        ("DEVPLUGIN_REGISTRATION", "plugin", "must be one of auto, kubelet, watcher, got 'plugin'"),
        ("DEVPLUGIN_STUCK_AFTER", "-1", "must be a number of seconds > 0, got '-1'"),
        ("DEVPLUGIN_LOG_FORMAT", "xml", "must be one of text, json, got 'xml'"),
    ],
)
def test_a_bad_environment_value_is_one_line_naming_the_variable(
    tmp_path: Path, name: str, value: str, reason: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(name, value)
    result = devplugin("run", "generic", "--device-plugin-dir", str(tmp_path))
    assert error_line(result) == f"devplugin: error: {name}: {reason}"


def test_a_bad_environment_log_level_names_the_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DEVPLUGIN_LOG_LEVEL", "loud")
    line = error_line(devplugin("run", "generic", "--device-plugin-dir", str(tmp_path)))
    assert line.startswith("devplugin: error: DEVPLUGIN_LOG_LEVEL: "), line


def test_run_help_names_every_variable() -> None:
    result = devplugin("run", "--help")
    text = " ".join(result.stdout.split())
    for name in (
        "DEVPLUGIN_BACKEND",
        "DEVPLUGIN_CONFIG",
        "DEVPLUGIN_DEVICE_PLUGIN_DIR",
        "DEVPLUGIN_REGISTRATION",
        "DEVPLUGIN_PLUGINS_REGISTRY_DIR",
        "DEVPLUGIN_METRICS_PORT",
        "DEVPLUGIN_METRICS_HOST",
        "DEVPLUGIN_STUCK_AFTER",
        "DEVPLUGIN_LOG_LEVEL",
        "DEVPLUGIN_LOG_FORMAT",
    ):
        assert name in text, name
