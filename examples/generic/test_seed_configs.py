"""The seed systems as configurations of the generic backend: solarflare.yaml (Onload) and
amd-gpu.yaml (ROCm), each run as `devplugin run generic --config FILE` in a real process against a
FakeKubelet, on fake host trees (devplugin_sdk.testing.device_trees) given as devRoot/sysfsRoot;
and `devplugin conformance` passing on each of the example configurations."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import pytest
import yaml
from plugin_process import PluginProcess, spawned

from devplugin_sdk.config import load_yaml
from devplugin_sdk.testing import FakeKubelet
from devplugin_sdk.testing.device_trees import DeviceHost, amd_gpu_host, solarflare_host
from devplugin_sdk.types import DeviceNode

HERE = Path(__file__).parent
ONLOAD = "solarflare.com/onload"
GPU = "amd.com/gpu"


def config_on(name: str, host: DeviceHost, directory: Path) -> Path:
    """The example ``name`` as shipped, reading ``host``'s trees; returns the file written."""
    config = {
        **load_yaml(HERE / name),
        "sysfsRoot": str(host.sysfs_root),
        "devRoot": str(host.dev_root),
    }
    path = directory / name
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return path


def devplugin(*args: str, stderr: Any = subprocess.PIPE) -> subprocess.Popen[str]:
    """``devplugin ARGS``, as the image's entry point runs it, in a child process."""
    return subprocess.Popen(
        [sys.executable, "-m", "devplugin_sdk", *args],
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
    )


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A short temporary directory (unix socket paths are limited to 107 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="dpg-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@contextmanager
def stopped_at_the_end(process: subprocess.Popen[str]) -> Iterator[subprocess.Popen[str]]:
    """Kill ``process`` (bounded wait) on the way out, whatever happened."""
    try:
        yield process
    finally:
        process.kill()
        process.communicate(timeout=15)


@asynccontextmanager
async def running(config: Path, directory: Path) -> AsyncIterator[PluginProcess]:
    """``devplugin run generic --config CONFIG`` registering in ``directory`` until the block
    ends; then SIGTERM and a clean exit (status 0)."""
    args = ["run", "generic", "--config", str(config), "--device-plugin-dir", str(directory)]
    command = [sys.executable, "-m", "devplugin_sdk", *args, "--registration", "kubelet"]
    async with spawned(command) as plugin:
        yield plugin
        code = await plugin.stop()
        assert code == 0, f"exit status {code}; its log:\n{plugin.error_output}"


# ----------------------------------------------------------------------------- Solarflare


async def test_solarflare_yaml_hands_out_the_onload_nodes_sixteen_ways(tmp_path: Path) -> None:
    host = solarflare_host(tmp_path / "host")
    config = config_on("solarflare.yaml", host, tmp_path)
    async with FakeKubelet() as kubelet, running(config, kubelet.directory):
        await kubelet.wait_for_allocatable(ONLOAD, 16, timeout=30)
        got = await kubelet.allocate(ONLOAD, 1)
        # Host paths, whatever devRoot the plugin reads them under.
        assert got.allocation.device_nodes == tuple(
            DeviceNode(path, path, "rw")
            for path in ("/dev/onload", "/dev/onload_epoll", "/dev/sfc_char")
        )
        # Onload unloaded (for an upgrade): every share is out; loaded again, all back.
        host.remove_node("onload")
        await kubelet.wait_for_allocatable(ONLOAD, 0)
        assert kubelet.capacity(ONLOAD) == 16
        host.restore_node("onload")
        await kubelet.wait_for_allocatable(ONLOAD, 16)
        # Without sfc_char (no ef_vi), Onload still works: the device stays Healthy.
        host.remove_node("sfc_char")
        got = await kubelet.allocate(ONLOAD, 1)
        assert [n.host_path for n in got.allocation.device_nodes] == [
            "/dev/onload",
            "/dev/onload_epoll",
        ]
        assert kubelet.allocatable(ONLOAD) == 16


# ----------------------------------------------------------------------------- AMD GPUs


async def test_amd_gpu_yaml_serves_each_gpu_with_its_nodes_kfd_and_numa_node(
    tmp_path: Path,
) -> None:
    host = amd_gpu_host(tmp_path / "host")
    config = config_on("amd-gpu.yaml", host, tmp_path)
    async with FakeKubelet() as kubelet, running(config, kubelet.directory):
        await kubelet.wait_for_allocatable(GPU, 2, timeout=30)
        listed = kubelet.devices(GPU)
        # The BMC's card0 is no GPU; each GPU is its PCI address, on its NUMA node.
        assert {i: d.numa_nodes for i, d in listed.items()} == {
            "0000:03:00.0": (0,),
            "0000:83:00.0": (1,),
        }
        got = await kubelet.allocate(GPU, 2)
        assert sorted(n.host_path for n in got.allocation.device_nodes) == [
            "/dev/dri/card1",
            "/dev/dri/card2",
            "/dev/dri/renderD128",
            "/dev/dri/renderD129",
            "/dev/kfd",
        ]
        kubelet.release(got)
        # A GPU whose render node goes (amdgpu unbound from it) is Unhealthy; the other is not.
        host.remove_node("dri/renderD129")
        await kubelet.wait_for_health(GPU, "0000:83:00.0", "Unhealthy")
        assert kubelet.devices(GPU)["0000:03:00.0"].healthy
        host.restore_node("dri/renderD129")
        await kubelet.wait_for_allocatable(GPU, 2)


# ----------------------------------------------------------------------------- conformance


def roots_for(name: str, root: Path) -> dict[str, str]:
    """Fake host trees for example ``name``: its devRoot and sysfsRoot."""
    if name == "solarflare.yaml":
        host = solarflare_host(root)
    elif name == "amd-gpu.yaml":
        host = amd_gpu_host(root)
    else:  # config.yaml: a serial adapter, /dev/fuse, /dev/net/tun, no camera
        host = DeviceHost(root)
        for node in ("ttyUSB0", "fuse", "net/tun"):
            host.restore_node(node)
    return {"sysfsRoot": str(host.sysfs_root), "devRoot": str(host.dev_root)}


@pytest.mark.parametrize(
    ("name", "resources"),
    [("config.yaml", 4), ("solarflare.yaml", 1), ("amd-gpu.yaml", 1)],
)
async def test_devplugin_conformance_passes_on_the_example_config(
    short_dir: Path, name: str, resources: int
) -> None:
    config = {**load_yaml(HERE / name), **roots_for(name, short_dir / "host")}
    config_file = short_dir / name
    config_file.write_text(yaml.safe_dump(config), encoding="utf-8")
    directory = short_dir / "dp"
    directory.mkdir()
    # The plugin first: it waits for the kubelet.sock the suite then serves.
    async with running(config_file, directory) as plugin:
        suite = devplugin(
            *("conformance", "--register-dir", str(directory), "--expect", str(resources)),
            *("--wait", "30", "--restart-timeout", "15"),
        )
        with stopped_at_the_end(suite):
            out, err = await anyio.to_thread.run_sync(lambda: suite.communicate(timeout=50))
    lines = out.splitlines()
    assert suite.returncode == 0, f"{out}\n{err}\nplugin log:\n{plugin.error_output}"
    assert re.fullmatch(r"\d+ passed, 0 failed(, \d+ skipped)?", lines[-1]), out
    assert sum(line.startswith("== ") for line in lines) == resources


# ----------------------------------------------------------------------------- the shipped files


def test_the_seed_configs_are_what_the_readme_shows() -> None:
    readme = (HERE / "README.md").read_text(encoding="utf-8")
    for heading, name in [
        ("## Solarflare / Onload: ", "solarflare.yaml"),
        ("## AMD GPUs: ", "amd-gpu.yaml"),
    ]:
        shown = _yaml_block_after(readme, f"{heading}`{name}`")
        assert yaml.safe_load(shown) == load_yaml(HERE / name), name


def _yaml_block_after(text: str, marker: str) -> str:
    """The first ```yaml block after ``marker``."""
    start = text.index("```yaml\n", text.index(marker)) + len("```yaml\n")
    return text[start : text.index("```", start)]
