"""Share counts and sysfs attributes that would make the plugin unbounded (issue 25, rows 5, 12).

Row 5: ``sharing.timeSlicing.replicas`` (NVIDIA, on a fake DGX A100) and the generic backend's
``share`` so large that the ListAndWatch list passes the kubelet's 4 MiB limit. Before the fix
the plugin registered and sent nothing (20,000 replicas), or built the list for half a minute
and gigabytes (10**9) with SIGTERM ignored. Now ``devplugin run`` refuses at start: exit 2, one
line naming the dotted key and the list's size, in well under ``MAX_START_S``.

Row 12: a ``serial`` attribute of a USB device that is a FIFO, or a 400 MB file (sparse: no disk
used). Before the fix the FIFO wedged the scan's worker thread for good (the resource never
registered) and the big file was read whole at every rescan. Now attributes are read as regular
files of at most a page, without blocking: the resource registers, the plugin stays under
``MAX_RSS_MIB`` (VmHWM, the peak of its whole life) and a rescan every 0.1 s costs little CPU.
The figures are printed (``pytest -s``) for docs/reliability.md.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import anyio
import pytest
from cli_process import devplugin, environment, running

from devplugin_sdk.testing import FakeKubelet
from devplugin_sdk.testing.device_trees import usb_host

pytestmark = pytest.mark.timeout(60)

RESOURCE = "bounds.example.com/dev"
BLINKSTICK = "bounds.example.com/blinkstick"
MAX_START_S = 10.0  # a refusal takes well under a second; before the fix 37 s and more
MAX_RSS_MIB = 150.0  # before the fix ~740 MiB for the 400 MB attribute
MAX_RESCAN_CPU = 0.5  # CPU seconds per second over rescans every 0.1 s; before: a core or more
LIMIT = "over the kubelet's limit of 4,194,304 bytes (4 MiB)"


def _refusal(result_stderr: str) -> str:
    """The last stderr line (INFO lines may come before a refusal found at discovery)."""
    return result_stderr.strip().splitlines()[-1]


def _size(line: str) -> int:
    [said] = re.findall(r"list of (?:up to|at least) ([\d,]+) bytes", line)
    return int(said.replace(",", ""))


# ----------------------------------------------------------------------------- row 5


@pytest.mark.parametrize("replicas", [20_000, 10**9])
def test_replicas_whose_list_passes_the_kubelets_limit_are_refused_at_start(
    tmp_path: Path, replicas: int
) -> None:
    config = tmp_path / "config.yaml"
    kubelet_dir = tmp_path / "kubelet"
    kubelet_dir.mkdir()
    config.write_text(
        f"backend: nvidia\ndevicePluginDir: {kubelet_dir}\nregistration: kubelet\n"
        f"sysfsRoot: {tmp_path / 'host/sys'}\ndevRoot: {tmp_path / 'host/dev'}\n"
        f"procRoot: {tmp_path / 'host/proc'}\n"
        f"sharing:\n  timeSlicing:\n    replicas: {replicas}\n"
    )
    runner = [sys.executable, "-m", "devplugin_sdk.testing.fake_nvml", "--machine", "dgx_a100"]
    command = [*runner, "--host-root", str(tmp_path / "host"), "--", "run", "--config"]

    start = time.monotonic()
    result = _run([*command, str(config)], timeout=MAX_START_S * 3)
    elapsed = time.monotonic() - start

    assert result.returncode == 2, result.stderr[-2000:]
    line = _refusal(result.stderr)
    assert line.startswith(
        f"devplugin: error: sharing.timeSlicing.replicas: {replicas:,} replicas make a"
        " ListAndWatch list of up to "
    ), line
    assert f"here ({8 * replicas:,} devices on 8 GPUs), {LIMIT}; at most 7,841 fit" in line
    assert _size(line) > 4 * 1024 * 1024
    assert not list(kubelet_dir.glob("*.sock")), "refused before serving"
    print(f"\nreplicas {replicas:,}: refused in {elapsed:.2f} s: {line}")
    assert elapsed < MAX_START_S


def test_a_generic_share_no_device_could_list_is_refused_before_discovery(tmp_path: Path) -> None:
    devices = _devices(tmp_path, 1)
    config = _generic_config(tmp_path, devices, share=10**9)

    start = time.monotonic()
    result = devplugin("run", "--config", str(config), timeout=MAX_START_S * 3)
    elapsed = time.monotonic() - start

    assert result.returncode == 2, result.stderr[-2000:]
    # Refused while reading the configuration: nothing logged before the one line.
    assert result.stderr.strip().splitlines() == [
        "devplugin: error: resources[0].share: 1,000,000,000 shares make a ListAndWatch list of"
        f" at least {_size(result.stderr):,} bytes for one device, {LIMIT}; lower it"
    ]
    print(f"\nshare 10**9: refused in {elapsed:.2f} s")
    assert elapsed < MAX_START_S


def test_a_generic_share_whose_list_passes_the_limit_on_this_node_is_refused_at_start(
    tmp_path: Path,
) -> None:
    devices = _devices(tmp_path, 16)
    config = _generic_config(tmp_path, devices, share=20_000)

    start = time.monotonic()
    result = devplugin("run", "--config", str(config), timeout=MAX_START_S * 3)
    elapsed = time.monotonic() - start

    assert result.returncode == 2, result.stderr[-2000:]
    line = _refusal(result.stderr)
    assert re.fullmatch(
        r"devplugin: error: resources\[0\]\.share: 20,000 shares make a ListAndWatch list of up"
        rf" to [\d,]+ bytes here \(320,000 devices of 16 matches\), {re.escape(LIMIT)};"
        r" at most [\d,]+ fit",
        line,
    ), line
    assert not list((tmp_path / "kubelet").glob("*.sock")), "refused before serving"
    print(f"\nshare 20,000 x 16 devices: refused in {elapsed:.2f} s")
    assert elapsed < MAX_START_S


def _devices(tmp_path: Path, count: int) -> Path:
    devices = tmp_path / "devs"
    devices.mkdir()
    for i in range(count):
        (devices / f"d{i}").touch()
    return devices


def _generic_config(tmp_path: Path, devices: Path, share: int) -> Path:
    kubelet_dir = tmp_path / "kubelet"
    kubelet_dir.mkdir()
    config = tmp_path / "config.yaml"
    config.write_text(
        f"backend: generic\ndevicePluginDir: {kubelet_dir}\nregistration: kubelet\n"
        f"resources:\n  - resourceName: {RESOURCE}\n"
        f"    paths: ['{devices}/d*']\n    share: {share}\n"
    )
    return config


def _run(command: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=environment(),
        stdin=subprocess.DEVNULL,
        check=False,
    )


# ----------------------------------------------------------------------------- row 12


def _fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def _four_hundred_megabytes(path: Path) -> None:
    with path.open("r+b") as attribute:
        attribute.truncate(400 * 1000 * 1000)  # sparse: reads as zeros, takes no disk


@pytest.mark.parametrize("fault", [_fifo, _four_hundred_megabytes], ids=["fifo", "400MB"])
async def test_a_hostile_sysfs_attribute_never_wedges_nor_grows_the_generic_backend(
    tmp_path: Path, fault: Callable[[Path], None]
) -> None:
    host = usb_host(tmp_path / "host")
    serial = host.sysfs_root / "bus/usb/devices/1-1/serial"
    fault(serial.resolve())
    config = tmp_path / "config.yaml"
    async with FakeKubelet() as kubelet:
        config.write_text(
            f"backend: generic\ndevicePluginDir: {kubelet.directory}\nregistration: kubelet\n"
            f"sysfsRoot: {host.sysfs_root}\ndevRoot: {host.dev_root}\nhealthInterval: 0.1\n"
            f"resources:\n  - resourceName: {BLINKSTICK}\n"
            "    groups: [{usb: [{vendor: '20a0', product: '41e5'}]}]\n"
        )
        async with running("run", "--config", str(config)) as plugin:
            start = time.monotonic()
            await kubelet.wait_for_allocatable(BLINKSTICK, 1, timeout=20)
            registered = time.monotonic() - start
            # Rescans every 0.1 s re-read the attribute: measure a window of them.
            cpu_before, window_start = _cpu_seconds(plugin.pid), time.monotonic()
            await anyio.sleep(2.0)  # the measurement window, not a wait for an event
            cpu = (_cpu_seconds(plugin.pid) - cpu_before) / (time.monotonic() - window_start)
            peak_mib = _status_kib(plugin.pid, "VmHWM") / 1024
            assert await plugin.stop(timeout=10) == 0
    print(
        f"\n{fault.__name__}: registered in {registered:.2f} s, VmHWM {peak_mib:.0f} MiB,"
        f" {cpu:.0%} of a core while rescanning every 0.1 s"
    )
    assert peak_mib < MAX_RSS_MIB
    assert cpu < MAX_RESCAN_CPU


def _status_kib(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(f"{field}:"):
                return int(line.split()[1])
    raise LookupError(field)


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
