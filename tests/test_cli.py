"""The devplugin command: run (built-in backend and MODULE:ATTR), demo, errors; SIGTERM cleanup."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import anyio
import anyio.to_thread
import pytest

from devplugin_sdk.cli import main, resolve_plugins
from devplugin_sdk.demo import run_demo
from devplugin_sdk.errors import ConfigError
from devplugin_sdk.testing import FakeKubelet

ROOT = Path(__file__).resolve().parents[1]


def _spawn(*args: str, cwd: Path | None = None) -> subprocess.Popen[str]:
    env = {
        **os.environ,
        "PYTHONPATH": f"{ROOT / 'tests'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    }
    return subprocess.Popen(
        [sys.executable, "-m", "devplugin_sdk", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=cwd,
    )


async def test_demo_shows_every_step_of_the_lifecycle() -> None:
    out = io.StringIO()
    steps = await run_demo(out)
    events = [s.event for s in steps]
    assert events == [
        "registered with the kubelet",
        "capacity advertised",
        "allocated 2 widgets",
        "device failed",
        "device recovered",
        "kubelet restarted, plugin back",
        "device hot-plugged",
        "plugin stopped",
    ]
    text = out.getvalue()
    assert "capacity=4 allocatable=4" in text
    assert "device nodes /dev/widget" in text
    assert "socket removed: True" in text
    assert all(s.took_ms >= 0 for s in steps)


def test_demo_command_prints_a_json_timeline() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "devplugin_sdk", "demo", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    steps = json.loads(result.stdout)
    assert len(steps) == 8
    assert {"at_ms", "took_ms", "event", "detail"} <= set(steps[0])


async def test_run_generic_registers_and_cleans_up_on_sigterm(
    kubelet: FakeKubelet, tmp_path: Path
) -> None:
    """`devplugin run generic` serves until SIGTERM, then ends cleanly and removes its socket."""
    devices = tmp_path / "devs"
    devices.mkdir()
    for i in range(3):
        (devices / f"tty{i}").touch()
    config = tmp_path / "config.yaml"
    config.write_text(
        f"resources:\n  - resourceName: example.com/serial\n    paths: ['{devices}/tty*']\n"
    )
    proc = _spawn(
        "--log-format",
        "json",
        "run",
        "generic",
        "--config",
        str(config),
        "--device-plugin-dir",
        str(kubelet.directory),
    )
    try:
        await kubelet.wait_for_allocatable("example.com/serial", 3, timeout=15)
        got = await kubelet.allocate("example.com/serial", 1)
        assert got.allocation.device_nodes[0].host_path.startswith(str(devices))
        proc.send_signal(signal.SIGTERM)
        # Wait off the event loop: the kubelet must keep running to see the stream end.
        _, stderr = await anyio.to_thread.run_sync(lambda: proc.communicate(timeout=15))
    finally:
        proc.kill()
        proc.communicate()
    assert proc.returncode == 0, stderr
    assert not (kubelet.directory / "example.com_serial.sock").exists()
    # A clean end of ListAndWatch: the kubelet disconnects the plugin at once.
    await kubelet.wait_for_allocatable("example.com/serial", 0)
    lines = [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]
    assert any(
        e.get("resource") == "example.com/serial" and "registered" in e["message"] for e in lines
    )


async def test_run_module_class_target(kubelet: FakeKubelet) -> None:
    proc = _spawn("run", "cli_target:TwoWidgets", "--device-plugin-dir", str(kubelet.directory))
    try:
        await kubelet.wait_for_allocatable("acme.com/widget", 2, timeout=15)
        proc.send_signal(signal.SIGINT)
        await anyio.to_thread.run_sync(lambda: proc.communicate(timeout=15))
    finally:
        proc.kill()
        proc.communicate()
    assert proc.returncode == 0


def test_bad_config_names_the_key_and_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text(
        "resources:\n  - resourceName: example.com/x\n    paths: ['/dev/x*']\n    share: 0\n"
    )
    assert (
        main(["run", "generic", "--config", str(config), "--device-plugin-dir", str(tmp_path)]) == 2
    )
    assert "resources[0].share" in capsys.readouterr().err


def test_yaml_syntax_error_names_the_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text("resources:\n  - name: [unclosed\n")
    assert main(["run", "generic", "--config", str(config)]) == 2
    assert "line 3" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("nosuch", "neither a built-in backend"),
        ("no_such_module_x:Plugin", "cannot import"),
        ("cli_target:Missing", "has no attribute"),
        ("cli_target:not_a_plugin", "produced str"),
    ],
)
def test_bad_targets_are_clear_errors(target: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        resolve_plugins(target, None)


def test_unknown_log_format_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--log-level", "loud", "demo"])
    assert "unknown log level" in capsys.readouterr().err


def test_second_instance_for_the_same_socket_exits_nonzero(tmp_path: Path) -> None:
    """Covered end to end in tests/lifecycle; here: the CLI turns it into exit code 2."""
    # A live server on the socket path: a second plugin must refuse to take it over.
    import socket

    directory = Path(os.path.realpath("/tmp")) / f"dpt-cli-{os.getpid()}"
    directory.mkdir(exist_ok=True)
    try:
        (directory / "kubelet.sock").touch()
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(directory / "acme.com_widget.sock"))
        listener.listen()
        try:
            code = main(["run", "cli_target:TwoWidgets", "--device-plugin-dir", str(directory)])
        finally:
            listener.close()
        assert code == 2
    finally:
        for entry in directory.iterdir():
            entry.unlink()
        directory.rmdir()


async def test_run_with_metrics_port_serves_healthz(kubelet: FakeKubelet) -> None:
    """`devplugin run --metrics-port` answers /healthz with 200 once registered."""
    import socket as socket_module

    with socket_module.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    proc = _spawn(
        "run",
        "cli_target:TwoWidgets",
        "--device-plugin-dir",
        str(kubelet.directory),
        "--registration",
        "kubelet",
        "--metrics-port",
        str(port),
        "--metrics-host",
        "127.0.0.1",
    )
    try:
        await kubelet.wait_for_allocatable("acme.com/widget", 2, timeout=15)
        stream = await anyio.connect_tcp("127.0.0.1", port)
        async with stream:
            await stream.send(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            reply = b""
            with anyio.fail_after(5):
                try:
                    while True:
                        reply += await stream.receive()
                except anyio.EndOfStream:
                    pass
        assert reply.startswith(b"HTTP/1.1 200"), reply
        proc.send_signal(signal.SIGTERM)
        await anyio.to_thread.run_sync(lambda: proc.communicate(timeout=15))
    finally:
        proc.kill()
        proc.communicate()
    assert proc.returncode == 0


async def test_run_takes_everything_from_one_config_file_and_reloads_it(
    kubelet: FakeKubelet, tmp_path: Path
) -> None:
    """backend, paths and logging from the file; an edited file adds a resource live."""
    devices = tmp_path / "devs"
    devices.mkdir()
    (devices / "tty0").touch()
    (devices / "fuse").touch()
    config = tmp_path / "config.yaml"
    base = (
        f"backend: generic\ndevicePluginDir: {kubelet.directory}\nregistration: kubelet\n"
        "logging: {level: info, format: json}\n"
        f"resources:\n  - resourceName: example.com/serial\n    paths: ['{devices}/tty*']\n"
    )
    config.write_text(base)
    proc = _spawn("run", "--config", str(config))
    try:
        await kubelet.wait_for_allocatable("example.com/serial", 1, timeout=15)
        tmp = config.with_name("new.yaml")
        tmp.write_text(
            base
            + f"  - resourceName: example.com/fuse\n    paths: ['{devices}/fuse']\n    share: 4\n"
        )
        os.replace(tmp, config)
        await kubelet.wait_for_allocatable("example.com/fuse", 4, timeout=15)
        assert len(kubelet.successful_registrations("example.com/serial")) == 1
        proc.send_signal(signal.SIGTERM)
        _, stderr = await anyio.to_thread.run_sync(lambda: proc.communicate(timeout=15))
    finally:
        proc.kill()
        proc.communicate()
    assert proc.returncode == 0, stderr
    assert any('"reloaded (' in line for line in stderr.splitlines())


async def test_run_with_cdi_config_hands_out_cdi_names(
    kubelet: FakeKubelet, tmp_path: Path
) -> None:
    """`cdi:` in the file serves every resource through CDI: specs written, names allocated."""
    devices = tmp_path / "devs"
    devices.mkdir()
    (devices / "tty0").touch()
    cdi_dir = tmp_path / "cdi"
    config = tmp_path / "config.yaml"
    config.write_text(
        f"backend: generic\ndevicePluginDir: {kubelet.directory}\nregistration: kubelet\n"
        f"cdi: {{directory: {cdi_dir}}}\n"
        f"resources:\n  - resourceName: example.com/serial\n    paths: ['{devices}/tty*']\n"
    )
    proc = _spawn("run", "--config", str(config))
    try:
        await kubelet.wait_for_allocatable("example.com/serial", 1, timeout=15)
        got = await kubelet.allocate("example.com/serial", 1)
        assert got.allocation.cdi_devices == ("example.com/serial=tty0",)
        assert got.allocation.device_nodes == ()
        spec = json.loads(next(cdi_dir.glob("*.json")).read_text())
        assert spec["kind"] == "example.com/serial"
        (device,) = spec["devices"]
        assert device["name"] == "tty0"
        assert device["containerEdits"]["deviceNodes"][0]["path"] == str(devices / "tty0")
        proc.send_signal(signal.SIGTERM)
        _, stderr = await anyio.to_thread.run_sync(lambda: proc.communicate(timeout=15))
    finally:
        proc.kill()
        proc.communicate()
    assert proc.returncode == 0, stderr
    assert list(cdi_dir.glob("*.json")) == []  # removed on shutdown
