"""`devplugin fake-kubelet`: a kubelet on a laptop, run as a user runs it (issue 18, item 2).

Every process here is a real ``python -m devplugin_sdk`` subprocess: the fake kubelet, the
plugin and ``probe``, talking over real unix sockets in a short directory under /tmp.
"""

from __future__ import annotations

import io
import os
import shutil
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path

import anyio
import anyio.to_thread
import pytest
from cli_process import devplugin, error_line, running

from devplugin_sdk.kubelet._cli_fake_kubelet import _View
from devplugin_sdk.testing import FakeKubelet, KubeletDevice

pytestmark = pytest.mark.timeout(60)  # several interpreters start, each in about a second


@pytest.fixture
def kubelet_dir() -> Iterator[Path]:
    """A short directory (unix socket paths are limited to 107 bytes)."""
    root = Path(tempfile.mkdtemp(prefix="dpk-cli-", dir="/tmp"))
    try:
        yield root / "device-plugins"
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _generic(tmp_path: Path, count: int) -> Path:
    devices = tmp_path / "devs"
    devices.mkdir()
    for i in range(count):
        (devices / f"tty{i}").touch()
    config = tmp_path / "serial.yaml"
    config.write_text(
        "registration: kubelet\n"
        f"resources:\n  - resourceName: example.com/serial\n    paths: ['{devices}/tty*']\n"
    )
    return config


async def test_prints_registrations_capacity_and_health_flips_and_serves_probe(
    kubelet_dir: Path, tmp_path: Path
) -> None:
    config = _generic(tmp_path, 2)
    async with (
        running("fake-kubelet", "--dir", str(kubelet_dir)) as kubelet,
        running("run", "generic", "--config", str(config), "--device-plugin-dir", str(kubelet_dir)),
    ):
        await kubelet.wait_for(f"fake kubelet serving {kubelet_dir}/kubelet.sock", stream="stdout")
        await kubelet.wait_for(
            "example.com/serial: registered (endpoint example.com_serial.sock)", stream="stdout"
        )
        await kubelet.wait_for(
            "example.com/serial: device list: capacity 2, allocatable 2", stream="stdout"
        )

        socket_path = kubelet_dir / "example.com_serial.sock"
        probe = await anyio.to_thread.run_sync(
            lambda: devplugin("probe", "--socket", str(socket_path), "--allocate", "1")
        )
        assert probe.returncode == 0, probe.stderr
        assert "tty0" in probe.stdout
        assert "tty1" in probe.stdout

        (tmp_path / "devs" / "tty1").unlink()
        await kubelet.wait_for(
            "example.com/serial: device tty1 Healthy -> Unhealthy", stream="stdout"
        )
        await kubelet.wait_for("example.com/serial: capacity 2, allocatable 1", stream="stdout")
        assert await kubelet.stop() == 0
    assert kubelet.stdout[-1].endswith("fake kubelet stopped")


async def test_plugins_register_again_across_its_restart(kubelet_dir: Path, tmp_path: Path) -> None:
    """Stopped and started again on the same directory, or restarted with SIGHUP, it deletes
    the plugin's socket as a starting kubelet does, and the plugin registers again."""
    config = _generic(tmp_path, 1)
    registered = "example.com/serial: registered (endpoint example.com_serial.sock)"
    async with running(
        "run", "generic", "--config", str(config), "--device-plugin-dir", str(kubelet_dir)
    ) as plugin:
        async with running("fake-kubelet", "--dir", str(kubelet_dir)) as first:
            await first.wait_for(registered, stream="stdout")
            await first.wait_for("device list: capacity 1, allocatable 1", stream="stdout")
            assert await first.stop() == 0
        await plugin.wait_for("ListAndWatch stream ended")
        async with running("fake-kubelet", "--dir", str(kubelet_dir)) as second:
            await second.wait_for(
                "removed 1 plugin socket(s) left from before (example.com_serial.sock)",
                stream="stdout",
            )
            await second.wait_for(registered, stream="stdout")
            await second.wait_for("capacity 1, allocatable 1", stream="stdout")
            second.signal(signal.SIGHUP)
            await second.wait_for("restarting (SIGHUP)", stream="stdout")
            await second.wait_for("ListAndWatch stream ended", stream="stdout")
            await second.wait_for(registered, stream="stdout", count=2)
        assert await plugin.stop() == 0


async def test_a_plugin_waiting_for_it_says_so_once_with_a_hint(
    kubelet_dir: Path, tmp_path: Path
) -> None:
    os.makedirs(kubelet_dir)
    config = _generic(tmp_path, 1)
    async with running(
        "run", "generic", "--config", str(config), "--device-plugin-dir", str(kubelet_dir)
    ) as plugin:
        (waiting,) = await plugin.wait_for("waiting for the kubelet")
        assert " INFO " in waiting
        assert f"no {kubelet_dir}/kubelet.sock yet; registering as soon as it appears" in waiting
        assert f"`devplugin fake-kubelet --dir {kubelet_dir}`" in waiting
        async with running("fake-kubelet", "--dir", str(kubelet_dir)) as kubelet:
            await kubelet.wait_for("example.com/serial: registered", stream="stdout")
        assert await plugin.stop() == 0
    assert len(plugin.lines("waiting for the kubelet")) == 1


async def test_a_missing_directory_is_a_warning_while_it_is_waited_for(
    kubelet_dir: Path, tmp_path: Path
) -> None:
    config = _generic(tmp_path, 1)
    async with running(
        "run", "generic", "--config", str(config), "--device-plugin-dir", str(kubelet_dir)
    ) as plugin:
        (waiting,) = await plugin.wait_for("waiting for the kubelet")
        assert " WARNING " in waiting
        assert f"the directory {kubelet_dir} does not exist (yet); still waiting" in waiting
        async with running("fake-kubelet", "--dir", str(kubelet_dir)) as kubelet:  # creates it
            await kubelet.wait_for("example.com/serial: registered", stream="stdout")
        assert await plugin.stop() == 0


def test_refuses_a_directory_with_files_it_would_delete(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine\n")
    line = error_line(devplugin("fake-kubelet", "--dir", str(tmp_path)))
    assert line == (
        f"devplugin: error: --dir: {tmp_path} holds files that are not sockets (notes.txt); a "
        "kubelet deletes every file in its directory when it starts: use an empty or new "
        "directory"
    )
    assert (tmp_path / "notes.txt").read_text() == "mine\n"


def test_refuses_a_file(tmp_path: Path) -> None:
    (tmp_path / "f").touch()
    line = error_line(devplugin("fake-kubelet", "--dir", str(tmp_path / "f")))
    assert line == f"devplugin: error: --dir: {tmp_path / 'f'} is not a directory"


async def test_refuses_a_directory_where_a_kubelet_answers() -> None:
    async with FakeKubelet() as kubelet:
        result = await anyio.to_thread.run_sync(
            lambda: devplugin("fake-kubelet", "--dir", str(kubelet.directory))
        )
        assert error_line(result) == (
            f"devplugin: error: --dir: another kubelet serves {kubelet.socket_path}"
        )
        assert kubelet.running


def test_what_plugins_send_is_printed_without_control_characters() -> None:
    out = io.StringIO()
    view = _View(out)
    view.listed("acme.com/w", (KubeletDevice("ok\n[00:00:00.000] forged", "Healthy", ()),))
    view.listed("acme.com/w", (KubeletDevice("ok\n[00:00:00.000] forged", "Unhealthy", ()),))
    lines = out.getvalue().splitlines()
    assert len(lines) == 3, lines
    assert "device ok\\n[00:00:00.000] forged Healthy -> Unhealthy" in lines[1]
