"""The devplugin command: run (built-in backend and MODULE:ATTR), demo, errors; SIGTERM cleanup.

The second half runs the command as a user does (issue 18): a subprocess on real files,
checking the exit code and the one line on stderr.
"""

from __future__ import annotations

import errno
import io
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import anyio
import anyio.to_thread
import pytest
from cli_process import devplugin, error_line, running

import devplugin_sdk
from devplugin_sdk.cli import main, resolve_plugins
from devplugin_sdk.cli.demo import run_demo
from devplugin_sdk.errors import ConfigError
from devplugin_sdk.testing import FakeKubelet


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
    async with running(
        "--log-format",
        "json",
        "run",
        "generic",
        "--config",
        str(config),
        "--device-plugin-dir",
        str(kubelet.directory),
    ) as proc:
        await kubelet.wait_for_allocatable("example.com/serial", 3, timeout=15)
        got = await kubelet.allocate("example.com/serial", 1)
        assert got.allocation.device_nodes[0].host_path.startswith(str(devices))
        code = await proc.stop()
    assert code == 0, proc.error_output
    assert not (kubelet.directory / "example.com_serial.sock").exists()
    # A clean end of ListAndWatch: the kubelet disconnects the plugin at once.
    await kubelet.wait_for_allocatable("example.com/serial", 0)
    lines = [json.loads(line) for line in proc.stderr if line.startswith("{")]
    assert any(
        e.get("resource") == "example.com/serial" and "registered" in e["message"] for e in lines
    )


async def test_run_module_class_target(kubelet: FakeKubelet) -> None:
    async with running(
        "run", "cli_target:TwoWidgets", "--device-plugin-dir", str(kubelet.directory)
    ) as proc:
        await kubelet.wait_for_allocatable("acme.com/widget", 2, timeout=15)
        proc.signal(signal.SIGINT)
        code = await proc.exited()
    assert code == 0, proc.error_output


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
        ("cli_target:not_a_plugin", "produced a str, not a DevicePlugin"),
        ("json:JSONDecoder", "returned a JSONDecoder; expected a DevicePlugin or a list of them"),
        ("cli_target:needs_arguments", "cannot be called without arguments"),
        ("devplugin_sdk:DevicePlugin", "is abstract: it does not define discover"),
        ("cli_target.__name__:x", "cannot import"),
        ("json:__doc__", "is a str, not a DevicePlugin class or a factory"),
    ],
)
def test_bad_targets_are_clear_errors(target: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        resolve_plugins(target, None)


def test_unknown_log_level_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        main(["--log-level", "loud", "demo"])
    assert caught.value.code == 2
    assert capsys.readouterr().err == (
        "devplugin: error: argument --log-level: unknown log level 'loud'; "
        "use debug, info, warning, error (see devplugin --help)\n"
    )


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
    async with running(
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
    ) as proc:
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
        code = await proc.stop()
    assert code == 0, proc.error_output


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
    async with running("run", "--config", str(config)) as proc:
        await kubelet.wait_for_allocatable("example.com/serial", 1, timeout=15)
        tmp = config.with_name("new.yaml")
        tmp.write_text(
            base
            + f"  - resourceName: example.com/fuse\n    paths: ['{devices}/fuse']\n    share: 4\n"
        )
        os.replace(tmp, config)
        await kubelet.wait_for_allocatable("example.com/fuse", 4, timeout=15)
        assert len(kubelet.successful_registrations("example.com/serial")) == 1
        code = await proc.stop()
    assert code == 0, proc.error_output
    assert any('"reloaded (' in line for line in proc.stderr)


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
    async with running("run", "--config", str(config)) as proc:
        await kubelet.wait_for_allocatable("example.com/serial", 1, timeout=15)
        got = await kubelet.allocate("example.com/serial", 1)
        assert got.allocation.cdi_devices == ("example.com/serial=tty0",)
        assert got.allocation.device_nodes == ()
        spec = json.loads(next(cdi_dir.glob("*.json")).read_text())
        assert spec["kind"] == "example.com/serial"
        (device,) = spec["devices"]
        assert device["name"] == "tty0"
        assert device["containerEdits"]["deviceNodes"][0]["path"] == str(devices / "tty0")
        code = await proc.stop()
    assert code == 0, proc.error_output
    assert list(cdi_dir.glob("*.json")) == []  # removed on shutdown


# ----------------------------------------------------------------------------- as a user runs it
# Issue 18: each item runs the command in a subprocess on real files and checks the exit code
# and the one stderr line.


def test_version() -> None:
    result = devplugin("--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"devplugin-sdk {devplugin_sdk.__version__}"


@pytest.mark.parametrize(
    ("value", "cause"),
    [
        ("99999", "must be a TCP port number (0-65535), got '99999'"),
        ("-5", "must be a TCP port number (0-65535), got '-5'"),
        ("http", "must be a TCP port number (0-65535), got 'http'"),
    ],
)
def test_a_bad_metrics_port_is_one_line(value: str, cause: str) -> None:
    line = error_line(devplugin("run", "cli_target:TwoWidgets", f"--metrics-port={value}"))
    assert (
        line == f"devplugin run: error: argument --metrics-port: {cause} (see devplugin run --help)"
    )


def test_a_metrics_port_in_use_names_the_option_and_the_port(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = devplugin(
            "run",
            "cli_target:TwoWidgets",
            "--device-plugin-dir",
            str(tmp_path),
            "--metrics-port",
            str(port),
            "--metrics-host",
            "127.0.0.1",
        )
    assert error_line(result) == (
        f"devplugin: error: --metrics-port: {port} is in use on 127.0.0.1 (another process "
        "listens there); /healthz, /metrics and /status need a free port"
    )


def test_a_metrics_port_from_the_file_names_the_key(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = tmp_path / "c.yaml"
        config.write_text(
            f"devicePluginDir: {tmp_path}\nmetrics: {{port: {port}, host: 127.0.0.1}}\n"
        )
        result = devplugin("run", "cli_target:TwoWidgets", "--config", str(config))
    assert error_line(result).startswith(f"devplugin: error: metrics.port: {port} is in use")


def test_an_unresolvable_metrics_host_names_the_option(tmp_path: Path) -> None:
    result = devplugin(
        "run",
        "cli_target:TwoWidgets",
        "--device-plugin-dir",
        str(tmp_path),
        "--metrics-port",
        "9",
        "--metrics-host",
        "no-such-host.invalid",
    )
    assert error_line(result).startswith(
        "devplugin: error: --metrics-host: 'no-such-host.invalid': cannot resolve"
    )


@pytest.mark.parametrize(
    ("directory", "cause"),
    [
        ("FILE", "is not a directory"),
        # The errno's text as the C library words it, and our hint for a kernel filesystem.
        (
            "/proc/self",
            f"cannot create the plugin's socket there: {os.strerror(errno.ENOENT)} "
            "(a kernel filesystem?)",
        ),
        ("/sys", f"cannot create the plugin's socket there: {os.strerror(errno.EACCES)}"),
    ],
)
def test_a_device_plugin_dir_that_cannot_hold_a_socket_is_one_line(
    tmp_path: Path, directory: str, cause: str
) -> None:
    if directory == "FILE":
        directory = str(tmp_path / "a-file")
        Path(directory).touch()
    line = error_line(devplugin("run", "cli_target:TwoWidgets", "--device-plugin-dir", directory))
    assert line.startswith(f"devplugin: error: --device-plugin-dir: {directory}")
    assert cause in line
    assert list(tmp_path.iterdir()) in ([], [tmp_path / "a-file"])  # the check left nothing


def test_a_device_plugin_dir_from_the_file_names_the_key(tmp_path: Path) -> None:
    (tmp_path / "a-file").touch()
    config = tmp_path / "c.yaml"
    config.write_text(f"devicePluginDir: {tmp_path / 'a-file'}\n")
    line = error_line(devplugin("run", "cli_target:TwoWidgets", "--config", str(config)))
    assert line == f"devplugin: error: devicePluginDir: {tmp_path / 'a-file'} is not a directory"


def test_generic_without_a_config_says_it_needs_one() -> None:
    line = error_line(devplugin("run", "generic"))
    assert line.startswith(
        "devplugin: error: --config: the generic backend needs a configuration file "
        "(devplugin run generic --config FILE); without one: resources:"
    )


def test_a_factory_returning_something_else_is_one_line() -> None:
    line = error_line(devplugin("run", "json:JSONDecoder"))
    assert line == (
        "devplugin: error: target: json:JSONDecoder returned a JSONDecoder; expected a "
        "DevicePlugin or a list of them"
    )


def test_a_duplicate_key_in_the_file_names_both_lines(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(
        "backend: generic\nresources: []\nlogging: {level: info}\nresources:\n"
        "  - resourceName: example.com/x\n    paths: ['/dev/x*']\n"
    )
    line = error_line(devplugin("run", "--config", str(config)))
    assert line == (
        f"devplugin: error: resources: given twice, at lines 2 and 4 of {config}; "
        "YAML would silently keep only the last one"
    )


def test_a_misspelt_sdk_key_suggests_it_among_every_valid_key(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(
        "backend: generic\nloging: {level: debug}\n"
        "resources:\n  - resourceName: example.com/x\n    paths: ['/dev/x*']\n"
    )
    line = error_line(
        devplugin("run", "--config", str(config), "--device-plugin-dir", str(tmp_path))
    )
    assert line.startswith("devplugin: error: loging: unknown key; did you mean 'logging'?")
    assert (
        "or the SDK's (backend, devicePluginDir, registration, pluginsRegistryDir, rescanInterval, logging, metrics, cdi, api, dra)"
        in line
    )


def test_an_unsafe_config_file_is_one_line(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.symlink_to("/dev/zero")
    line = error_line(devplugin("run", "generic", "--config", str(config)))
    assert line == f"devplugin: error: {config}: not a regular file but a character device"


async def test_a_class_without_from_config_takes_a_file_of_sdk_keys(
    kubelet: FakeKubelet, tmp_path: Path
) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(
        f"backend: cli_target:NoFromConfig\ndevicePluginDir: {kubelet.directory}\n"
        "registration: kubelet\nlogging: {format: json}\n"
    )
    async with running("run", "--config", str(config)) as plugin:
        await kubelet.wait_for_allocatable("acme.com/plain", 1, timeout=15)
        assert await plugin.stop() == 0
    assert plugin.stderr
    assert all(line.startswith("{") for line in plugin.stderr)


async def test_a_class_without_from_config_refuses_backend_keys(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("backend: cli_target:NoFromConfig\nresources: []\n")
    line = error_line(devplugin("run", "--config", str(config)))
    assert line.startswith(
        "devplugin: error: --config: cli_target:NoFromConfig has no from_config() to take the "
        "file's backend keys (resources)"
    )


async def test_the_devplugin_script_imports_a_module_from_the_working_directory(
    kubelet: FakeKubelet, tmp_path: Path
) -> None:
    """The quickstart's `devplugin run acme_plugin:AcmePlugin`, through the console script."""
    script = Path(sys.executable).with_name("devplugin")
    if not script.exists():  # pragma: no cover - ./scripts/test installs it
        pytest.skip("the devplugin script is not installed beside this Python")
    (tmp_path / "here_plugin.py").write_text(
        "from devplugin_sdk import Device\nfrom devplugin_sdk.testing import StaticPlugin\n\n\n"
        "class HerePlugin(StaticPlugin):\n    def __init__(self) -> None:\n"
        "        super().__init__('acme.com/here', [Device('h0'), Device('h1')])\n"
    )
    async with running(
        "run",
        "here_plugin:HerePlugin",
        "--device-plugin-dir",
        str(kubelet.directory),
        cwd=tmp_path,
        script=str(script),
    ) as plugin:
        await kubelet.wait_for_allocatable("acme.com/here", 2, timeout=15)
        assert await plugin.stop() == 0


async def test_global_options_are_accepted_after_the_subcommand(
    kubelet: FakeKubelet, tmp_path: Path
) -> None:
    devices = tmp_path / "devs"
    devices.mkdir()
    (devices / "tty0").touch()
    config = tmp_path / "config.yaml"
    config.write_text(
        f"resources:\n  - resourceName: example.com/serial\n    paths: ['{devices}/tty*']\n"
    )
    async with running(
        "run",
        "generic",
        "--config",
        str(config),
        "--device-plugin-dir",
        str(kubelet.directory),
        "--log-format",
        "json",
        "--log-level",
        "debug",
    ) as plugin:
        await kubelet.wait_for_allocatable("example.com/serial", 1, timeout=15)
        await plugin.wait_for('"level": "debug"')
        assert await plugin.stop() == 0
    entries = [json.loads(line) for line in plugin.stderr]
    assert {e["logger"].split(".")[0] for e in entries} == {"devplugin_sdk"}  # item 8: no gRPC


async def test_debug_shows_library_loggers_only_when_named(kubelet: FakeKubelet) -> None:
    async with running(
        "--log-level",
        "debug,grpc=debug,asyncio=debug",
        "run",
        "cli_target:TwoWidgets",
        "--device-plugin-dir",
        str(kubelet.directory),
    ) as plugin:
        await kubelet.wait_for_allocatable("acme.com/widget", 2, timeout=15)
        await plugin.wait_for("DEBUG   grpc.")
        await plugin.wait_for("DEBUG   asyncio:")
        await plugin.wait_for("DEBUG   devplugin_sdk:")


async def test_without_prometheus_client_the_log_never_claims_metrics(
    kubelet: FakeKubelet, tmp_path: Path
) -> None:
    """A process where `import prometheus_client` fails, as on an install without the extra."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    code = (
        "import sys; sys.modules['prometheus_client'] = None\n"
        "from devplugin_sdk.cli import main\n"
        f"sys.exit(main(['run', 'cli_target:TwoWidgets', '--device-plugin-dir', "
        f"{str(kubelet.directory)!r}, '--metrics-port', '{port}', '--metrics-host', '127.0.0.1']))\n"
    )
    script = tmp_path / "no_metrics.py"
    script.write_text(code)
    async with running(str(script), script=sys.executable) as plugin:
        await kubelet.wait_for_allocatable("acme.com/widget", 2, timeout=15)
        (off,) = await plugin.wait_for("/metrics is off")
        (serving,) = await plugin.wait_for(f"on port {port}")
        assert await plugin.stop() == 0
    assert "pip install 'devplugin-sdk[metrics]'" in off
    assert "serving /healthz and /status on port" in serving


async def test_a_config_edited_in_place_is_reloaded_at_once(
    kubelet: FakeKubelet, tmp_path: Path
) -> None:
    """Written in place (same inode), not renamed: seen through the file's own watch, well
    before the directory's 5 s listing comparison could."""
    devices = tmp_path / "devs"
    devices.mkdir()
    (devices / "tty0").touch()
    (devices / "fuse").touch()
    config = tmp_path / "config.yaml"
    base = (
        f"backend: generic\ndevicePluginDir: {kubelet.directory}\nregistration: kubelet\n"
        f"resources:\n  - resourceName: example.com/serial\n    paths: ['{devices}/tty*']\n"
    )
    config.write_text(base)
    async with running("run", "--config", str(config)) as plugin:
        await kubelet.wait_for_allocatable("example.com/serial", 1, timeout=15)
        inode = config.stat().st_ino
        with config.open("a") as file:  # an editor saving in place, or `>>`
            file.write(f"  - resourceName: example.com/fuse\n    paths: ['{devices}/fuse']\n")
        assert config.stat().st_ino == inode
        await kubelet.wait_for_allocatable("example.com/fuse", 1, timeout=3)
        await plugin.wait_for("reloaded (")
        assert await plugin.stop() == 0


def test_a_plugins_registry_dir_that_is_a_file_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "a-file").touch()
    line = error_line(
        devplugin(
            "run",
            "cli_target:TwoWidgets",
            "--registration",
            "watcher",
            "--plugins-registry-dir",
            str(tmp_path / "a-file"),
        )
    )
    assert (
        line
        == f"devplugin: error: --plugins-registry-dir: {tmp_path / 'a-file'} is not a directory"
    )


def test_run_loads_nothing_it_does_not_need_before_register() -> None:
    """What `devplugin run` imports before Register: the conformance checks, the fake kubelet,
    DRA, CDI, the plugin-watcher protocol, the probe client and the HTTP endpoints wait until
    something asks for them, and watching a directory does not look for libc with
    ``ctypes.util`` (which runs ``ldconfig`` in a subprocess) (cold start)."""
    code = (
        "import sys, devplugin_sdk.cli, devplugin_sdk.config, devplugin_sdk.fswatch\n"
        "devplugin_sdk.cli.build_parser()\n"
        "devplugin_sdk.fswatch._Inotify().close()\n"
        "print(' '.join(sorted(m for m in sys.modules if m.startswith(('devplugin_sdk', 'ctypes')))))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split()
    assert "devplugin_sdk.runner" in loaded  # the check sees the modules it should
    deferred = [
        "devplugin_sdk.kubelet.conformance",
        "devplugin_sdk.kubelet.fake",
        "devplugin_sdk.dra",
        "devplugin_sdk.cdi",
        "devplugin_sdk._engine.plugin_watcher",
        "devplugin_sdk.kubelet.probe",
        "devplugin_sdk.healthz",
        "ctypes.util",
    ]
    assert "ctypes" in loaded
    assert [m for m in deferred if m in loaded] == []
