"""The generic backend on real temporary files: discovery, IDs, allocation, path-following health,
hot-plug, sharing and its configuration keys, through watch() and end to end against a
FakeKubelet."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sdk_helpers import first_rescan

from devplugin_sdk.backends import generic
from devplugin_sdk.backends.generic import GenericPlugin
from devplugin_sdk.config import load_yaml
from devplugin_sdk.errors import ConfigError
from devplugin_sdk.testing import FakeKubelet, serving, watching
from devplugin_sdk.types import DeviceNode, Health, HealthEvent, RescanEvent

WIDGET = "example.com/widget"


def make_dev(root: Path, *names: str) -> Path:
    """Create ``<root>/dev`` holding empty files ``names`` (paths relative to /dev)."""
    dev = root / "dev"
    dev.mkdir(exist_ok=True)
    for name in names:
        (dev / name).parent.mkdir(parents=True, exist_ok=True)
        (dev / name).touch()
    return dev


def widgets(root: Path, share: int = 1, interval: float = 30) -> GenericPlugin:
    """``/dev/widget*`` under ``root``. The long default interval leaves the work to inotify: no
    periodic rescan can stand in for a missed notification, or add events to a sequence."""
    return GenericPlugin(WIDGET, ["/dev/widget*"], share, root=root, health_interval=interval)


# ----------------------------------------------------------------------------- discovery


async def test_each_existing_match_is_one_healthy_device_named_after_its_file(
    tmp_path: Path,
) -> None:
    make_dev(tmp_path, "widget0", "widget1", "widget10", "widget2", "gadget0", "widgetdir/x")
    devices = await widgets(tmp_path).discover()
    # Directories never count; IDs come in natural order.
    assert [d.id for d in devices] == ["widget0", "widget1", "widget2", "widget10"]
    assert all(d.health is Health.HEALTHY for d in devices)


async def test_device_node_is_the_real_file_under_root_at_the_configured_path(
    tmp_path: Path,
) -> None:
    dev = make_dev(tmp_path, "widget0")
    (device,) = await widgets(tmp_path).discover()
    assert device.device_nodes == (DeviceNode(str(dev / "widget0"), "/dev/widget0", "rw"),)


async def test_without_root_host_and_container_paths_are_the_match(tmp_path: Path) -> None:
    make_dev(tmp_path, "widget0")
    plugin = GenericPlugin(WIDGET, [f"{tmp_path}/dev/widget*"])
    (device,) = await plugin.discover()
    path = str(tmp_path / "dev" / "widget0")
    assert device.device_nodes == (DeviceNode(path, path, "rw"),)
    assert device.id == "widget0"


async def test_ids_are_relative_to_the_patterns_common_directory(tmp_path: Path) -> None:
    make_dev(tmp_path, "ttyUSB0", "serial/by-id/usb-FTDI-if00", "net/tun", "fuse")
    plugin = GenericPlugin(
        "example.com/io",
        ["/dev/ttyUSB*", "/dev/serial/by-id/*", "/dev/net/tun", "/dev/fuse"],
        root=tmp_path,
    )
    ids = sorted(d.id for d in await plugin.discover())
    assert ids == ["fuse", "net_tun", "serial_by-id_usb-FTDI-if00", "ttyUSB0"]


async def test_a_literal_path_is_named_after_its_file(tmp_path: Path) -> None:
    make_dev(tmp_path, "net/tun")
    plugin = GenericPlugin("example.com/tun", ["/dev/net/tun"], root=tmp_path)
    (device,) = await plugin.discover()
    assert device.id == "tun"
    assert device.device_nodes[0].container_path == "/dev/net/tun"


async def test_deep_glob_ids_join_the_wildcard_levels(tmp_path: Path) -> None:
    make_dev(tmp_path, "bus/usb/001/002", "bus/usb/003/001")
    plugin = GenericPlugin("example.com/usb", ["/dev/bus/usb/*/*"], root=tmp_path)
    assert [d.id for d in await plugin.discover()] == ["001_002", "003_001"]


async def test_long_or_odd_names_get_short_unique_printable_ids(tmp_path: Path) -> None:
    long_a = "pci-0000:00:14.0-usb-0:1.4.3:1.0-" + "a" * 40
    long_b = "pci-0000:00:14.0-usb-0:1.4.3:1.0-" + "a" * 39 + "b"
    make_dev(tmp_path, long_a, long_b, "wid get", "a_b", "a/b")
    plugin = GenericPlugin("example.com/x", ["/dev/*", "/dev/a/*"], share=12, root=tmp_path)
    devices = await plugin.discover()
    ids = [d.id for d in devices]
    assert len(ids) == len(set(ids)) == 5 * 12
    assert all(len(i) <= 63 and i.isprintable() and " " not in i for i in ids)
    parents = {d.parent for d in devices}
    assert "a_b" in parents  # the first of the two that map to "a_b" keeps the plain name


async def test_a_root_with_glob_characters_in_its_name_is_taken_literally(tmp_path: Path) -> None:
    root = tmp_path / "odd[1]*?"
    root.mkdir()
    dev = make_dev(root, "widget0")
    plugin = widgets(root)
    (device,) = await plugin.discover()
    assert device.device_nodes[0].host_path == str(dev / "widget0")
    async with watching(plugin) as events:
        await first_rescan(events, 1)
        (dev / "widget0").unlink()
        assert await events.next_event() == HealthEvent(
            "widget0", Health.UNHEALTHY, f"{dev / 'widget0'} disappeared"
        )


async def test_a_vanished_match_stays_listed_unhealthy_and_a_dangling_link_counts_as_gone(
    tmp_path: Path,
) -> None:
    dev = make_dev(tmp_path, "widget0", "widget1", "target")
    (dev / "widget2").symlink_to(dev / "target")
    plugin = widgets(tmp_path)
    assert len(await plugin.discover()) == 3
    (dev / "widget0").unlink()
    (dev / "target").unlink()
    health = {d.id: d.health for d in await plugin.discover()}
    assert health == {
        "widget0": Health.UNHEALTHY,
        "widget1": Health.HEALTHY,
        "widget2": Health.UNHEALTHY,
    }


def test_constructor_rejects_misuse() -> None:
    with pytest.raises(ValueError, match="absolute"):
        GenericPlugin(WIDGET, ["dev/widget*"])
    with pytest.raises(ValueError, match="non-empty"):
        GenericPlugin(WIDGET, [])
    with pytest.raises(ValueError, match="share"):
        GenericPlugin(WIDGET, ["/dev/widget*"], share=0)
    with pytest.raises(ValueError, match="invalid resource name"):
        GenericPlugin("widget", ["/dev/widget*"])
    with pytest.raises(ValueError, match="health_interval"):
        GenericPlugin(WIDGET, ["/dev/widget*"], health_interval=0)


# ----------------------------------------------------------------------------- watch()


async def test_watch_pushes_unhealthy_on_unlink_and_healthy_on_return(tmp_path: Path) -> None:
    dev = make_dev(tmp_path, "widget0", "widget1")
    plugin = widgets(tmp_path)  # inotify only: no periodic rescan can help
    await plugin.discover()
    async with watching(plugin) as events:
        await first_rescan(events, 2)
        (dev / "widget1").unlink()
        event = await events.next_event()
        assert event == HealthEvent("widget1", Health.UNHEALTHY, f"{dev / 'widget1'} disappeared")
        (dev / "widget1").touch()
        event = await events.next_event()
        assert event == HealthEvent("widget1", Health.HEALTHY, f"{dev / 'widget1'} is back")


async def test_watch_states_every_known_match_once_armed(tmp_path: Path) -> None:
    dev = make_dev(tmp_path, "widget0", "widget1")
    plugin = widgets(tmp_path)
    await plugin.discover()
    (dev / "widget0").unlink()  # before the watch: only its first rescan can see it
    async with watching(plugin) as events:
        await first_rescan(events, 0)
        got = {await events.next_event(), await events.next_event()}
    assert got == {
        HealthEvent("widget0", Health.UNHEALTHY, f"{dev / 'widget0'} is missing"),
        HealthEvent("widget1", Health.HEALTHY, f"{dev / 'widget1'} is present"),
    }


async def test_the_periodic_rescan_catches_what_no_notification_shows(tmp_path: Path) -> None:
    # The link lives in the watched directory, its target elsewhere: removing the target
    # changes nothing inotify reports here, yet the link now dangles, so the device is gone.
    target = tmp_path / "elsewhere" / "real"
    target.parent.mkdir()
    target.touch()
    dev = make_dev(tmp_path)
    (dev / "widget0").symlink_to(target)
    plugin = widgets(tmp_path, interval=0.2)
    await plugin.discover()
    async with watching(plugin) as events:
        await first_rescan(events, 1)
        target.unlink()
        present = HealthEvent("widget0", Health.HEALTHY, f"{dev / 'widget0'} is present")
        while (event := await events.next_event()) == present:
            pass
    assert event == HealthEvent("widget0", Health.UNHEALTHY, f"{dev / 'widget0'} is missing")


async def test_watch_asks_for_a_rescan_when_a_new_match_appears(tmp_path: Path) -> None:
    dev = make_dev(tmp_path, "widget0")
    plugin = widgets(tmp_path)
    await plugin.discover()
    async with watching(plugin) as events:
        await first_rescan(events, 1)
        (dev / "gadget0").touch()  # not a match: nothing
        (dev / "widget1").touch()
        while not isinstance(event := await events.next_event(), RescanEvent):
            # The rescan re-states what it knows on the way.
            assert event == HealthEvent("widget0", Health.HEALTHY, f"{dev / 'widget0'} is present")
        assert "widget1" in event.reason
        assert "gadget0" not in event.reason
    assert [d.id for d in await plugin.discover()] == ["widget0", "widget1"]


async def test_watch_follows_new_directories_of_a_deep_glob(tmp_path: Path) -> None:
    dev = make_dev(tmp_path, "bus/usb/001/001")
    plugin = GenericPlugin(
        "example.com/usb", ["/dev/bus/usb/*/*"], root=tmp_path, health_interval=30
    )
    await plugin.discover()
    async with watching(plugin) as events:
        await first_rescan(events, 1)
        (dev / "bus/usb/002").mkdir()
        (dev / "bus/usb/002/005").touch()
        while not isinstance(await events.next_event(), RescanEvent):
            pass
        assert [d.id for d in await plugin.discover()] == ["001_001", "002_005"]
        # The new directory is watched now: a removal there is pushed at once.
        while True:
            event = await events.next_event()
            if isinstance(event, HealthEvent) and event.device_id == "002_005":
                assert event.health is Health.HEALTHY  # the new watch's first rescan
                break
        await anyio.wait_all_tasks_blocked()
        (dev / "bus/usb/002/005").unlink()
        event = await events.next_event()
        assert event == HealthEvent(
            "002_005", Health.UNHEALTHY, f"{dev / 'bus/usb/002/005'} disappeared"
        )


async def test_a_match_listed_unhealthy_that_returns_is_pushed_healthy_without_a_rescan(
    tmp_path: Path,
) -> None:
    dev = make_dev(tmp_path, "widget0")
    plugin = widgets(tmp_path)
    await plugin.discover()
    (dev / "widget0").unlink()
    (listed,) = await plugin.discover()
    assert listed.health is Health.UNHEALTHY
    async with watching(plugin) as events:
        await first_rescan(events, 1)
        (dev / "widget0").touch()
        assert await events.next_event() == HealthEvent(
            "widget0", Health.HEALTHY, f"{dev / 'widget0'} is back"
        )
        # The SDK lets a later Healthy report clear discovery's Unhealthy: nothing else comes.
        await anyio.wait_all_tasks_blocked()
        assert events.pending() == []


# ----------------------------------------------------------------------------- end to end


async def test_kubelet_lists_every_match_and_allocates_it_as_a_rw_device_node(
    kubelet: FakeKubelet, tmp_path: Path
) -> None:
    dev = make_dev(tmp_path, "widget0", "widget1", "widget2", "gadget0")
    async with serving(widgets(tmp_path), settings=kubelet.settings()):
        await kubelet.wait_for_allocatable(WIDGET, 3)
        assert sorted(kubelet.devices(WIDGET)) == ["widget0", "widget1", "widget2"]
        got = await kubelet.allocate(WIDGET, 1)
        (device_id,) = got.device_ids
        assert got.allocation.device_nodes == (
            DeviceNode(str(dev / device_id), f"/dev/{device_id}", "rw"),
        )


async def test_kubelet_sees_an_unlinked_match_unhealthy_and_healthy_when_recreated(
    kubelet: FakeKubelet, tmp_path: Path
) -> None:
    dev = make_dev(tmp_path, "widget0", "widget1", "widget2")
    async with serving(widgets(tmp_path), settings=kubelet.settings()):
        await kubelet.wait_for_allocatable(WIDGET, 3)
        (dev / "widget1").unlink()
        await kubelet.wait_for_health(WIDGET, "widget1", "Unhealthy")
        assert (kubelet.capacity(WIDGET), kubelet.allocatable(WIDGET)) == (3, 2)
        (dev / "widget1").touch()
        await kubelet.wait_for_health(WIDGET, "widget1", "Healthy")
        assert kubelet.allocatable(WIDGET) == 3


async def test_kubelet_sees_a_new_match_as_a_new_device_and_vanished_ones_stay_listed(
    kubelet: FakeKubelet, tmp_path: Path
) -> None:
    dev = make_dev(tmp_path, "widget0", "widget1")
    async with serving(widgets(tmp_path), settings=kubelet.settings()):
        await kubelet.wait_for_allocatable(WIDGET, 2)
        (dev / "widget1").unlink()
        await kubelet.wait_for_health(WIDGET, "widget1", "Unhealthy")
        (dev / "widget2").touch()
        await kubelet.wait_for(lambda: kubelet.capacity(WIDGET) == 3, what="widget2 listed")
        assert kubelet.devices(WIDGET)["widget1"].health == "Unhealthy"
        assert kubelet.allocatable(WIDGET) == 2
        # widget1 is listed Unhealthy after that rescan; its return must still lift it.
        (dev / "widget1").touch()
        await kubelet.wait_for_allocatable(WIDGET, 3)


async def test_share_three_gives_three_ids_per_match_that_fail_together(
    kubelet: FakeKubelet, tmp_path: Path
) -> None:
    dev = make_dev(tmp_path, "widget0", "widget1")
    async with serving(widgets(tmp_path, share=3), settings=kubelet.settings()):
        await kubelet.wait_for_allocatable(WIDGET, 6)
        assert sorted(kubelet.devices(WIDGET)) == [
            f"widget{i}::{n}" for i in range(2) for n in range(3)
        ]
        (dev / "widget0").unlink()
        await kubelet.wait_for_allocatable(WIDGET, 3)
        unhealthy = {i for i, d in kubelet.devices(WIDGET).items() if not d.healthy}
        assert unhealthy == {"widget0::0", "widget0::1", "widget0::2"}


# ----------------------------------------------------------------------------- configuration


def test_from_config_builds_one_plugin_per_resource() -> None:
    plugins = generic.from_config(
        {
            "healthInterval": 0.5,
            "resources": [
                {"resourceName": "example.com/serial", "paths": ["/dev/ttyUSB*", "/dev/ttyACM*"]},
                {"resourceName": "example.com/fuse", "paths": ["/dev/fuse"], "share": 32},
            ],
        }
    )
    assert all(isinstance(p, GenericPlugin) for p in plugins)
    assert [
        (p.resource_name, p.patterns, p.share, p.health_interval)
        for p in plugins
        if isinstance(p, GenericPlugin)
    ] == [
        ("example.com/serial", ("/dev/ttyUSB*", "/dev/ttyACM*"), 1, 0.5),
        ("example.com/fuse", ("/dev/fuse",), 32, 0.5),
    ]


def test_from_config_defaults_to_a_rescan_every_two_seconds() -> None:
    (plugin,) = generic.from_config({"resources": [entry()]})
    assert plugin.health_interval == 2.0


async def test_a_configuration_names_the_real_paths(kubelet: FakeKubelet, tmp_path: Path) -> None:
    """No re-rooting from a configuration: host and container path are the configured match."""
    dev = make_dev(tmp_path, "widget0", "widget1")
    (plugin,) = generic.from_config({"resources": [entry(paths=[f"{dev}/widget*"])]})
    async with serving(plugin, settings=kubelet.settings()):
        await kubelet.wait_for_allocatable(WIDGET, 2)
        got = await kubelet.allocate(WIDGET, 1)
        path = str(dev / got.device_ids[0])
        assert got.allocation.device_nodes == (DeviceNode(path, path, "rw"),)
        (dev / "widget1").unlink()
        await kubelet.wait_for_health(WIDGET, "widget1", "Unhealthy")


async def test_paths_under_dev_are_read_under_dev_root_and_handed_over_as_host_paths(
    kubelet: FakeKubelet, tmp_path: Path
) -> None:
    dev = make_dev(tmp_path, "widget0", "widget1")
    config = {"devRoot": str(dev), "resources": [entry()]}
    (plugin,) = generic.from_config(config)
    async with serving(plugin, settings=kubelet.settings()):
        await kubelet.wait_for_allocatable(WIDGET, 2)
        got = await kubelet.allocate(WIDGET, 1)
        (device_id,) = got.device_ids
        host_path = f"/dev/{device_id}"  # the host's path: what the runtime opens
        assert got.allocation.device_nodes == (DeviceNode(host_path, host_path, "rw"),)
        (dev / "widget1").unlink()  # followed where it is read
        await kubelet.wait_for_health(WIDGET, "widget1", "Unhealthy")


def entry(**fields: Any) -> dict[str, Any]:
    return {"resourceName": "example.com/widget", "paths": ["/dev/widget*"], **fields}


@pytest.mark.parametrize(
    ("config", "key", "reason"),
    [
        ([], "<root>", "mapping"),
        ({}, "resources", "non-empty list"),
        ({"resources": []}, "resources", "non-empty list"),
        ({"resources": [entry()], "extra": 1}, "extra", "unknown key"),
        ({"resources": [entry()], "healthinterval": 1}, "healthinterval", "'healthInterval'?"),
        ({"resources": [entry()], "healthInterval": 0}, "healthInterval", "> 0"),
        ({"resources": [entry()], "healthInterval": "2s"}, "healthInterval", "seconds"),
        ({"resources": ["x"]}, "resources[0]", "mapping"),
        ({"resources": [entry(), entry(color="red")]}, "resources[1].color", "unknown key"),
        (
            {"resources": [{"name": "example.com/widget", "paths": ["/dev/widget*"]}]},
            "resources[0].name",
            "renamed to resourceName",
        ),
        ({"resources": [{"paths": ["/dev/x"]}]}, "resources[0].resourceName", "required"),
        ({"resources": [entry(resourceName=None)]}, "resources[0].resourceName", "string"),
        ({"resources": [entry(resourceName="widget")]}, "resources[0].resourceName", "no '/'"),
        (
            {"resources": [entry(resourceName="kubernetes.io/x")]},
            "resources[0].resourceName",
            "reserved",
        ),
        (
            {"resources": [entry(), entry(paths=["/dev/x"])]},
            "resources[1].resourceName",
            "duplicate of resources[0].resourceName",
        ),
        (
            {"resources": [entry(resourceName=f"{'a' * 60}.{'b' * 60}.com/{'x' * 60}")]},
            "resources[0].resourceName",
            "too long for a unix socket path",
        ),
        ({"resources": [entry(paths=None)]}, "resources[0].paths", "required"),
        ({"resources": [entry(paths=[])]}, "resources[0].paths", "non-empty list"),
        ({"resources": [entry(paths="/dev/x*")]}, "resources[0].paths", "non-empty list"),
        ({"resources": [entry(paths=["/dev/a", ""])]}, "resources[0].paths[1]", "non-empty"),
        ({"resources": [entry(paths=["dev/x*"])]}, "resources[0].paths[0]", "absolute"),
        ({"resources": [entry(paths=["/dev/.."])]}, "resources[0].paths[0]", "not /"),
        ({"resources": [entry(paths=[7])]}, "resources[0].paths[0]", "string"),
        ({"resources": [entry(share=0)]}, "resources[0].share", ">= 1"),
        (
            {"resources": [entry(), entry(resourceName="a.com/b", share=True)]},
            "resources[1].share",
            "integer",
        ),
        ({"resources": [entry(share="2")]}, "resources[0].share", "integer"),
    ],
)
def test_config_errors_name_the_key_and_the_reason(config: Any, key: str, reason: str) -> None:
    with pytest.raises(ConfigError) as caught:
        generic.from_config(config)
    assert caught.value.key == key
    assert reason in caught.value.reason


# What YAML can hold, biased towards the keys and values the backend reads.
_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-3, max_value=40),
    st.floats(allow_nan=True),
    st.sampled_from(["", "/", "/dev/x*", "dev/x", "/dev/..", "a.com/b", "x", "/dev/\0"]),
    st.text(max_size=8),
)
_KEYS = st.sampled_from(["resources", "healthInterval", "resourceName", "paths", "share", "name"])
_VALUES = st.recursive(
    _SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_KEYS, inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(config=st.dictionaries(_KEYS, _VALUES, max_size=3))
def test_from_config_raises_nothing_but_config_error(config: dict[str, Any]) -> None:
    errors: list[ConfigError] = []
    try:
        plugins = generic.from_config(config)
    except ConfigError as error:
        errors.append(error)  # anything else fails the test
        plugins = []
    assert all(e.key and e.reason for e in errors)
    assert bool(plugins) != bool(errors)
    assert all(isinstance(p, GenericPlugin) for p in plugins)


def test_a_yaml_file_gives_from_config_what_it_takes(tmp_path: Path) -> None:
    path = tmp_path / "generic.yaml"
    path.write_text(
        "healthInterval: 5\n"
        "resources:\n"
        "  - resourceName: example.com/widget   # extended resource name\n"
        '    paths: ["/dev/widget*"]\n'
        "    share: 2\n"
    )
    (plugin,) = generic.from_config(load_yaml(path))
    assert isinstance(plugin, GenericPlugin)
    assert (plugin.resource_name, plugin.patterns, plugin.share, plugin.health_interval) == (
        WIDGET,
        ("/dev/widget*",),
        2,
        5.0,
    )
