"""The generic backend beyond one match per device, on fake host trees (devplugin_sdk.testing.
device_trees): groups of paths in step and by PCI function, per-path options, shared paths, USB
devices, sysfsRoot/devRoot, the warning for a path that matches nothing, and the configuration
errors of groups, through from_config and end to end against a FakeKubelet."""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sdk_helpers import first_rescan

from devplugin_sdk.backends import generic
from devplugin_sdk.backends.generic import GenericPlugin, Group, PathSpec, UsbSpec
from devplugin_sdk.errors import ConfigError
from devplugin_sdk.testing import AdmissionError, FakeKubelet, serving, watching
from devplugin_sdk.testing.device_trees import DeviceHost, amd_gpu_host, solarflare_host, usb_host
from devplugin_sdk.types import Device, DeviceNode, Health, HealthEvent, Mount, RescanEvent

ONLOAD = "solarflare.com/onload"
GPU = "amd.com/gpu"
AMD_GPU_GROUP: dict[str, Any] = {
    "groupBy": "pciDevice",
    "pciVendors": ["1002"],
    "paths": [{"path": "/dev/dri/renderD*"}, {"path": "/dev/dri/card*"}],
    "shared": [{"path": "/dev/kfd"}],
}


def plugin(host: DeviceHost, resource: str, **entry: Any) -> GenericPlugin:
    """The one plugin of a configuration with this resource entry, reading ``host``'s trees."""
    config = {
        "sysfsRoot": str(host.sysfs_root),
        "devRoot": str(host.dev_root),
        "healthInterval": 30,  # inotify only: no periodic rescan stands in for a missed event
        "resources": [{"resourceName": resource, **entry}],
    }
    (made,) = generic.from_config(config)
    assert isinstance(made, GenericPlugin)
    return made


def by_id(devices: Sequence[Device]) -> dict[str, Device]:
    return {device.id: device for device in devices}


def nodes(*paths: str, permissions: str = "rw") -> tuple[DeviceNode, ...]:
    return tuple(DeviceNode(path, path, permissions) for path in paths)


# ----------------------------------------------------------------------------- groups in step


ONLOAD_GROUP: dict[str, Any] = {
    "count": 4,
    "paths": [
        {"path": "/dev/onload"},
        {"path": "/dev/onload_epoll"},
        {"path": "/dev/sfc_char", "optional": True},
    ],
}


async def test_a_group_of_paths_is_one_device_of_every_path_shared_count_ways(
    tmp_path: Path,
) -> None:
    host = solarflare_host(tmp_path)
    devices = await plugin(host, ONLOAD, groups=[ONLOAD_GROUP]).discover()
    assert [d.id for d in devices] == [f"onload::{n}" for n in range(4)]
    # The kubelet gets host paths (/dev/...), read under devRoot.
    expected = nodes("/dev/onload", "/dev/onload_epoll", "/dev/sfc_char")
    assert {d.device_nodes for d in devices} == {expected}
    assert {d.parent for d in devices} == {"onload"}
    assert all(d.health is Health.HEALTHY for d in devices)


async def test_a_missing_optional_path_leaves_the_device_healthy_without_it(
    kubelet: FakeKubelet, tmp_path: Path
) -> None:
    host = solarflare_host(tmp_path)
    host.remove_node("sfc_char")
    async with serving(plugin(host, ONLOAD, groups=[ONLOAD_GROUP]), settings=kubelet.settings()):
        await kubelet.wait_for_allocatable(ONLOAD, 4)
        got = await kubelet.allocate(ONLOAD, 1)
        assert got.allocation.device_nodes == nodes("/dev/onload", "/dev/onload_epoll")


async def test_an_optional_path_is_listed_with_the_device_while_it_is_there(
    tmp_path: Path,
) -> None:
    host = solarflare_host(tmp_path)
    host.remove_node("sfc_char")
    onload = plugin(host, ONLOAD, groups=[ONLOAD_GROUP])
    (first, *_) = await onload.discover()
    assert first.device_nodes == nodes("/dev/onload", "/dev/onload_epoll")
    dev = host.dev_root
    present = HealthEvent("onload", Health.HEALTHY, f"{dev}/onload, {dev}/onload_epoll are present")
    async with watching(onload) as events:
        await first_rescan(events, 1)
        host.restore_node("sfc_char")
        assert isinstance(await events.next_event(), RescanEvent)
        assert await events.next_event() == present
        (first, *_) = await onload.discover()
        assert first.device_nodes == nodes("/dev/onload", "/dev/onload_epoll", "/dev/sfc_char")
        # When it goes, that is pushed at once, and the device stays Healthy.
        host.remove_node("sfc_char")
        assert await events.next_event() == HealthEvent(
            "onload", Health.HEALTHY, f"{dev}/sfc_char disappeared (optional)"
        )
        assert isinstance(await events.next_event(), RescanEvent)
        assert await events.next_event() == present
    (first, *_) = await onload.discover()
    assert first.device_nodes == nodes("/dev/onload", "/dev/onload_epoll")


async def test_an_optional_path_gone_since_discovery_is_left_out_of_the_allocation(
    tmp_path: Path,
) -> None:
    host = solarflare_host(tmp_path)
    onload = plugin(host, ONLOAD, groups=[ONLOAD_GROUP])
    devices = await onload.discover()
    host.remove_node("sfc_char")  # the runtime would fail a container given a missing path
    allocation = await onload.allocate(devices[:2])
    assert allocation.device_nodes == nodes("/dev/onload", "/dev/onload_epoll")


async def test_a_group_is_unhealthy_while_a_required_path_is_gone_and_back_when_it_returns(
    kubelet: FakeKubelet, tmp_path: Path
) -> None:
    host = solarflare_host(tmp_path)
    async with serving(plugin(host, ONLOAD, groups=[ONLOAD_GROUP]), settings=kubelet.settings()):
        await kubelet.wait_for_allocatable(ONLOAD, 4)
        host.remove_node("onload_epoll")
        await kubelet.wait_for_allocatable(ONLOAD, 0)
        assert kubelet.capacity(ONLOAD) == 4  # listed, Unhealthy
        with pytest.raises(AdmissionError):
            await kubelet.allocate(ONLOAD, 1)
        host.restore_node("onload_epoll")
        await kubelet.wait_for_allocatable(ONLOAD, 4)


async def test_globs_of_a_group_are_joined_in_step_and_a_missing_partner_is_unhealthy(
    tmp_path: Path,
) -> None:
    host = DeviceHost(tmp_path)
    for name in ("pcmC0D0c", "controlC0", "pcmC1D0c", "controlC1", "pcmC2D0c"):
        host.restore_node(f"snd/{name}")
    capture = {
        "paths": [{"path": "/dev/snd/pcmC*D0c"}, {"path": "/dev/snd/controlC*"}],
    }
    devices = by_id(await plugin(host, "example.com/capture", groups=[capture]).discover())
    assert list(devices) == ["pcmC0D0c", "pcmC1D0c", "pcmC2D0c"]
    assert devices["pcmC1D0c"].device_nodes == nodes("/dev/snd/pcmC1D0c", "/dev/snd/controlC1")
    assert devices["pcmC1D0c"].health is Health.HEALTHY
    # The third capture device has no third control device: listed, Unhealthy.
    assert devices["pcmC2D0c"].device_nodes == nodes("/dev/snd/pcmC2D0c")
    assert devices["pcmC2D0c"].health is Health.UNHEALTHY


async def test_several_groups_of_one_resource_each_give_their_devices(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    host = DeviceHost(tmp_path)
    for name in ("ttyUSB0", "ttyUSB1", "ttyACM0", "fuse"):
        host.restore_node(name)
    groups = [
        {"paths": [{"path": "/dev/ttyUSB*"}]},
        {"paths": [{"path": "/dev/ttyACM*"}]},
        {"paths": [{"path": "/dev/fuse"}], "count": 2},
        {"paths": [{"path": "/dev/tty*"}]},  # every match is taken already: nothing new
    ]
    with caplog.at_level(logging.WARNING, logger="devplugin_sdk.backends.generic"):
        devices = await plugin(host, "example.com/io", groups=groups).discover()
    assert [d.id for d in devices] == ["fuse::0", "fuse::1", "ttyACM0", "ttyUSB0", "ttyUSB1"]
    assert caplog.records == []  # /dev/tty* matches: no warning, though it adds nothing


# ----------------------------------------------------------------------------- per-path options


async def test_mount_path_puts_a_match_elsewhere_in_the_container(tmp_path: Path) -> None:
    host = DeviceHost(tmp_path)
    for name in ("ttyUSB0", "ttyUSB1", "video0"):
        host.restore_node(name)
    groups = [
        {"paths": [{"path": "/dev/ttyUSB*", "mountPath": "/dev/serial/"}]},
        {"paths": [{"path": "/dev/video0", "mountPath": "/dev/camera"}]},
    ]
    devices = by_id(await plugin(host, "example.com/io", groups=groups).discover())
    assert devices["ttyUSB1"].device_nodes == (
        DeviceNode("/dev/ttyUSB1", "/dev/serial/ttyUSB1", "rw"),
    )
    assert devices["video0"].device_nodes == (DeviceNode("/dev/video0", "/dev/camera", "rw"),)


async def test_a_mount_is_a_bind_mount_of_a_file_or_directory_read_only_if_asked(
    kubelet: FakeKubelet, tmp_path: Path
) -> None:
    host = DeviceHost(tmp_path)
    for name in ("controlC0", "pcmC0D0p"):
        host.restore_node(f"snd/{name}")
    library = tmp_path / "opt" / "vendor" / "lib"
    library.mkdir(parents=True)
    groups = [
        {
            "count": 2,
            "paths": [
                {"path": "/dev/snd", "type": "Mount"},
                {"path": str(library), "type": "Mount", "readOnly": True, "mountPath": "/opt/v"},
            ],
        }
    ]
    sound = plugin(host, "example.com/sound", groups=groups)
    async with serving(sound, settings=kubelet.settings()):
        await kubelet.wait_for_allocatable("example.com/sound", 2)
        got = await kubelet.allocate("example.com/sound", 1)
        assert got.allocation.device_nodes == ()
        # Paths outside /dev are used as written.
        assert got.allocation.mounts == (
            Mount("/dev/snd", "/dev/snd", read_only=False),
            Mount(str(library), "/opt/v", read_only=True),
        )
        # A mount's directory going away is a device going away.
        library.rename(library.with_name("moved"))
        await kubelet.wait_for_allocatable("example.com/sound", 0)
        library.with_name("moved").rename(library)
        await kubelet.wait_for_allocatable("example.com/sound", 2)


async def test_permissions_set_the_cgroup_access_of_a_device_node(tmp_path: Path) -> None:
    host = DeviceHost(tmp_path)
    for name in ("video0", "watchdog"):
        host.restore_node(name)
    groups = [
        {"paths": [{"path": "/dev/video0", "permissions": "r"}]},
        {"paths": [{"path": "/dev/watchdog", "permissions": "rwm"}]},
    ]
    devices = by_id(await plugin(host, "example.com/io", groups=groups).discover())
    assert devices["video0"].device_nodes == nodes("/dev/video0", permissions="r")
    assert devices["watchdog"].device_nodes == nodes("/dev/watchdog", permissions="rwm")


def test_path_specs_refuse_misuse() -> None:
    with pytest.raises(ValueError, match="absolute"):
        PathSpec("dev/x")
    with pytest.raises(ValueError, match="permissions"):
        PathSpec("/dev/x", permissions="rx")
    with pytest.raises(ValueError, match="read_only is for a Mount"):
        PathSpec("/dev/x", read_only=True)
    with pytest.raises(ValueError, match="type"):
        PathSpec("/dev/x", type="Socket")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="paths or usb"):
        Group()
    with pytest.raises(ValueError, match="group_by"):
        Group(paths=(PathSpec("/opt/x"),), group_by="pciDevice")
    with pytest.raises(ValueError, match="hex"):
        UsbSpec("20a0x", "41e5")
    with pytest.raises(ValueError, match="not both"):
        GenericPlugin("a.com/b", ["/dev/x"], groups=[Group(paths=(PathSpec("/dev/y"),))])


# ----------------------------------------------------------------------------- by PCI function


async def test_group_by_pci_device_makes_one_device_per_gpu_with_its_numa_node(
    tmp_path: Path,
) -> None:
    host = amd_gpu_host(tmp_path)
    devices = by_id(await plugin(host, GPU, groups=[AMD_GPU_GROUP]).discover())
    # The BMC's display-only card0 is not a GPU: no render node, another vendor.
    assert list(devices) == ["0000:03:00.0", "0000:83:00.0"]
    first, second = devices.values()
    assert first.device_nodes == nodes("/dev/dri/renderD128", "/dev/dri/card1", "/dev/kfd")
    assert second.device_nodes == nodes("/dev/dri/renderD129", "/dev/dri/card2", "/dev/kfd")
    assert (first.numa_nodes, second.numa_nodes) == ((0,), (1,))
    assert first.attributes["pciAddress"] == "0000:03:00.0"


async def test_pci_vendors_keep_other_vendors_cards_out(tmp_path: Path) -> None:
    host = amd_gpu_host(tmp_path)
    # An Intel integrated GPU: card and render node, another vendor.
    host.add_pci_function(
        "0000:00:02.0", vendor="0x8086", device="0x4680", pci_class="0x030000", driver="i915"
    )
    host.add_drm_card("0000:00:02.0", card=3, render=130)
    group = {key: value for key, value in AMD_GPU_GROUP.items() if key != "pciVendors"}
    every = by_id(await plugin(host, GPU, groups=[group]).discover())
    amd = by_id(await plugin(host, GPU, groups=[AMD_GPU_GROUP]).discover())
    assert list(every) == ["0000:00:02.0", "0000:03:00.0", "0000:83:00.0"]
    assert every["0000:00:02.0"].numa_nodes == ()  # numa_node -1: none reported
    assert list(amd) == ["0000:03:00.0", "0000:83:00.0"]


async def test_a_gpu_losing_a_node_is_unhealthy_and_kfd_going_takes_every_gpu(
    kubelet: FakeKubelet, tmp_path: Path
) -> None:
    host = amd_gpu_host(tmp_path)
    async with serving(plugin(host, GPU, groups=[AMD_GPU_GROUP]), settings=kubelet.settings()):
        await kubelet.wait_for_allocatable(GPU, 2)
        assert kubelet.devices(GPU)["0000:83:00.0"].numa_nodes == (1,)
        host.remove_node("dri/renderD129")
        await kubelet.wait_for_health(GPU, "0000:83:00.0", "Unhealthy")
        assert kubelet.devices(GPU)["0000:03:00.0"].healthy
        host.restore_node("dri/renderD129")
        await kubelet.wait_for_health(GPU, "0000:83:00.0", "Healthy")
        host.remove_node("kfd")
        await kubelet.wait_for_allocatable(GPU, 0)
        host.restore_node("kfd")
        await kubelet.wait_for_allocatable(GPU, 2)
        # Two GPUs in one container: /dev/kfd once.
        got = await kubelet.allocate(GPU, 2)
        paths = [node.container_path for node in got.allocation.device_nodes]
        assert sorted(paths) == sorted(
            [
                *("/dev/dri/renderD128", "/dev/dri/card1"),
                *("/dev/dri/renderD129", "/dev/dri/card2"),
                "/dev/kfd",
            ]
        )


async def test_a_character_device_node_is_found_through_sys_dev_char(tmp_path: Path) -> None:
    """On a real host the nodes are character devices: their sysfs device is
    /sys/dev/char/MAJOR:MINOR, as libudev finds it, whatever the node's name."""
    host = amd_gpu_host(tmp_path)
    render = host.dev_root / "dri" / "renderD128"
    render.unlink()
    try:
        os.mknod(render, 0o600 | stat.S_IFCHR, os.makedev(226, 128))
    except PermissionError:
        pytest.skip("creating a character device needs CAP_MKNOD")
    # Its class device no longer says where the node is: only /sys/dev/char can find it.
    uevent = host.sysfs_root / "class" / "drm" / "renderD128" / "uevent"
    uevent.write_text("MAJOR=226\nMINOR=128\n")
    devices = by_id(await plugin(host, GPU, groups=[AMD_GPU_GROUP]).discover())
    assert devices["0000:03:00.0"].device_nodes[0] == DeviceNode(
        "/dev/dri/renderD128", "/dev/dri/renderD128", "rw"
    )


async def test_a_node_with_no_pci_device_is_left_out_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    host = amd_gpu_host(tmp_path)
    group = {"groupBy": "pciDevice", "paths": [{"path": "/dev/kfd"}]}
    gpus = plugin(host, GPU, groups=[group])
    with caplog.at_level(logging.WARNING, logger="devplugin_sdk.backends.generic"):
        assert await gpus.discover() == []
        await gpus.discover()
    [record] = caplog.records
    assert record.getMessage() == (
        f"{GPU}: {host.dev_root / 'kfd'} belongs to no PCI device in {host.sysfs_root}; left out"
    )


# ----------------------------------------------------------------------------- USB


SERIAL = "example.com/serial"


async def test_usb_devices_are_matched_by_vendor_and_product_one_device_per_port(
    tmp_path: Path,
) -> None:
    host = usb_host(tmp_path)
    usb = [
        {"vendor": "0403", "product": "6001", "include": ["tty"]},
        {"vendor": "2341", "product": "0043", "include": ["tty"]},
    ]
    devices = by_id(await plugin(host, SERIAL, groups=[{"usb": usb}]).discover())
    assert list(devices) == ["1-3", "1-4.2"]
    assert devices["1-4.2"].device_nodes == nodes("/dev/bus/usb/001/005", "/dev/ttyUSB0")
    assert devices["1-3"].device_nodes == nodes("/dev/bus/usb/001/003", "/dev/ttyACM0")
    assert devices["1-3"].attributes["usbId"] == "2341:0043"


async def test_usb_include_hidraw_and_serial_select_one_device(tmp_path: Path) -> None:
    host = usb_host(tmp_path)
    host.plug_usb("1-2", vendor="20a0", product="41e5", serial="BS999999-3.1", hidraw="hidraw1")
    by_serial = {"vendor": "20a0", "product": "41e5", "serial": "BS030514-3.1"}
    one = by_id(
        await plugin(host, "example.com/blinkstick", groups=[{"usb": [by_serial]}]).discover()
    )
    assert list(one) == ["1-1"]
    assert one["1-1"].device_nodes == nodes("/dev/bus/usb/001/002")  # no include: usbfs only
    every = [{"vendor": "20A0", "product": "41E5", "include": ["hidraw"]}]
    both = by_id(await plugin(host, "example.com/blinkstick", groups=[{"usb": every}]).discover())
    assert both["1-2"].device_nodes == nodes("/dev/bus/usb/001/006", "/dev/hidraw1")


async def test_a_hub_is_handed_over_without_the_nodes_of_devices_behind_it(
    tmp_path: Path,
) -> None:
    host = usb_host(tmp_path)
    hub = [{"vendor": "05e3", "product": "0610", "include": ["tty"]}]
    (device,) = await plugin(host, "example.com/hub", groups=[{"usb": hub}]).discover()
    assert device.device_nodes == nodes("/dev/bus/usb/001/004")


async def test_an_unplugged_usb_device_is_unhealthy_at_once_and_healthy_when_plugged_back(
    kubelet: FakeKubelet, tmp_path: Path
) -> None:
    host = usb_host(tmp_path)
    usb = [{"vendor": "0403", "product": "6001", "include": ["tty"]}]
    async with serving(plugin(host, SERIAL, groups=[{"usb": usb}]), settings=kubelet.settings()):
        await kubelet.wait_for_allocatable(SERIAL, 1)
        host.unplug_usb("1-4.2")
        await kubelet.wait_for_health(SERIAL, "1-4.2", "Unhealthy")
        # Plugged back into the same port: a new usbfs node, the same device ID.
        host.plug_usb("1-4.2", vendor="0403", product="6001", serial="A50285BI", tty="ttyUSB0")
        await kubelet.wait_for_health(SERIAL, "1-4.2", "Healthy")
        got = await kubelet.allocate(SERIAL, 1)
        assert got.allocation.device_nodes == nodes("/dev/bus/usb/001/006", "/dev/ttyUSB0")
        # A second adapter in another port is a second device.
        host.plug_usb("1-2", vendor="0403", product="6001", serial="FT0002", tty="ttyUSB1")
        await kubelet.wait_for_allocatable(SERIAL, 2)
        assert sorted(kubelet.devices(SERIAL)) == ["1-2", "1-4.2"]


# ----------------------------------------------------------------------------- paths that match nothing


async def test_a_path_that_matches_nothing_is_a_warning_naming_it_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    host = DeviceHost(tmp_path)
    video = plugin(host, "example.com/video", paths=["/dev/video*"])
    usb = plugin(
        host, "example.com/stick", groups=[{"usb": [{"vendor": "20a0", "product": "41e5"}]}]
    )
    with caplog.at_level(logging.WARNING, logger="devplugin_sdk.backends.generic"):
        assert await video.discover() == []
        assert await video.discover() == []  # a rescan does not repeat it
        assert await usb.discover() == []
    assert [r.getMessage() for r in caplog.records] == [
        f"example.com/video: /dev/video* matches nothing (read as {host.dev_root}/video*); "
        "no device from it until a match appears",
        f"example.com/stick: no USB device 20a0:41e5 is plugged in (read "
        f"{host.sysfs_root}/bus/usb/devices); no device from it until one is",
    ]
    assert {getattr(r, "resource", None) for r in caplog.records} == {
        "example.com/video",
        "example.com/stick",
    }


async def test_an_optional_path_that_matches_nothing_is_no_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    host = solarflare_host(tmp_path)
    host.remove_node("sfc_char")
    with caplog.at_level(logging.WARNING, logger="devplugin_sdk.backends.generic"):
        assert len(await plugin(host, ONLOAD, groups=[ONLOAD_GROUP]).discover()) == 4
    assert caplog.records == []


# ----------------------------------------------------------------------------- configuration


def test_groups_from_config() -> None:
    (gpus,) = generic.from_config(
        {
            "sysfsRoot": "/host/sys",
            "devRoot": "/host/dev",
            "resources": [{"resourceName": GPU, "groups": [AMD_GPU_GROUP]}],
        }
    )
    assert isinstance(gpus, GenericPlugin)
    assert (gpus.sysfs_root, gpus.dev_root) == (Path("/host/sys"), Path("/host/dev"))
    assert gpus.groups == (
        Group(
            paths=(PathSpec("/dev/dri/renderD*"), PathSpec("/dev/dri/card*")),
            shared=(PathSpec("/dev/kfd"),),
            group_by="pciDevice",
            pci_vendors=("1002",),
        ),
    )
    (sticks,) = generic.from_config(
        {
            "resources": [
                {
                    "resourceName": "example.com/stick",
                    "groups": [
                        {
                            "count": 3,
                            "usb": [
                                {
                                    "vendor": "20A0",
                                    "product": "41e5",
                                    "serial": "x",
                                    "include": ["hidraw", "tty"],
                                }
                            ],
                        }
                    ],
                }
            ]
        }
    )
    assert isinstance(sticks, GenericPlugin)
    assert sticks.groups == (
        Group(usb=(UsbSpec("20a0", "41e5", "x", ("hidraw", "tty")),), count=3),
    )
    assert (sticks.sysfs_root, sticks.dev_root) == (Path("/sys"), Path("/dev"))


def test_the_shorthand_is_one_group_per_path() -> None:
    (shorthand,) = generic.from_config(
        {"resources": [{"resourceName": "a.com/b", "paths": ["/dev/x*", "/dev/y"], "share": 3}]}
    )
    (groups,) = generic.from_config(
        {
            "resources": [
                {
                    "resourceName": "a.com/b",
                    "groups": [
                        {"paths": [{"path": "/dev/x*"}], "count": 3},
                        {"paths": [{"path": "/dev/y"}], "count": 3},
                    ],
                }
            ]
        }
    )
    assert isinstance(shorthand, GenericPlugin)
    assert isinstance(groups, GenericPlugin)
    assert shorthand.groups == groups.groups


def group(**fields: Any) -> dict[str, Any]:
    """A resource entry with one group of ``fields``."""
    return {"resources": [{"resourceName": "a.com/b", "groups": [fields]}]}


def path(**fields: Any) -> dict[str, Any]:
    """A resource entry with one group of one path with ``fields``."""
    return group(paths=[{"path": "/dev/x", **fields}])


G = "resources[0].groups[0]"


@pytest.mark.parametrize(
    ("config", "key", "reason"),
    [
        (group(), f"{G}.paths", "a group needs paths"),
        (group(paths=[]), f"{G}.paths", "a group needs paths"),
        (group(count=2), f"{G}.paths", "a group needs paths"),
        (group(paths="/dev/x"), f"{G}.paths", "non-empty list"),
        (group(paths=["/dev/x"]), f"{G}.paths[0]", "mapping"),
        (path(type="Socket"), f"{G}.paths[0].type", "one of Device, Mount"),
        (path(permissions="rx"), f"{G}.paths[0].permissions", "made of r, w and m"),
        (path(permissions="rww"), f"{G}.paths[0].permissions", "each at most once"),
        (path(permissions=""), f"{G}.paths[0].permissions", "made of r, w and m"),
        (path(permissions="r", type="Mount"), f"{G}.paths[0].permissions", "is for type: Device"),
        (path(readOnly=True), f"{G}.paths[0].readOnly", "is for type: Mount"),
        (path(readOnly="yes", type="Mount"), f"{G}.paths[0].readOnly", "true or false"),
        (path(optional=1), f"{G}.paths[0].optional", "true or false"),
        (path(mountPath="dev/y"), f"{G}.paths[0].mountPath", "absolute"),
        (path(mountPath="/"), f"{G}.paths[0].mountPath", "not be /"),
        (path(moutPath="/y"), f"{G}.paths[0].moutPath", "did you mean 'mountPath'"),
        (group(paths=[{"mountPath": "/y"}]), f"{G}.paths[0].path", "required"),
        (group(paths=[{"path": "x"}]), f"{G}.paths[0].path", "absolute"),
        (group(paths=[{"path": "/dev/x"}], count=0), f"{G}.count", ">= 1"),
        (group(paths=[{"path": "/dev/x"}], groupBy="pci"), f"{G}.groupBy", "one of pciDevice"),
        (
            group(paths=[{"path": "/dev/x"}, {"path": "/opt/lib"}], groupBy="pciDevice"),
            f"{G}.paths[1].path",
            "needs device nodes under /dev",
        ),
        (
            group(paths=[{"path": "/dev/snd", "type": "Mount"}], groupBy="pciDevice"),
            f"{G}.paths[0].type",
            "a Mount has no sysfs device",
        ),
        (group(paths=[{"path": "/dev/x"}], pciVendors=["1002"]), f"{G}.pciVendors", "groupBy"),
        (
            group(paths=[{"path": "/dev/x"}], groupBy="pciDevice", pciVendors=["AMD"]),
            f"{G}.pciVendors[0]",
            "hex",
        ),
        (
            group(paths=[{"path": "/dev/x"}], usb=[{"vendor": "1", "product": "2"}]),
            f"{G}.usb",
            "paths or usb, not both",
        ),
        (group(usb=[{"product": "41e5"}]), f"{G}.usb[0].vendor", "required"),
        (group(usb=[{"vendor": 403, "product": "6001"}]), f"{G}.usb[0].vendor", "in quotes"),
        (group(usb=[{"vendor": "0403", "product": "60011"}]), f"{G}.usb[0].product", "hex"),
        (
            group(usb=[{"vendor": "0403", "product": "6001", "serial": ""}]),
            f"{G}.usb[0].serial",
            "non-empty",
        ),
        (
            group(usb=[{"vendor": "0403", "product": "6001", "include": ["serial"]}]),
            f"{G}.usb[0].include[0]",
            "one of hidraw",
        ),
        (
            group(usb=[{"vendor": "0403", "product": "6001"}], groupBy="pciDevice"),
            f"{G}.groupBy",
            "a usb group has none",
        ),
        (
            group(paths=[{"path": "/dev/x"}], shared=[{"path": "kfd"}]),
            f"{G}.shared[0].path",
            "absolute",
        ),
        (
            {"resources": [{"resourceName": "a.com/b", "paths": ["/dev/x"], "groups": [{}]}]},
            "resources[0].paths",
            "not both",
        ),
        (
            {
                "resources": [
                    {
                        "resourceName": "a.com/b",
                        "share": 2,
                        "groups": [{"paths": [{"path": "/dev/x"}]}],
                    }
                ]
            },
            "resources[0].share",
            "give each group a count",
        ),
        (
            {"resources": [{"resourceName": "a.com/b", "groups": []}]},
            "resources[0].groups",
            "non-empty list",
        ),
        ({"resources": [{"resourceName": "a.com/b"}]}, "resources[0].paths", "or give groups"),
        ({"devRoot": "dev", **group(paths=[{"path": "/dev/x"}])}, "devRoot", "absolute"),
        ({"sysfsRoot": 3, **group(paths=[{"path": "/dev/x"}])}, "sysfsRoot", "non-empty string"),
    ],
)
def test_group_config_errors_name_the_key_and_the_reason(
    config: Any, key: str, reason: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        generic.from_config(config)
    assert caught.value.key == key
    assert reason in caught.value.reason


_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-3, max_value=2000),
    st.sampled_from(["", "/", "/dev/x*", "dev/x", "Mount", "Device", "rw", "rx", "pciDevice"]),
    st.sampled_from(["0403", "20a0", "tty", "hidraw", "1002", "/dev/dri/card*", "/opt/x"]),
)
_GROUP_KEYS = st.sampled_from(
    [
        *("paths", "usb", "shared", "groupBy", "pciVendors", "count", "path", "mountPath"),
        *("type", "readOnly", "permissions", "optional", "vendor", "product", "serial", "include"),
    ]
)
_VALUES = st.recursive(
    _SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_GROUP_KEYS, inner, max_size=4),
    max_leaves=14,
)


@settings(max_examples=300, deadline=None)
@given(groups=st.lists(st.dictionaries(_GROUP_KEYS, _VALUES, max_size=4), max_size=2))
def test_groups_raise_nothing_but_config_error(groups: list[dict[str, Any]]) -> None:
    errors: list[ConfigError] = []
    try:
        plugins = generic.from_config(
            {"resources": [{"resourceName": "a.com/b", "groups": groups}]}
        )
    except ConfigError as error:
        errors.append(error)  # anything else fails the test
        plugins = []
    assert all(e.key.startswith("resources[0].groups") and e.reason for e in errors)
    assert bool(plugins) != bool(errors)
    assert all(isinstance(p, GenericPlugin) for p in plugins)
