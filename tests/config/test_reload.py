"""Configuration: one file for `devplugin run`, hot reload that touches only what changed."""

from __future__ import annotations

import os
import shutil
import signal
import threading
from collections.abc import Sequence
from pathlib import Path

import anyio
import anyio.to_thread
import pytest
from sdk_helpers import widgets

from devplugin_sdk import DevicePlugin, runner
from devplugin_sdk.backends import generic
from devplugin_sdk.cli.runfile import RunConfig, parse_run_config
from devplugin_sdk.config import ConfigReader, load_yaml
from devplugin_sdk.errors import ConfigError
from devplugin_sdk.runner import Reload
from devplugin_sdk.testing import FakeKubelet, StaticPlugin, serving


def _write(path: Path, text: str) -> None:
    # Write then rename, as editors and ConfigMap updates do.
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _tree(tmp_path: Path) -> Path:
    dev = tmp_path / "root" / "dev"
    dev.mkdir(parents=True)
    for name in ("widget0", "widget1", "ttyS0", "ttyUSB0", "ttyUSB1", "fuse"):
        (dev / name).touch()
    return tmp_path / "root"


CONFIG = """
resources:
  - resourceName: example.com/widget
    paths: ["/dev/widget*"]
  - resourceName: example.com/serial
    paths: ["/dev/ttyS*"]
"""


def _generic_plugins(path: Path, root: Path) -> list[DevicePlugin]:
    """GenericPlugins from a small file of this test's own (the runner is under test here,
    not a backend's schema), re-rooted onto ``root``."""
    plugins: list[DevicePlugin] = []
    for entry in ConfigReader(load_yaml(path)).sections("resources", required=True):
        entry.known("resourceName", "paths", "share")
        plugins.append(
            generic.GenericPlugin(
                entry.string("resourceName"),
                list(entry.strings("paths", required=True)),
                entry.integer("share", 1, minimum=1),
                root=root,
            )
        )
    return plugins


async def test_reload_changes_only_what_changed(tmp_path: Path) -> None:
    root = _tree(tmp_path)
    config = tmp_path / "config.yaml"
    _write(config, CONFIG)

    failures = 0

    def load() -> Sequence[DevicePlugin]:
        nonlocal failures
        try:
            return _generic_plugins(config, root)
        except ConfigError:
            failures += 1
            raise

    reload = Reload(load=load, config_path=config, sighup=False)
    async with (
        FakeKubelet() as kubelet,
        serving(*load(), settings=kubelet.settings(), reload=reload),
    ):
        await kubelet.wait_for_allocatable("example.com/widget", 2)
        await kubelet.wait_for_allocatable("example.com/serial", 1)
        held = await kubelet.allocate("example.com/serial", 1)

        # serial moves to USB adapters; fuse is added; widget is untouched.
        _write(
            config,
            CONFIG.replace('["/dev/ttyS*"]', '["/dev/ttyUSB*"]')
            + '  - resourceName: example.com/fuse\n    paths: ["/dev/fuse"]\n    share: 3\n',
        )
        await kubelet.wait_for_allocatable("example.com/fuse", 3)
        await kubelet.wait_for_allocatable("example.com/serial", 2)
        assert len(kubelet.successful_registrations("example.com/widget")) == 1
        assert len(kubelet.successful_registrations("example.com/serial")) == 2
        assert kubelet.connections("example.com/serial") == 1  # never two registrations
        # The device a container still holds stays listed (Unhealthy) under the new config.
        serial = kubelet.devices("example.com/serial")
        assert serial[held.device_ids[0]].health == "Unhealthy"
        assert {i for i, d in serial.items() if d.healthy} == {"ttyUSB0", "ttyUSB1"}

        # A broken file keeps everything running as it was.
        _write(config, CONFIG.replace("widget*", 'widget*"]\n    share: 0\n    x: ["'))
        await kubelet.wait_for(lambda: failures == 1, what="the failed reload")
        assert kubelet.allocatable("example.com/fuse") == 3
        assert len(kubelet.successful_registrations("example.com/widget")) == 1

        # fuse removed: its plugin stops (the kubelet sees its stream end).
        _write(config, CONFIG)
        await kubelet.wait_for_allocatable("example.com/fuse", 0)
        assert not (kubelet.directory / "example.com_fuse.sock").exists()
        assert len(kubelet.successful_registrations("example.com/widget")) == 1


async def _sighup_handled(kubelet: FakeKubelet) -> None:
    """Wait until the reload loop handles SIGHUP (its default action ends the process)."""
    await kubelet.wait_for(
        lambda: signal.getsignal(signal.SIGHUP) not in (signal.SIG_DFL, None),
        what="a SIGHUP handler",
    )


async def test_sighup_reloads(kubelet: FakeKubelet) -> None:
    current: list[DevicePlugin] = [StaticPlugin("acme.com/a", widgets(1))]
    reload = Reload(load=lambda: list(current), sighup=True)
    async with serving(*current, settings=kubelet.settings(), reload=reload):
        await kubelet.wait_for_allocatable("acme.com/a", 1)
        await _sighup_handled(kubelet)
        current.append(StaticPlugin("acme.com/b", widgets(2)))
        os.kill(os.getpid(), signal.SIGHUP)
        await kubelet.wait_for_allocatable("acme.com/b", 2)
        assert len(kubelet.successful_registrations("acme.com/a")) == 1


async def test_a_reloaded_plugin_that_fails_does_not_stop_the_others(kubelet: FakeKubelet) -> None:
    tried = anyio.Event()

    class Broken(StaticPlugin):
        async def discover(self):  # type: ignore[no-untyped-def,override]
            tried.set()
            raise RuntimeError("no such device")

    current: list[DevicePlugin] = [StaticPlugin("acme.com/a", widgets(1))]
    reload = Reload(load=lambda: list(current), sighup=True)
    async with serving(*current, settings=kubelet.settings(), reload=reload) as running:
        await kubelet.wait_for_allocatable("acme.com/a", 1)
        await _sighup_handled(kubelet)
        current.append(Broken("acme.com/b", []))
        os.kill(os.getpid(), signal.SIGHUP)
        with anyio.fail_after(5):
            await tried.wait()
        assert running.resources == ["acme.com/a"]  # the failed one is gone, a still served
        current[1] = StaticPlugin("acme.com/b", widgets(1))
        os.kill(os.getpid(), signal.SIGHUP)
        await kubelet.wait_for_allocatable("acme.com/b", 1)
        assert kubelet.is_registered("acme.com/a")


def test_fingerprint_follows_public_configuration() -> None:
    a = generic.GenericPlugin("example.com/w", ["/dev/w*"])
    assert a.fingerprint() == generic.GenericPlugin("example.com/w", ["/dev/w*"]).fingerprint()
    assert (
        a.fingerprint()
        != generic.GenericPlugin("example.com/w", ["/dev/w*"], share=2).fingerprint()
    )


def test_fingerprint_is_equal_for_equal_sets_whatever_their_iteration_order() -> None:
    """Equal configurations never restart a resource on reload, even when sets held in them
    iterate in different orders (and so have different reprs)."""
    first = {1, 9}  # 1 and 9 share a slot in an 8-slot table: insertion order decides
    second: set[int] = set()
    second.add(9)
    second.add(1)
    assert first == second
    assert repr(first) != repr(second)

    class Keyed(StaticPlugin):
        def __init__(self, keys: set[int], env: dict[str, str]) -> None:
            super().__init__("acme.com/k", [])
            self.keys = keys
            self.env = env

    a = Keyed(first, {"A": "1", "B": "2"})
    b = Keyed(second, {"B": "2", "A": "1"})
    assert a.fingerprint() == b.fingerprint()
    assert a.fingerprint() != Keyed({1}, {"A": "1", "B": "2"}).fingerprint()


def test_run_config_splits_sdk_keys_from_backend_options() -> None:
    config = parse_run_config(
        {
            "backend": "generic",
            "devicePluginDir": "/tmp/dp",
            "registration": "watcher",
            "logging": {"level": "debug", "format": "json"},
            "metrics": {"port": 9450, "stuckAfter": 10},
            "resources": [{"resourceName": "a.com/b", "paths": ["/dev/b"]}],
        }
    )
    assert config == RunConfig(
        backend="generic",
        device_plugin_dir=Path("/tmp/dp"),
        registration="watcher",
        log_level="debug",
        log_format="json",
        metrics_port=9450,
        stuck_after=10.0,
        backend_options={"resources": [{"resourceName": "a.com/b", "paths": ["/dev/b"]}]},
    )
    assert RunConfig().restart_needed(config) == [
        "backend",
        "devicePluginDir",
        "registration",
        "metrics",
    ]


@pytest.mark.parametrize(
    ("data", "key", "reason"),
    [
        ({"registration": "magic"}, "registration", "must be one of auto, kubelet, watcher"),
        ({"logging": {"level": "loud"}}, "logging.level", "unknown log level 'loud'"),
        ({"logging": {"level": "debug,grpc"}}, "logging.level", "use LOGGER=LEVEL"),
        ({"metrics": {"stuckAfter": float("nan")}}, "metrics.stuckAfter", "> 0"),
        ({"logging": {"colour": True}}, "logging.colour", "unknown key"),
        ({"metrics": {"port": 70000}}, "metrics.port", "TCP port"),
        ({"metrics": {"stuckAfter": 0}}, "metrics.stuckAfter", "> 0"),
        ({"metrics": []}, "metrics", "must be a mapping"),
        ({"devicePluginDir": "relative/dir"}, "devicePluginDir", "absolute"),
        ({"cdi": {"directory": "cdi"}}, "cdi.directory", "absolute"),
        ({"cdi": {"dir": "/x"}}, "cdi.dir", "unknown key"),
    ],
)
def test_run_config_errors_name_the_key(data: dict[str, object], key: str, reason: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_run_config(data)
    assert caught.value.key == key
    assert reason in caught.value.reason


def test_a_level_spec_names_library_loggers() -> None:
    config = parse_run_config({"logging": {"level": "debug,grpc=info"}})
    assert config.log_level == "debug,grpc=info"


async def test_an_async_load_reads_in_a_worker_thread_and_builds_on_the_loop(
    kubelet: FakeKubelet, tmp_path: Path
) -> None:
    """The pattern `devplugin run` uses: the event loop keeps serving while the file is read."""
    root = _tree(tmp_path)
    config = tmp_path / "config.yaml"
    _write(config, CONFIG)
    threads: list[bool] = []

    def parse() -> list[DevicePlugin]:
        threads.append(threading.current_thread() is threading.main_thread())
        return _generic_plugins(config, root)

    async def load() -> list[DevicePlugin]:
        plugins = await anyio.to_thread.run_sync(parse)
        anyio.Event()  # constructors may need the loop: this runs on it
        return plugins

    reload = Reload(load=load, config_path=config, sighup=False)
    async with serving(*parse(), settings=kubelet.settings(), reload=reload):
        await kubelet.wait_for_allocatable("example.com/serial", 1)
        _write(config, CONFIG.replace('["/dev/ttyS*"]', '["/dev/ttyUSB*"]'))
        await kubelet.wait_for_allocatable("example.com/serial", 2)
    assert threads == [True, False]


async def test_a_write_in_place_reloads_without_waiting_for_the_directory_poll(
    kubelet: FakeKubelet, tmp_path: Path
) -> None:
    """Same inode, content rewritten: the file's own watch sees it (the directory's listing is
    compared only every 5 s, far beyond this wait)."""
    root = _tree(tmp_path)
    config = tmp_path / "config.yaml"
    _write(config, CONFIG)
    reload = Reload(load=lambda: _generic_plugins(config, root), config_path=config, sighup=False)
    async with serving(*_generic_plugins(config, root), settings=kubelet.settings(), reload=reload):
        await kubelet.wait_for_allocatable("example.com/serial", 1)
        inode = config.stat().st_ino
        with config.open("r+") as file:
            file.write(CONFIG.replace('["/dev/ttyS*"]', '["/dev/ttyUSB*"]'))
        assert config.stat().st_ino == inode
        await kubelet.wait_for_allocatable("example.com/serial", 2, timeout=3)


async def test_a_configmap_update_through_symlinks_reloads(
    kubelet: FakeKubelet, tmp_path: Path
) -> None:
    """config.yaml -> ..data/config.yaml, ..data -> ..v1; the update swaps ..data to ..v2."""
    root = _tree(tmp_path)
    volume = tmp_path / "volume"
    (volume / "..v1").mkdir(parents=True)
    (volume / "..v1" / "config.yaml").write_text(CONFIG)
    (volume / "..data").symlink_to("..v1")
    config = volume / "config.yaml"
    config.symlink_to("..data/config.yaml")
    reload = Reload(load=lambda: _generic_plugins(config, root), config_path=config, sighup=False)
    async with serving(*_generic_plugins(config, root), settings=kubelet.settings(), reload=reload):
        await kubelet.wait_for_allocatable("example.com/serial", 1)
        (volume / "..v2").mkdir()
        (volume / "..v2" / "config.yaml").write_text(
            CONFIG.replace('["/dev/ttyS*"]', '["/dev/ttyUSB*"]')
        )
        (volume / "..data_tmp").symlink_to("..v2")
        os.replace(volume / "..data_tmp", volume / "..data")
        shutil.rmtree(volume / "..v1")
        await kubelet.wait_for_allocatable("example.com/serial", 2, timeout=3)
        # The watch follows the new file: an edit of it in place is seen too.
        with (volume / "..v2" / "config.yaml").open("a") as file:
            file.write('  - resourceName: example.com/fuse\n    paths: ["/dev/fuse"]\n')
        await kubelet.wait_for_allocatable("example.com/fuse", 1, timeout=3)


async def test_a_fifo_swapped_in_is_an_error_and_never_blocks(
    kubelet: FakeKubelet, tmp_path: Path
) -> None:
    root = _tree(tmp_path)
    config = tmp_path / "config.yaml"
    _write(config, CONFIG)
    errors: list[str] = []

    async def load() -> list[DevicePlugin]:
        try:
            return await anyio.to_thread.run_sync(_generic_plugins, config, root)
        except ConfigError as exc:
            errors.append(str(exc))
            raise

    reload = Reload(load=load, config_path=config, sighup=False)
    async with serving(*_generic_plugins(config, root), settings=kubelet.settings(), reload=reload):
        await kubelet.wait_for_allocatable("example.com/serial", 1)
        fifo = tmp_path / "fifo"
        os.mkfifo(fifo)
        os.replace(fifo, config)
        await kubelet.wait_for(lambda: bool(errors), what="the refused reload")
        assert errors == [f"{config}: not a regular file but a FIFO"]
        assert kubelet.allocatable("example.com/widget") == 2  # still served
        _write(config, CONFIG.replace('["/dev/ttyS*"]', '["/dev/ttyUSB*"]'))
        await kubelet.wait_for_allocatable("example.com/serial", 2)


def test_the_digest_reads_only_regular_files(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("a: 1\n")
    first = runner._digest(path)
    assert first == runner._digest(path)
    path.write_text("a: 2\n")
    assert runner._digest(path) != first
    path.unlink()
    path.symlink_to("/dev/zero")
    assert runner._digest(path) == b"not a regular file but a character device"


async def test_a_change_right_after_serve_started_is_not_missed(
    kubelet: FakeKubelet, tmp_path: Path
) -> None:
    """serve() reports started only once the file is watched: an edit at once still counts,
    even with a load that reads in a worker thread."""
    config = tmp_path / "config.yaml"
    _write(config, "count: 1\n")

    def plugins() -> list[DevicePlugin]:
        count = ConfigReader(load_yaml(config)).integer("count", 1, minimum=1)
        return [StaticPlugin(f"acme.com/w{i}", widgets(1)) for i in range(count)]

    async def load() -> list[DevicePlugin]:
        return await anyio.to_thread.run_sync(plugins)

    reload = Reload(load=load, config_path=config, sighup=False)
    async with serving(*plugins(), settings=kubelet.settings(), reload=reload):
        _write(config, "count: 2\n")
        await kubelet.wait_for_allocatable("acme.com/w1", 1)


class _Versioned(StaticPlugin):
    """A StaticPlugin whose configuration (a public attribute) changes its fingerprint."""

    def __init__(self, resource_name: str, version: int) -> None:
        super().__init__(resource_name, widgets(1))
        self.version = version


async def test_a_plugin_replaced_while_its_register_is_in_flight_stops_alone() -> None:
    """grpc.aio raises its own CancelledError for a cancelled call; the stop of one plugin must
    not spill over and cancel the others, the reload loop or the replacement."""
    async with FakeKubelet(register_delay=0.5) as kubelet:
        current: list[DevicePlugin] = [_Versioned("acme.com/a", 1), _Versioned("acme.com/b", 1)]
        reload = Reload(load=lambda: list(current), sighup=True)
        async with serving(*current, settings=kubelet.settings(), reload=reload) as running:
            await _sighup_handled(kubelet)
            # Both Register calls are in flight: the kubelet answers after 0.5 s.
            await kubelet.wait_for(lambda: kubelet.register_calls >= 2, what="two Register calls")
            current[1] = _Versioned("acme.com/b", 2)
            os.kill(os.getpid(), signal.SIGHUP)
            await kubelet.wait_for(
                lambda: kubelet.register_calls >= 3, what="the replacement's Register"
            )
            kubelet.register_delay = 0.0
            await kubelet.wait_for_allocatable("acme.com/a", 1)
            await kubelet.wait_for_allocatable("acme.com/b", 1)
            assert running.resources == ["acme.com/a", "acme.com/b"]
