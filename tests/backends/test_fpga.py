"""The FPGA backend on fake hosts (two U250s, DFL PACs): discovery, naming, health, hot-plug.

Discovery and naming call ``discover()`` directly; health changes, recovery and boards moving
between resources are checked where they end up, in a ``FakeKubelet``'s view.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from devplugin_sdk.backends import fpga
from devplugin_sdk.errors import ConfigError
from devplugin_sdk.testing import FakeKubelet, serving, watching
from devplugin_sdk.testing.fpga_trees import (
    DFL_INTERFACE_ID,
    NLB0_AFU_ID,
    NLB3_AFU_ID,
    U250_VBNV,
    FpgaHost,
    alveo_u250_host,
    dfl_pac_host,
)
from devplugin_sdk.types import Health, RescanEvent

ALL_F = "f" * 32


def options(host: FpgaHost, **config: Any) -> dict[str, Any]:
    """Backend keys with the roots pointed at the fake host (as a YAML file would give them)."""
    return {"sysfsRoot": str(host.sysfs_root), "devRoot": str(host.dev_root), **config}


def plugins(host: FpgaHost, **config: Any) -> list[fpga.FpgaPlugin]:
    return fpga.FpgaPlugin.from_config(options(host, **config))


def only(host: FpgaHost, **config: Any) -> fpga.FpgaPlugin:
    found = plugins(host, **config)
    assert len(found) == 1, [p.resource_name for p in found]
    return found[0]


# ----------------------------------------------------------------------------- XRT


async def test_two_u250_boards_make_one_resource_named_after_the_shell(tmp_path: Path) -> None:
    """Boards pair management and user functions; the resource is named from the VBNV."""
    host, boards = alveo_u250_host(tmp_path)
    plugin = only(host, family="xrt")
    assert plugin.resource_name == f"amd.com/{U250_VBNV}"

    devices = await plugin.discover()

    assert [d.id for d in devices] == ["0000:3b:00.1", "0000:d8:00.1"]
    assert [d.numa_nodes for d in devices] == [(0,), (1,)]
    assert all(d.health is Health.HEALTHY for d in devices)
    node = devices[0].device_nodes[0]
    assert (node.host_path, node.container_path) == ("/dev/dri/renderD128", "/dev/dri/renderD128")
    assert len(devices[0].device_nodes) == 1
    assert devices[0].attributes["managementFunction"] == boards[0].mgmt_address


async def test_management_node_is_given_only_when_configured(tmp_path: Path) -> None:
    host, boards = alveo_u250_host(tmp_path)
    plugin = only(host, family="xrt", includeMgmt=True, hostDevRoot="/hostdev")

    devices = await plugin.discover()

    paths = [n.host_path for n in devices[0].device_nodes]
    assert paths == ["/hostdev/dri/renderD128", f"/hostdev/{boards[0].mgmt_node}"]
    assert devices[0].device_nodes[1].container_path == f"/dev/{boards[0].mgmt_node}"


async def test_rename_names_a_shell_and_declares_resources_without_boards(tmp_path: Path) -> None:
    host, _ = alveo_u250_host(tmp_path)
    found = plugins(
        host,
        family="xrt",
        rename={U250_VBNV: "u250", "xilinx_u280_xdma_201920_3": "example.com/u280"},
    )

    assert [p.resource_name for p in found] == ["amd.com/u250", "example.com/u280"]
    assert len(await found[0].discover()) == 2
    assert await found[1].discover() == []


def test_odd_shell_names_are_sanitised_into_valid_resource_names(tmp_path: Path) -> None:
    host = FpgaHost(tmp_path)
    host.add_alveo("0000:3b:00", vbnv="xilinx:u280 gen3x16/xdma.1__")

    plugin = only(host, family="xrt")

    assert plugin.resource_name == "amd.com/xilinx_u280_gen3x16_xdma.1"
    assert fpga.sanitize_name_part("x" * 80 + "!") == "x" * 63


@pytest.mark.parametrize(
    ("break_board", "reason"),
    [
        (lambda b: b.set_offline(True), "offline"),
        (lambda b: b.set_ready(False), "not ready"),
        (lambda b: (b.dev_root / "dri" / b.render_node).unlink(), "missing"),
    ],
    ids=["dev_offline", "not-ready", "render-node-missing"],
)
async def test_board_health_comes_from_the_driver(
    tmp_path: Path, break_board: Any, reason: str
) -> None:
    host, boards = alveo_u250_host(tmp_path)
    plugin = only(host, family="xrt")
    break_board(boards[0])

    devices = {d.id: d for d in await plugin.discover()}

    assert devices["0000:3b:00.1"].health is Health.UNHEALTHY
    assert devices["0000:d8:00.1"].health is Health.HEALTHY
    board = {b.id: b for b in fpga.scan(plugin.config)}["0000:3b:00.1"]
    assert reason in board.reason


async def test_board_with_xocl_unbound_is_unhealthy_not_absent(tmp_path: Path) -> None:
    host = FpgaHost(tmp_path)
    host.add_alveo("0000:3b:00", user_driver=None)

    [board] = fpga.scan_xrt(host.sysfs_root, host.dev_root)

    assert board.id == "0000:3b:00.1"
    assert board.health is Health.UNHEALTHY
    assert "not bound to xocl" in board.reason
    assert board.key == U250_VBNV  # read from the management function's ROM


async def test_board_whose_shell_becomes_unreadable_stays_in_its_resource_unhealthy(
    tmp_path: Path,
) -> None:
    host, boards = alveo_u250_host(tmp_path)
    plugin = only(host, family="xrt")
    await plugin.discover()
    for function_dir in (boards[0].mgmt_dir, boards[0].user_dir):
        for rom in function_dir.glob("rom.*"):
            shutil.rmtree(rom)

    devices = {d.id: d for d in await plugin.discover()}

    assert devices["0000:3b:00.1"].health is Health.UNHEALTHY
    assert devices["0000:d8:00.1"].health is Health.HEALTHY


async def test_reflashed_board_moves_to_the_resource_of_its_new_shell(tmp_path: Path) -> None:
    host, boards = alveo_u250_host(tmp_path)
    found = plugins(host, family="xrt", rename={"xilinx_u250_gen3x16_xdma_shell_4_1": "u250-4"})
    by_name = {p.resource_name: p for p in found}
    old, new = by_name[f"amd.com/{U250_VBNV}"], by_name["amd.com/u250-4"]
    await old.discover()

    boards[1].set_vbnv("xilinx_u250_gen3x16_xdma_shell_4_1")

    assert [d.id for d in await old.discover()] == ["0000:3b:00.1"]
    assert [d.id for d in await new.discover()] == ["0000:d8:00.1"]


# ----------------------------------------------------------------------------- DFL


async def test_af_mode_gives_one_resource_per_afu_id(tmp_path: Path) -> None:
    host, _ = dfl_pac_host(tmp_path)

    nlb0, nlb3 = plugins(host, family="dfl", mode="af")

    assert nlb0.resource_name == f"fpga.intel.com/af-{NLB0_AFU_ID}"
    assert nlb3.resource_name == f"fpga.intel.com/af-{NLB3_AFU_ID}"
    [port0] = await nlb0.discover()
    [port1] = await nlb3.discover()
    assert (port0.id, port0.numa_nodes) == ("0000:5e:00.0-port0", (0,))
    assert (port1.id, port1.numa_nodes) == ("0000:af:00.0-port0", (1,))
    assert [n.host_path for n in port0.device_nodes] == ["/dev/dfl-port.0"]
    assert port0.attributes["interfaceID"] == DFL_INTERFACE_ID
    assert port0.health is Health.HEALTHY
    # Typed for DRA: the family, the AFU and the NUMA node as a number.
    assert port0.attributes["family"] == "dfl"
    assert port0.attributes["afuID"] == NLB0_AFU_ID
    assert (port0.attributes["numaNode"], port1.attributes["numaNode"]) == (0, 1)


async def test_region_mode_gives_one_device_per_card_keyed_by_interface_id(tmp_path: Path) -> None:
    host, _ = dfl_pac_host(tmp_path)

    plugin = only(host, family="dfl", mode="region", includeFme=True)
    devices = await plugin.discover()

    assert plugin.resource_name == f"fpga.intel.com/region-{DFL_INTERFACE_ID}"
    assert [d.id for d in devices] == ["0000:5e:00.0", "0000:af:00.0"]
    assert [n.host_path for n in devices[1].device_nodes] == ["/dev/dfl-port.1", "/dev/dfl-fme.1"]


async def test_card_with_two_ports_as_in_the_kernel_documentation(tmp_path: Path) -> None:
    """region0 is the base region; region1 and region2 are the FME's PR regions, not cards."""
    host = FpgaHost(tmp_path)
    card = host.add_dfl_card("0000:5e:00.0", afu_ids=[NLB0_AFU_ID, NLB0_AFU_ID])
    assert (card.base_region, card.fme_regions) == ("region0", ["region1", "region2"])

    af = only(host, family="dfl", mode="af")
    region = only(host, family="dfl", mode="region")

    assert [d.id for d in await af.discover()] == ["0000:5e:00.0-port0", "0000:5e:00.0-port1"]
    [whole] = await region.discover()
    assert [n.host_path for n in whole.device_nodes] == ["/dev/dfl-port.0", "/dev/dfl-port.1"]


async def test_port_on_an_sriov_vf_takes_the_interface_id_of_its_pf(tmp_path: Path) -> None:
    """A VF's base region has the port but no FME (intel-device-plugins issue #372)."""
    host = FpgaHost(tmp_path)
    card = host.add_dfl_card("0000:5e:00.0", afu_ids=[NLB0_AFU_ID, NLB3_AFU_ID], numa_node=1)
    host.add_dfl_vf(card, "0000:5e:00.1", port=1)

    af = {p.resource_name: p for p in plugins(host, family="dfl", mode="af")}
    region = only(host, family="dfl", mode="region")

    [vf_port] = await af[f"fpga.intel.com/af-{NLB3_AFU_ID}"].discover()
    assert (vf_port.id, vf_port.numa_nodes, vf_port.health) == (
        "0000:5e:00.1-port1",
        (1,),
        Health.HEALTHY,
    )
    assert vf_port.attributes["interfaceID"] == DFL_INTERFACE_ID
    devices = {d.id: [n.host_path for n in d.device_nodes] for d in await region.discover()}
    assert devices == {"0000:5e:00.0": ["/dev/dfl-port.0"], "0000:5e:00.1": ["/dev/dfl-port.1"]}


async def test_all_f_afu_id_marks_the_port_unhealthy(tmp_path: Path) -> None:
    host, cards = dfl_pac_host(tmp_path)
    nlb0, _ = plugins(host, family="dfl")
    await nlb0.discover()

    cards[0].set_afu_id(0, ALL_F)
    [port] = await nlb0.discover()

    assert port.health is Health.UNHEALTHY
    # A card that has crashed before the plugin starts gets the crash marker's resource, as
    # Intel's plugin does, and is unhealthy there.
    crashed = [p for p in plugins(host, family="dfl") if p.resource_name.endswith(ALL_F)]
    [device] = await crashed[0].discover()
    assert device.health is Health.UNHEALTHY


async def test_all_f_interface_id_marks_the_region_unhealthy(tmp_path: Path) -> None:
    host, cards = dfl_pac_host(tmp_path)
    plugin = only(host, family="dfl", mode="region")
    await plugin.discover()

    cards[1].set_interface_id(ALL_F)
    devices = {d.id: d.health for d in await plugin.discover()}

    assert devices == {"0000:5e:00.0": Health.HEALTHY, "0000:af:00.0": Health.UNHEALTHY}


async def test_missing_port_node_marks_the_port_unhealthy(tmp_path: Path) -> None:
    host, cards = dfl_pac_host(tmp_path)
    nlb0, _ = plugins(host, family="dfl")
    cards[0].remove_port_node(0)

    [port] = await nlb0.discover()

    assert port.health is Health.UNHEALTHY


async def test_unplugged_card_disappears_from_discovery(tmp_path: Path) -> None:
    host, cards = dfl_pac_host(tmp_path)
    plugin = only(host, family="dfl", mode="region")

    cards[0].unplug()
    assert [d.id for d in await plugin.discover()] == ["0000:af:00.0"]
    cards[0].replug()
    assert [d.id for d in await plugin.discover()] == ["0000:5e:00.0", "0000:af:00.0"]


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    ("config", "key", "reason"),
    [
        ({}, "family", "is required"),
        ({"family": "opae"}, "family", "must be one of xrt, dfl"),
        ({"family": "dfl", "mode": "regiondevel"}, "mode", "must be one of af, region"),
        ({"family": "xrt", "mode": "af"}, "mode", "only applies to family 'dfl'"),
        ({"family": "xrt", "colour": "red"}, "colour", "unknown key"),
        ({"family": "xrt", "rename": {"shell": "Bad Name!"}}, "rename.shell", "invalid resource"),
        ({"family": "xrt", "rename": ["shell"]}, "rename", "must be a mapping"),
        ({"family": "dfl", "rename": {1234: "nlb"}}, "rename.1234", "quote IDs"),
        ({"family": "xrt", "healthInterval": 0}, "healthInterval", "must be > 0"),
        ({"family": "xrt", "includeMgmt": "yes"}, "includeMgmt", "true or false"),
        ({"family": "xrt", "vendors": ["10ee"]}, "vendors[0]", "must look like '0x10ee'"),
        ({"family": "xrt", "vendors": "0x10ee"}, "vendors", "must be a list"),
        ({"family": "dfl", "domain": "Intel"}, "domain", "DNS-1123"),
        ({"family": "dfl", "sysfsRoot": "host/sys"}, "sysfsRoot", "absolute path"),
        ({"family": "dfl", "hostDevRoot": 7}, "hostDevRoot", "non-empty string"),
        ([], "<root>", "must be a mapping"),
    ],
)
def test_config_errors_name_the_key(config: Any, key: str, reason: str) -> None:
    with pytest.raises(ConfigError, match=reason) as raised:
        fpga.from_config(config)
    assert raised.value.key == key


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("health_interval", "healthInterval"),
        ("sysfs_root", "sysfsRoot"),
        ("dev_root", "devRoot"),
        ("host_dev_root", "hostDevRoot"),
        ("include_mgmt", "includeMgmt"),
        ("include_fme", "includeFme"),
    ],
)
def test_snake_case_keys_of_old_are_refused_with_their_camel_case_name(old: str, new: str) -> None:
    with pytest.raises(ConfigError, match=f"did you mean {new!r}") as raised:
        fpga.from_config({"family": "xrt", old: 1})
    assert raised.value.key == old


def test_every_key_is_camel_case() -> None:
    assert all(key[0].islower() and "_" not in key for key in fpga.CONFIG_KEYS)


def test_from_config_canonicalises_ids_and_reads_the_roots_from_the_keys(tmp_path: Path) -> None:
    host, _ = dfl_pac_host(tmp_path)
    dashed = "D8424DC4-A4A3-C413-F89E-433683F9040B"

    found = plugins(host, family="dfl", rename={dashed: "nlb0"})

    assert [p.resource_name for p in found] == [
        "fpga.intel.com/af-f7df405cbd7acf7222f144b0b93acd18",
        "fpga.intel.com/nlb0",
    ]
    assert found[1].keys == (NLB0_AFU_ID,)
    assert found[1].config.sysfs_root == host.sysfs_root


def test_subclasses_get_plugins_of_their_own_class(tmp_path: Path) -> None:
    class Custom(fpga.FpgaPlugin):
        pass

    host, _ = alveo_u250_host(tmp_path)

    [plugin] = Custom.from_config(options(host, family="xrt"))

    assert type(plugin) is Custom


def test_the_same_config_gives_the_same_fingerprint(tmp_path: Path) -> None:
    """A reload restarts a resource only when its fingerprint changes."""
    host, _ = dfl_pac_host(tmp_path)
    config = options(host, family="dfl", rename={NLB0_AFU_ID: "nlb", NLB3_AFU_ID: "nlb"})

    [first] = fpga.from_config(config)
    [again] = fpga.from_config(config)
    [renamed] = fpga.from_config({**config, "domain": "example.com"})

    assert renamed.resource_name == "example.com/nlb"
    assert first.fingerprint() == again.fingerprint() != renamed.fingerprint()


def test_nothing_found_and_nothing_declared_gives_no_plugins(tmp_path: Path) -> None:
    host = FpgaHost(tmp_path)
    assert plugins(host, family="xrt") == []
    assert plugins(host, family="dfl") == []


# ----------------------------------------------------------------------------- watch


async def test_watch_asks_for_a_rescan_at_start_and_every_interval_and_nothing_polls(
    tmp_path: Path,
) -> None:
    """Health is read by discover() on each rescan; no check_health reads it a second time."""
    host, _ = alveo_u250_host(tmp_path)
    plugin = only(host, family="xrt", healthInterval=0.05)

    async with watching(plugin) as events:
        first, second = await events.next_event(), await events.next_event()

    assert isinstance(first, RescanEvent)
    assert isinstance(second, RescanEvent)
    assert "periodic" in first.reason
    assert "periodic" in second.reason
    assert not plugin.overrides("check_health")


async def test_watch_rescans_on_a_dev_node_change_without_waiting_for_the_interval(
    tmp_path: Path,
) -> None:
    host, cards = dfl_pac_host(tmp_path)
    nlb0, _ = plugins(host, family="dfl", healthInterval=60)

    async with watching(nlb0) as events:
        armed = await events.next_event()  # the rescan that follows arming the watch
        (host.dev_root / "ttyS0").touch()  # not an FPGA node: no rescan for it
        cards[0].remove_port_node(0)
        event = await events.next_event()

    assert "periodic" in armed.reason
    assert isinstance(event, RescanEvent)
    assert event.reason == "changed: dfl-port.0"
    [port] = await nlb0.discover()
    assert port.health is Health.UNHEALTHY


async def test_watch_sees_a_render_node_go_in_dev_dri(tmp_path: Path) -> None:
    host, boards = alveo_u250_host(tmp_path)
    plugin = only(host, family="xrt", healthInterval=60)

    async with watching(plugin) as events:
        await events.next_event()
        (host.dev_root / "dri" / boards[1].render_node).unlink()
        event = await events.next_event()

    assert event.reason == f"changed: {boards[1].render_node}"


# ----------------------------------------------------------------------------- served


async def test_offline_board_turns_unhealthy_and_recovers_through_rescans(tmp_path: Path) -> None:
    host, boards = alveo_u250_host(tmp_path)
    plugin = only(host, family="xrt", healthInterval=0.05)
    resource = plugin.resource_name

    async with FakeKubelet() as kubelet, serving(plugin, settings=kubelet.settings()):
        await kubelet.wait_for_allocatable(resource, 2)

        boards[1].set_offline(True)  # sysfs only: seen by the periodic rescan
        await kubelet.wait_for_health(resource, "0000:d8:00.1", "Unhealthy")
        assert kubelet.capacity(resource) == 2

        boards[1].set_offline(False)
        await kubelet.wait_for_health(resource, "0000:d8:00.1", "Healthy")
        await kubelet.wait_for_allocatable(resource, 2)


async def test_board_unhealthy_at_start_becomes_healthy_when_it_recovers(tmp_path: Path) -> None:
    host, boards = alveo_u250_host(tmp_path)
    boards[1].set_ready(False)
    plugin = only(host, family="xrt", healthInterval=0.05)
    resource = plugin.resource_name

    async with FakeKubelet() as kubelet, serving(plugin, settings=kubelet.settings()):
        await kubelet.wait_for_health(resource, "0000:d8:00.1", "Unhealthy")
        assert kubelet.allocatable(resource) == 1

        boards[1].set_ready(True)
        await kubelet.wait_for_allocatable(resource, 2)


async def test_port_reprogrammed_with_another_afu_moves_to_its_resource_and_back(
    tmp_path: Path,
) -> None:
    host, cards = dfl_pac_host(tmp_path)
    nlb0, nlb3 = plugins(host, family="dfl", healthInterval=0.05)

    async with FakeKubelet() as kubelet, serving(nlb0, nlb3, settings=kubelet.settings()):
        await kubelet.wait_for_allocatable(nlb0.resource_name, 1)
        await kubelet.wait_for_allocatable(nlb3.resource_name, 1)

        cards[0].set_afu_id(0, NLB3_AFU_ID)
        await kubelet.wait_for_allocatable(nlb3.resource_name, 2)
        await kubelet.wait_for(lambda: kubelet.capacity(nlb0.resource_name) == 0, what="moved")

        # A crash marker in between: the port stays where it was, Unhealthy.
        cards[0].set_afu_id(0, ALL_F)
        await kubelet.wait_for_health(nlb3.resource_name, "0000:5e:00.0-port0", "Unhealthy")
        assert kubelet.capacity(nlb0.resource_name) == 0

        cards[0].set_afu_id(0, NLB0_AFU_ID)
        await kubelet.wait_for_allocatable(nlb0.resource_name, 1)
        await kubelet.wait_for(lambda: kubelet.capacity(nlb3.resource_name) == 1, what="back")


async def test_unplugged_board_leaves_the_kubelet_at_once(tmp_path: Path) -> None:
    """Its /dev nodes go with it: inotify, not the interval, triggers the rescan."""
    host, boards = alveo_u250_host(tmp_path)
    plugin = only(host, family="xrt", healthInterval=60)
    resource = plugin.resource_name

    async with FakeKubelet() as kubelet, serving(plugin, settings=kubelet.settings()):
        await kubelet.wait_for_allocatable(resource, 2)
        boards[0].unplug()
        await kubelet.wait_for(lambda: kubelet.capacity(resource) == 1, what="unplug")
        boards[0].replug()
        await kubelet.wait_for_allocatable(resource, 2)
