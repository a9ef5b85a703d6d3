"""NVIDIA's own configuration file, as an operator brings it from NVIDIA's plugin (issue 27,
item 6): ``flags:`` and ``sharing.timeSlicing.resources`` run unchanged where they mean what
this backend's keys mean, and are one line naming NVIDIA's key where they do not.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from cli_process import environment, error_line
from plugin_process import spawned

from devplugin_sdk.backends.nvidia.config import NvidiaConfig
from devplugin_sdk.errors import ConfigError
from devplugin_sdk.testing import FakeKubelet

# NVIDIA's README (k8s-device-plugin, "Shared Access to GPUs with CUDA Time-Slicing") with the
# flags of its example file; only the three host roots are ours.
NVIDIA_FILE = """\
version: v1
flags:
  migStrategy: none
  failOnInitError: true
  plugin:
    passDeviceSpecs: false
    deviceListStrategy: envvar
    deviceIDStrategy: uuid
sharing:
  timeSlicing:
    renameByDefault: false
    failRequestsGreaterThanOne: false
    resources:
    - name: nvidia.com/gpu
      replicas: 4
"""


def _command(tmp_path: Path, text: str, *run: str) -> list[str]:
    config = tmp_path / "nvidia.yaml"
    host = tmp_path / "host"
    config.write_text(text + f"sysfsRoot: {host}/sys\ndevRoot: {host}/dev\nprocRoot: {host}/proc\n")
    return [
        sys.executable, "-m", "devplugin_sdk.testing.fake_nvml", "--machine", "dgx_a100",
        "--host-root", str(host), "--", "run", "nvidia", "--config", str(config), *run,
    ]  # fmt: skip


async def test_nvidias_time_slicing_file_runs_unchanged(
    kubelet: FakeKubelet, tmp_path: Path
) -> None:
    """Before: ``flags: unknown key; expected one of the backend's keys (...)``."""
    command = _command(tmp_path, NVIDIA_FILE, "--device-plugin-dir", str(kubelet.directory))
    async with spawned(command, env=environment()) as plugin:
        await kubelet.wait_for_allocatable("nvidia.com/gpu", 8 * 4, timeout=30)
        assert await plugin.stop() == 0, plugin.error_output


def test_nvidias_flags_mean_this_backends_keys() -> None:
    config = NvidiaConfig.from_mapping(yaml.safe_load(NVIDIA_FILE))
    assert config.mig_strategy == "none"
    assert config.pass_device_specs is False
    assert config.device_list_strategy == ("envvar",)
    assert config.replicas == 4


@pytest.mark.parametrize(
    ("text", "line"),
    [
        (
            "flags:\n  plugin:\n    deviceIDStrategy: index\n",
            'flags.plugin.deviceIDStrategy: only "uuid" is supported here, got "index"; see '
            "docs/deployment.md, 'Coming from NVIDIA's plugin'",
        ),
        (
            "flags:\n  gdsEnabled: true\n",
            "flags.gdsEnabled: NVIDIA's flag flags.gdsEnabled has no counterpart here; see "
            "docs/deployment.md, 'Coming from NVIDIA's plugin'",
        ),
        (
            "flags:\n  migStrateg: none\n",
            "flags.migStrateg: unknown key; did you mean 'migStrategy'? expected one of "
            "migStrategy, failOnInitError, plugin",
        ),
        (
            "migStrategy: none\nflags:\n  migStrategy: single\n",
            "flags.migStrategy: is also given as migStrategy: keep one of the two",
        ),
        (
            "sharing:\n  timeSlicing:\n    resources:\n    - {name: nvidia.com/gpu, replicas: 2}\n"
            "    - {name: nvidia.com/mig-1g.5gb, replicas: 3}\n",
            "sharing.timeSlicing.resources[1].replicas: differs from "
            "sharing.timeSlicing.resources[0].replicas: one replica count applies to every "
            "resource here (sharing.timeSlicing.replicas)",
        ),
        (
            "sharing:\n  timeSlicing:\n    resources:\n    - {name: nvidia.com/gpu, replicas: 2,"
            " devices: [0]}\n",
            "sharing.timeSlicing.resources[0].devices: time-slicing a subset of the GPUs is not "
            "supported; every GPU is shared",
        ),
    ],
)
def test_what_does_not_translate_is_one_line_naming_nvidias_key(text: str, line: str) -> None:
    with pytest.raises(ConfigError) as caught:
        NvidiaConfig.from_mapping(yaml.safe_load(text))
    assert str(caught.value) == line


def test_the_command_names_nvidias_key(tmp_path: Path) -> None:
    command = _command(tmp_path, "flags:\n  failOnInitError: false\n")
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=60, env=environment(), check=False
    )
    assert error_line(result) == (
        "devplugin: error: flags.failOnInitError: only true is supported here, got false; "
        "see docs/deployment.md, 'Coming from NVIDIA's plugin'"
    )


def test_what_the_translation_passes_on_is_checked() -> None:
    """`devplugin run` checks the translated file, which the backend reads: a misspelt key the
    translation passed on is one line, and a translated file read whole passes the check."""
    from devplugin_sdk.config import FileOptions

    text = NVIDIA_FILE.replace("renameByDefault", "renameByDefualt")
    options = FileOptions(yaml.safe_load(text).items())
    with pytest.raises(ConfigError, match=r"sharing\.timeSlicing\.renameByDefualt: unknown key"):
        NvidiaConfig.from_mapping(options)
    clean = FileOptions(yaml.safe_load(NVIDIA_FILE).items())
    NvidiaConfig.from_mapping(clean)
    clean.check_read()  # the original's timeSlicing.renameByDefault was read in the translation
