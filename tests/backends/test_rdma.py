"""The RDMA backend on fake ConnectX hosts: sysfs layout, selectors, health, modes, allocation,
config, and port flaps and hot-plug seen through rescans, watch() and a FakeKubelet."""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from devplugin_sdk.backends import rdma
from devplugin_sdk.errors import ConfigError
from devplugin_sdk.testing import FakeKubelet, serving, watching
from devplugin_sdk.testing.rdma_trees import (
    RdmaHost,
    connectx_host,
    connectx_ib_host,
    connectx_roce_host,
)
from devplugin_sdk.types import Device, Health, RescanEvent


def roots(host: RdmaHost) -> dict[str, str]:
    """The config keys that point the backend at the fake host."""
    return {"sysfsRoot": str(host.sysfs_root), "devRoot": str(host.dev_root)}


def plugins(host: RdmaHost, *resources: dict[str, Any], **top: Any) -> list[rdma.RdmaPlugin]:
    return rdma.RdmaPlugin.from_config({**roots(host), "resources": list(resources), **top})


def only(host: RdmaHost, **resource: Any) -> rdma.RdmaPlugin:
    (plugin,) = plugins(host, {"resourceName": "rdma/test", **resource})
    return plugin


def info(host: RdmaHost, name: str) -> rdma.RdmaDeviceInfo:
    (found,) = [d for d in rdma.scan(host.sysfs_root) if d.name == name]
    return found


def paths(device: Device) -> list[str]:
    return [n.host_path for n in device.device_nodes]


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> RdmaHost:
    """``connectx_host``, built once for the tests that only read it (nothing may change it)."""
    return connectx_host(tmp_path_factory.mktemp("mixed"))


# ----------------------------------------------------------------------------- the fake tree


def test_fake_tree_links_class_bus_and_sriov_entries_like_a_real_host(mixed: RdmaHost) -> None:
    host = mixed
    sys_ = host.sysfs_root
    pf = sys_ / "devices/pci0000:b0/0000:b0:02.0/0000:b1:00.0"

    for entry in (
        "class/infiniband/mlx5_2",
        "class/infiniband_verbs/uverbs2",
        "class/net/ens3f0np0",
    ):
        assert (sys_ / entry).is_symlink(), entry
    assert (sys_ / "class/infiniband/mlx5_2").resolve() == pf / "infiniband/mlx5_2"
    assert (sys_ / "class/infiniband_mad/issm2").resolve() == pf / "infiniband_mad/issm2"
    assert (sys_ / "bus/pci/devices/0000:b1:00.0").resolve() == pf
    assert (sys_ / "class/infiniband/mlx5_2/device").resolve() == pf
    assert (pf / "driver").resolve() == sys_ / "bus/pci/drivers/mlx5_core"
    assert (pf / "virtfn1").resolve() == pf.parent / "0000:b1:00.3"
    assert (pf.parent / "0000:b1:00.3/physfn").resolve() == pf
    assert (sys_ / "class/infiniband/mlx5_2/ports/1/state").read_text() == "4: ACTIVE\n"
    assert (sys_ / "class/infiniband/mlx5_2/ports/1/phys_state").read_text() == "5: LinkUp\n"
    assert (sys_ / "class/infiniband/mlx5_0/ports/1/link_layer").read_text() == "InfiniBand\n"
    assert (sys_ / "class/infiniband_mad/umad2/port").read_text() == "1\n"
    assert sorted(os.listdir(host.dev_root / "infiniband"))[:3] == ["issm0", "issm1", "issm2"]


# ----------------------------------------------------------------------------- discovery


def test_scan_reads_identity_numa_ports_and_char_devices(mixed: RdmaHost) -> None:
    host = mixed

    found = {d.name: d for d in rdma.scan(host.sysfs_root)}

    assert list(found) == ["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3", "mlx5_4"]
    ib = found["mlx5_1"]
    assert (ib.pci_address, ib.vendor, ib.device_id, ib.driver) == (
        "0000:ca:00.0",
        "15b3",
        "101b",
        "mlx5_core",
    )
    assert (ib.numa_node, ib.node_guid, ib.uverbs, ib.physfn) == (
        1,
        "0c42:a103:0065:9d60",
        "uverbs1",
        None,
    )
    (port,) = ib.ports
    assert (port.number, port.state_name, port.phys_state_name, port.link_layer) == (
        1,
        "ACTIVE",
        "LinkUp",
        "InfiniBand",
    )
    assert (port.netdevs, port.umad, port.issm, port.active) == (("ib1",), "umad1", "issm1", True)
    vf = found["mlx5_4"]
    assert (vf.pci_address, vf.device_id, vf.physfn, vf.is_vf) == (
        "0000:b1:00.3",
        "101e",
        "0000:b1:00.0",
        True,
    )
    assert (vf.netdevs, vf.link_layers) == (("ens3f0v1",), ("Ethernet",))


def test_roce_netdev_comes_from_the_gid_table_when_the_function_has_none(tmp_path: Path) -> None:
    host = connectx_roce_host(tmp_path)
    # As for a sub-function, whose netdev hangs off the auxiliary device, not the PCI function.
    shutil.rmtree(host.functions["0000:3b:00.1"].device_dir / "net")

    assert info(host, "mlx5_1").netdevs == ("ens1f1np1",)


def test_char_devices_are_matched_by_whole_device_name(tmp_path: Path) -> None:
    # rdmamap once matched ibdev by substring, giving mlx5_1 the nodes of mlx5_10.
    host = RdmaHost(tmp_path)
    for n in range(11):
        host.add_function(f"0000:{0x10 + n:02x}:00.0", ibdev=f"mlx5_{10 - n}", netdev=None)

    found = {d.name: d for d in rdma.scan(host.sysfs_root)}

    assert list(found)[:3] == ["mlx5_0", "mlx5_1", "mlx5_2"]  # natural order
    assert (found["mlx5_10"].uverbs, found["mlx5_1"].uverbs) == ("uverbs0", "uverbs9")
    assert (found["mlx5_10"].ports[0].umad, found["mlx5_1"].ports[0].umad) == ("umad0", "umad9")


def test_host_without_rdma_stack_has_no_devices(tmp_path: Path) -> None:
    assert rdma.scan(tmp_path / "sys") == []


# ----------------------------------------------------------------------------- selectors


@pytest.mark.parametrize(
    ("selector", "expected"),
    [
        (rdma.Selector(), ["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3", "mlx5_4"]),
        (rdma.Selector(vendors=("0x15B3",)), ["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3", "mlx5_4"]),
        (rdma.Selector(device_ids=("101b", "101d")), ["mlx5_0", "mlx5_1", "mlx5_2"]),
        (rdma.Selector(device_ids=("101e",), if_names=("ens3f0v1", "ib0")), ["mlx5_4"]),
        (rdma.Selector(link_types=("ib",)), ["mlx5_0", "mlx5_1"]),
        (
            rdma.Selector(link_types=("ether",), drivers=("mlx5_core",)),
            ["mlx5_2", "mlx5_3", "mlx5_4"],
        ),
        (rdma.Selector(rdma_devices=("mlx5_3",), pci_addresses=("0000:B1:00.2",)), ["mlx5_3"]),
        (rdma.Selector(drivers=("irdma",)), []),
    ],
    ids=["empty", "vendor", "device-ids", "and-across-lists", "ib", "roce", "names", "no-match"],
)
def test_selectors_or_within_a_list_and_across_lists(
    mixed: RdmaHost, selector: rdma.Selector, expected: list[str]
) -> None:
    assert [d.name for d in rdma.scan(mixed.sysfs_root) if selector.matches(d)] == expected


def test_selector_rejects_ids_and_link_types_it_cannot_match() -> None:
    with pytest.raises(ValueError, match="hex PCI ID"):
        rdma.Selector(vendors=("mellanox",))
    with pytest.raises(ValueError, match="link_types"):
        rdma.Selector(link_types=("omnipath",))


# ----------------------------------------------------------------------------- health


@pytest.mark.parametrize(
    ("state", "phys_state", "reason"),
    [
        ("DOWN", "Polling", "port 1 is DOWN/Polling"),  # IB cable pulled
        ("INIT", "LinkUp", "port 1 is INIT/LinkUp"),  # link up, no subnet manager
        ("ARMED", "LinkUp", "port 1 is ARMED/LinkUp"),
        ("ACTIVE", "LinkErrorRecovery", "port 1 is ACTIVE/LinkErrorRecovery"),
    ],
)
def test_only_active_linkup_ports_are_healthy(
    tmp_path: Path, state: str, phys_state: str, reason: str
) -> None:
    host = connectx_ib_host(tmp_path)
    assert rdma.evaluate_health(info(host, "mlx5_0"), dev_root=host.dev_root) == (
        Health.HEALTHY,
        "",
    )

    host.set_port_state("mlx5_0", state=state, phys_state=phys_state)

    assert rdma.evaluate_health(info(host, "mlx5_0"), dev_root=host.dev_root) == (
        Health.UNHEALTHY,
        f"mlx5_0: {reason}",
    )


@pytest.mark.parametrize(
    ("node", "require_rdma_cm", "problem"),
    [
        ("uverbs0", True, "/dev/infiniband/uverbs0 is missing"),
        ("rdma_cm", True, "/dev/infiniband/rdma_cm is missing (is rdma_ucm loaded?)"),
        ("rdma_cm", False, None),
        ("umad0", True, None),
    ],
)
def test_missing_char_devices_make_a_device_unhealthy(
    tmp_path: Path, node: str, require_rdma_cm: bool, problem: str | None
) -> None:
    host = connectx_ib_host(tmp_path)
    host.remove_dev_node(node)

    health, reason = rdma.evaluate_health(
        info(host, "mlx5_0"), dev_root=host.dev_root, require_rdma_cm=require_rdma_cm
    )

    assert (health, reason) == (
        (Health.HEALTHY, "") if problem is None else (Health.UNHEALTHY, f"mlx5_0: {problem}")
    )


def test_health_looks_only_at_configured_ports(tmp_path: Path) -> None:
    host = connectx_ib_host(tmp_path)
    device = info(host, "mlx5_0")
    two_ports = rdma.RdmaDeviceInfo(
        **{
            **{f: getattr(device, f) for f in device.__dataclass_fields__},
            "ports": (device.ports[0], rdma.RdmaPort(2, 1, "DOWN", 3, "Disabled", "Ethernet")),
        }
    )

    every = rdma.evaluate_health(two_ports, dev_root=host.dev_root)
    first = rdma.evaluate_health(two_ports, ports=[1], dev_root=host.dev_root)
    third = rdma.evaluate_health(two_ports, ports=[3], dev_root=host.dev_root)

    assert every == (Health.UNHEALTHY, "mlx5_0: port 2 is DOWN/Disabled")
    assert first == (Health.HEALTHY, "")
    assert third == (Health.UNHEALTHY, "mlx5_0: port 3 does not exist")


# ----------------------------------------------------------------------------- modes


async def test_exclusive_mode_gives_each_rdma_device_its_nodes_env_and_numa_node(
    tmp_path: Path,
) -> None:
    host = connectx_ib_host(tmp_path)
    plugin = only(host, selectors={"linkTypes": ["InfiniBand"]})

    devices = await plugin.discover()

    assert [(d.id, d.numa_nodes, d.health, d.parent) for d in devices] == [
        ("mlx5_0", (0,), Health.HEALTHY, None),
        ("mlx5_1", (1,), Health.HEALTHY, None),
    ]
    assert paths(devices[1]) == [
        "/dev/infiniband/uverbs1",
        "/dev/infiniband/umad1",
        "/dev/infiniband/issm1",
        "/dev/infiniband/rdma_cm",
    ]
    assert all(
        n.container_path == n.host_path and n.permissions == "rw" for n in devices[1].device_nodes
    )
    assert devices[1].env == {"RDMA_DEVICES": "mlx5_1", "RDMA_NETDEVS": "ib1"}
    assert devices[1].attributes["pciAddress"] == "0000:ca:00.0"
    # Typed facts for DRA: the NUMA node, the link layer, the PCIe root (a NIC and a GPU can be
    # required under one root with a matchAttribute constraint).
    assert devices[1].attributes["numaNode"] == 1
    assert devices[1].attributes["linkLayer"] == "InfiniBand"
    assert devices[1].attributes["virtualFunction"] is False
    assert devices[1].attributes["resource.kubernetes.io/pciBusID"] == "0000:ca:00.0"
    assert str(devices[1].attributes["resource.kubernetes.io/pcieRoot"]).startswith("pci0000:")


async def test_shared_mode_makes_shares_whose_parent_is_the_hca(tmp_path: Path) -> None:
    host = connectx_roce_host(tmp_path, vfs=0)
    plugin = only(host, mode="shared", shares=3)

    devices = await plugin.discover()

    assert [d.id for d in devices] == [f"mlx5_{h}::{n}" for h in (0, 1) for n in range(3)]
    assert {d.parent for d in devices} == {"mlx5_0", "mlx5_1"}
    assert paths(devices[4])[0] == "/dev/infiniband/uverbs1"


async def test_vfs_are_devices_and_device_ids_pick_them(tmp_path: Path) -> None:
    host = connectx_roce_host(tmp_path, vfs=3)
    plugin = only(host, selectors={"vendors": ["15b3"], "deviceIDs": ["101e"]})

    devices = await plugin.discover()

    assert [(d.id, d.attributes["physfn"], d.env["RDMA_NETDEVS"]) for d in devices] == [
        ("mlx5_2", "0000:3b:00.0", "ens1f0v0"),
        ("mlx5_3", "0000:3b:00.0", "ens1f0v1"),
        ("mlx5_4", "0000:3b:00.0", "ens1f0v2"),
    ]


async def test_a_device_belongs_to_the_first_resource_that_selects_it(mixed: RdmaHost) -> None:
    host = mixed
    vfs, roce, rest = plugins(
        host,
        {"resourceName": "rdma/vf", "selectors": {"deviceIDs": ["101e"]}},
        {
            "resourceName": "rdma/roce",
            "mode": "shared",
            "shares": 2,
            "selectors": {"linkTypes": ["roce"]},
        },
        {"resourceName": "rdma/rest"},
    )

    assert [d.id for d in await vfs.discover()] == ["mlx5_3", "mlx5_4"]
    assert [d.id for d in await roce.discover()] == ["mlx5_2::0", "mlx5_2::1"]
    assert [d.id for d in await rest.discover()] == ["mlx5_0", "mlx5_1"]


async def test_issm_rdma_cm_and_absent_umad_nodes_are_left_out(tmp_path: Path) -> None:
    host = connectx_ib_host(tmp_path)
    host.remove_dev_node("umad1")  # ib_umad's node gone: handing it out would fail the container
    plugin = only(host, issm=False, rdmaCm=False)

    devices = await plugin.discover()

    assert paths(devices[0]) == ["/dev/infiniband/uverbs0", "/dev/infiniband/umad0"]
    assert paths(devices[1]) == ["/dev/infiniband/uverbs1"]
    assert [d.health for d in devices] == [Health.HEALTHY, Health.HEALTHY]


async def test_cdi_kind_hands_out_cdi_names_instead_of_nodes(tmp_path: Path) -> None:
    host = connectx_ib_host(tmp_path)
    plugin = only(host, cdiKind="nvidia.com/net-rdma")

    devices = await plugin.discover()
    allocation = await plugin.allocate(devices)

    assert allocation.cdi_devices == ("nvidia.com/net-rdma=mlx5_0", "nvidia.com/net-rdma=mlx5_1")
    assert allocation.device_nodes == ()
    assert allocation.env["RDMA_DEVICES"] == "mlx5_0,mlx5_1"


# ----------------------------------------------------------------------------- allocation


async def test_allocation_names_each_rdma_device_and_netdev_once(tmp_path: Path) -> None:
    host = connectx_roce_host(tmp_path, vfs=0)
    plugin = only(host, mode="shared", shares=4, envPrefix="NIC")
    devices = {d.id: d for d in await plugin.discover()}

    allocation = await plugin.allocate(
        [devices["mlx5_1::0"], devices["mlx5_0::2"], devices["mlx5_1::3"]]
    )

    assert allocation.env == {"NIC_DEVICES": "mlx5_1,mlx5_0", "NIC_NETDEVS": "ens1f1np1,ens1f0np0"}
    assert [n.host_path for n in allocation.device_nodes] == [
        "/dev/infiniband/uverbs1",
        "/dev/infiniband/umad1",
        "/dev/infiniband/issm1",
        "/dev/infiniband/rdma_cm",
        "/dev/infiniband/uverbs0",
        "/dev/infiniband/umad0",
        "/dev/infiniband/issm0",
    ]


async def test_preferred_allocation_spreads_shares_over_hcas(tmp_path: Path) -> None:
    host = connectx_roce_host(tmp_path, vfs=1)
    plugin = only(host, mode="shared", shares=4)
    devices = list(await plugin.discover())
    # mlx5_1 has lost two shares to other pods: prefer the HCAs with more left.
    available = [d for d in devices if d.id not in {"mlx5_1::0", "mlx5_1::1"}]

    chosen = await plugin.preferred_allocation(available, [], 4)

    assert chosen == ["mlx5_0::0", "mlx5_2::0", "mlx5_1::2", "mlx5_0::1"]


async def test_preferred_allocation_keeps_to_the_numa_node_already_chosen(mixed: RdmaHost) -> None:
    host = mixed  # mlx5_0 on NUMA 0; mlx5_1..mlx5_4 on NUMA 1
    plugin = only(host)
    devices = {d.id: d for d in await plugin.discover()}

    chosen = await plugin.preferred_allocation(list(devices.values()), [devices["mlx5_1"]], 2)

    assert chosen == ["mlx5_1", "mlx5_2"]


# ----------------------------------------------------------------------------- health over time


async def test_every_discovery_reads_port_state_as_it_is_now(tmp_path: Path) -> None:
    host = connectx_roce_host(tmp_path, vfs=0)
    plugin = only(host, mode="shared", shares=2)
    assert {d.health for d in await plugin.discover()} == {Health.HEALTHY}

    host.set_port_state("mlx5_1", state="DOWN")
    down = {d.id: d.health for d in await plugin.discover()}
    host.set_port_state("mlx5_1", state="ACTIVE")
    up = {d.id: d.health for d in await plugin.discover()}

    assert down == {
        "mlx5_0::0": Health.HEALTHY,
        "mlx5_0::1": Health.HEALTHY,
        "mlx5_1::0": Health.UNHEALTHY,
        "mlx5_1::1": Health.UNHEALTHY,
    }
    assert set(up.values()) == {Health.HEALTHY}


async def test_watch_asks_for_a_rescan_every_health_interval(tmp_path: Path) -> None:
    host = connectx_ib_host(tmp_path)
    (plugin,) = plugins(host, {"resourceName": "rdma/ib"}, healthInterval=0.05)

    async with watching(plugin) as events:
        first, second, third = [await events.next_event() for _ in range(3)]

    assert all(isinstance(e, RescanEvent) for e in (first, second, third))
    assert "periodic" in third.reason


async def test_dev_node_change_asks_for_a_rescan_without_waiting_for_the_interval(
    tmp_path: Path,
) -> None:
    host = connectx_ib_host(tmp_path)
    (plugin,) = plugins(host, {"resourceName": "rdma/ib"}, healthInterval=600)

    async with watching(plugin) as events:
        armed = await events.next_event()  # the watch is armed before this rescan
        host.remove_dev_node("uverbs1")  # driver unloading: udev removes the node
        changed = await events.next_event(timeout=10)

    assert isinstance(armed, RescanEvent)
    assert isinstance(changed, RescanEvent)
    assert "uverbs1" in changed.reason
    assert [d.health for d in await plugin.discover()] == [Health.HEALTHY, Health.UNHEALTHY]


async def test_vfs_appearing_and_disappearing_ask_for_a_rescan(tmp_path: Path) -> None:
    host = connectx_roce_host(tmp_path, vfs=1)
    (plugin,) = plugins(host, {"resourceName": "rdma/vf"}, healthInterval=600)

    async with watching(plugin) as events:
        await events.next_event()
        host.add_function(
            "0000:3b:00.3",
            ibdev="mlx5_3",
            netdev="ens1f0v1",
            device="0x101e",
            physfn="0000:3b:00.0",
        )
        assert isinstance(await events.next_event(timeout=10), RescanEvent)
        assert [d.id for d in await plugin.discover()][-1] == "mlx5_3"
        host.remove_function("0000:3b:00.2")
        assert isinstance(await events.next_event(timeout=10), RescanEvent)

    assert [d.id for d in await plugin.discover()] == ["mlx5_0", "mlx5_1", "mlx5_3"]


async def test_a_port_going_down_takes_every_share_out_of_allocatable(tmp_path: Path) -> None:
    host = connectx_roce_host(tmp_path, vfs=0)
    (plugin,) = plugins(
        host, {"resourceName": "rdma/roce", "mode": "shared", "shares": 5}, healthInterval=0.05
    )

    async with FakeKubelet() as kubelet, serving(plugin, settings=kubelet.settings()):
        await kubelet.wait_for_allocatable("rdma/roce", 10)
        host.set_port_state("mlx5_0", state="DOWN")
        await kubelet.wait_for_allocatable("rdma/roce", 5)
        assert kubelet.capacity("rdma/roce") == 10
        got = await kubelet.allocate("rdma/roce", 2)
        host.set_port_state("mlx5_0", state="ACTIVE")
        await kubelet.wait_for_allocatable("rdma/roce", 10)

    assert {i.split("::")[0] for i in got.device_ids} == {"mlx5_1"}
    assert got.allocation.env["RDMA_DEVICES"] == "mlx5_1"


async def test_a_device_discovered_unhealthy_recovers_without_a_restart(tmp_path: Path) -> None:
    host = connectx_ib_host(tmp_path)
    host.set_port_state("mlx5_0", state="INIT")  # no subnet manager yet
    (plugin,) = plugins(host, {"resourceName": "rdma/ib"}, healthInterval=0.05)

    async with FakeKubelet() as kubelet, serving(plugin, settings=kubelet.settings()):
        await kubelet.wait_for_health("rdma/ib", "mlx5_0", "Unhealthy")
        assert kubelet.allocatable("rdma/ib") == 1
        host.set_port_state("mlx5_0", state="ACTIVE")  # the subnet manager came up
        await kubelet.wait_for_allocatable("rdma/ib", 2)
        host.set_port_state("mlx5_0", state="DOWN")  # and the cable is pulled
        await kubelet.wait_for_health("rdma/ib", "mlx5_0", "Unhealthy")


async def test_a_removed_dev_node_reaches_the_kubelet_before_the_interval(tmp_path: Path) -> None:
    host = connectx_ib_host(tmp_path)
    (plugin,) = plugins(host, {"resourceName": "rdma/ib"}, healthInterval=600)

    async with FakeKubelet() as kubelet, serving(plugin, settings=kubelet.settings()):
        await kubelet.wait_for_allocatable("rdma/ib", 2)
        host.remove_dev_node("uverbs1")
        await kubelet.wait_for_health("rdma/ib", "mlx5_1", "Unhealthy", timeout=10)
        host.add_dev_node("uverbs1")  # the driver is back
        await kubelet.wait_for_allocatable("rdma/ib", 2, timeout=10)


def test_health_interval_paces_rescans_and_nothing_polls(tmp_path: Path) -> None:
    # It used to set DevicePlugin.health_interval, which only paces check_health polls, a
    # hook this backend does not have: the setting did nothing.
    host = connectx_ib_host(tmp_path)
    (plugin,) = plugins(host, {"resourceName": "rdma/ib"}, healthInterval=2)

    assert plugin.watch_interval == 2.0
    assert plugin.health_interval is None
    assert not plugin.overrides("check_health")
    assert plugin.overrides("watch")


# ----------------------------------------------------------------------------- config


def test_from_config_makes_one_plugin_per_resource(mixed: RdmaHost) -> None:
    host = mixed
    config = {
        **roots(host),
        "healthInterval": 2,
        "resources": [
            {"resourceName": "example.com/ib", "selectors": {"linkTypes": ["infiniband"]}},
            {
                "resourceName": "example.com/roce",
                "mode": "shared",
                "shares": 100,
                "selectors": [{"ifNames": ["ens3f0np0"]}, {"deviceIDs": ["101e"]}],
            },
        ],
    }

    found = rdma.from_config(config)

    assert [p.resource_name for p in found] == ["example.com/ib", "example.com/roce"]
    roce = found[1]
    assert isinstance(roce, rdma.RdmaPlugin)
    assert (roce.resource.mode, roce.resource.shares, roce.watch_interval) == ("shared", 100, 2.0)
    assert len(roce.resource.selectors) == 2
    assert (roce.sysfs_root, roce.dev_root) == (host.sysfs_root, host.dev_root)


def test_defaults_are_the_hosts_roots_and_every_device_whole() -> None:
    loaded = rdma.load_config({"resources": [{"resourceName": "rdma/a"}]})

    assert (loaded.sysfs_root, loaded.dev_root, loaded.rescan_interval) == (
        Path("/sys"),
        Path("/dev"),
        5.0,
    )
    assert loaded.resources == (rdma.RdmaResource("rdma/a"),)


def test_configured_falsy_values_are_kept_never_replaced_by_defaults() -> None:
    (resource,) = rdma.load_config(
        {"resources": [{"resourceName": "rdma/a", "issm": False, "rdmaCm": False, "ports": []}]}
    ).resources

    assert (resource.issm, resource.rdma_cm, resource.ports) == (False, False, ())


@pytest.mark.parametrize(
    ("top", "key"),
    [
        ({"healthInterval": 0}, "healthInterval"),
        ({"healthInterval": 0.0}, "healthInterval"),
        ({"sysfsRoot": ""}, "sysfsRoot"),
        ({"devRoot": ""}, "devRoot"),
        ({"sysfsRoot": None}, "sysfsRoot"),
    ],
)
def test_configured_falsy_values_are_refused_never_replaced_by_defaults(
    top: dict[str, Any], key: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        rdma.load_config({"resources": [{"resourceName": "rdma/a"}], **top})

    assert caught.value.key == key


def test_cdi_kind_follows_the_cdi_rules() -> None:
    # The old pattern took a class ending in '-', which CDI (and cdi.validate_kind) refuses.
    config = {"resources": [{"resourceName": "rdma/a", "cdiKind": "vendor.com/gpu-"}]}

    with pytest.raises(ConfigError) as caught:
        rdma.load_config(config)
    with pytest.raises(ValueError, match="CDI"):
        rdma.RdmaResource("rdma/a", cdi_kind="vendor.com/gpu-")

    assert caught.value.key == "resources[0].cdiKind"
    assert "vendor.com/gpu-" in caught.value.reason


@pytest.mark.parametrize(
    ("config", "key", "reason"),
    [
        ({}, "resources", "non-empty list"),
        ({"resources": []}, "resources", "non-empty list"),
        ({"resources": ["rdma/a"]}, "resources[0]", "must be a mapping"),
        ({"resources": [{"resourceName": "rdma/a"}], "sysfs": "/sys"}, "sysfs", "sysfsRoot"),
        ({"resources": [{"resourceName": "rdma/a"}], "sysfsRoot": "sys"}, "sysfsRoot", "absolute"),
        ({"resources": [{"mode": "shared"}]}, "resources[0].resourceName", "required"),
        ({"resources": [{"resourceName": "a"}]}, "resources[0].resourceName", "no '/'"),
        (
            {"resources": [{"resourceName": "rdma/a", "mode": "spread"}]},
            "resources[0].mode",
            "exclusive, shared",
        ),
        (
            {"resources": [{"resourceName": "rdma/a", "mode": "shared"}]},
            "resources[0].shares",
            "required",
        ),
        (
            {"resources": [{"resourceName": "rdma/a", "mode": "shared", "shares": 0}]},
            "resources[0].shares",
            ">= 1",
        ),
        (
            {"resources": [{"resourceName": "rdma/a", "shares": 4}]},
            "resources[0].shares",
            "only applies",
        ),
        (
            {"resources": [{"resourceName": "rdma/a", "ports": [1, 0]}]},
            "resources[0].ports[1]",
            ">= 1",
        ),
        (
            {"resources": [{"resourceName": "rdma/a", "issm": "yes"}]},
            "resources[0].issm",
            "true or false",
        ),
        (
            {"resources": [{"resourceName": "rdma/a", "cdiKind": "rdma"}]},
            "resources[0].cdiKind",
            "vendor.com",
        ),
        (
            {"resources": [{"resourceName": "rdma/a", "cdiKind": ""}]},
            "resources[0].cdiKind",
            "non-empty string",
        ),
        (
            {"resources": [{"resourceName": "rdma/a", "envPrefix": "1X"}]},
            "resources[0].envPrefix",
            "variable",
        ),
        (
            {"resources": [{"resourceName": "rdma/a", "selectors": {"vendor": ["15b3"]}}]},
            "resources[0].selectors.vendor",
            "did you mean 'vendors'",
        ),
        (
            {"resources": [{"resourceName": "rdma/a", "selectors": {"vendors": ["nvidia"]}}]},
            "resources[0].selectors.vendors[0]",
            "hex PCI ID",
        ),
        (
            {"resources": [{"resourceName": "rdma/a", "selectors": {"deviceIDs": ["101d", 5]}}]},
            "resources[0].selectors.deviceIDs[1]",
            "non-empty string",
        ),
        (
            {"resources": [{"resourceName": "rdma/a", "selectors": [{}, {"linkTypes": ["opa"]}]}]},
            "resources[0].selectors[1].linkTypes[0]",
            "must be one of",
        ),
        (
            {"resources": [{"resourceName": "rdma/a", "selectors": {"ifNames": "ib0"}}]},
            "resources[0].selectors.ifNames",
            "list of strings",
        ),
        (
            {"resources": [{"resourceName": "rdma/a", "selectors": []}]},
            "resources[0].selectors",
            "non-empty list",
        ),
        (
            {"resources": [{"resourceName": "rdma/a", "selectors": "all"}]},
            "resources[0].selectors",
            "must be a mapping",
        ),
        (
            {"resources": [{"resourceName": "rdma/a"}, {"resourceName": "rdma/a"}]},
            "resources[1].resourceName",
            "duplicate",
        ),
        ({"resources": [{"resourceName": "rdma/a"}], "healthInterval": 0}, "healthInterval", "> 0"),
        (
            {"resources": [{"resourceName": "rdma/a"}], "healthInterval": "5s"},
            "healthInterval",
            "number of seconds",
        ),
    ],
)
def test_config_errors_name_the_dotted_key(config: dict[str, Any], key: str, reason: str) -> None:
    with pytest.raises(ConfigError, match=reason) as caught:
        rdma.from_config(config)

    assert caught.value.key == key


_ODD_VALUES = [None, 0, -1, 0.5, "", "x", True, [], [None], [0], ["x"], [{}], {}, {"x": 1}]
_RESOURCE_KEYS = [
    "resourceName",
    "mode",
    "shares",
    "selectors",
    "ports",
    "issm",
    "rdmaCm",
    "cdiKind",
    "envPrefix",
]


@pytest.mark.parametrize("key", ["resources", "sysfsRoot", "devRoot", "healthInterval"])
@pytest.mark.parametrize("value", _ODD_VALUES, ids=repr)
def test_any_top_level_value_is_taken_or_refused_with_a_config_error(key: str, value: Any) -> None:
    config = {"resources": [{"resourceName": "rdma/a"}], key: value}
    with contextlib.suppress(ConfigError):
        rdma.from_config(config)


@pytest.mark.parametrize(
    "key",
    [
        *_RESOURCE_KEYS,
        *(
            f"selectors.{k}"
            for k in (
                "vendors",
                "deviceIDs",
                "drivers",
                "ifNames",
                "linkTypes",
                "rdmaDevices",
                "pciAddresses",
            )
        ),
    ],
)
@pytest.mark.parametrize("value", _ODD_VALUES, ids=repr)
def test_any_resource_value_is_taken_or_refused_with_a_config_error(key: str, value: Any) -> None:
    resource: dict[str, Any] = {"resourceName": "rdma/a", "mode": "shared", "shares": 2}
    if key.startswith("selectors."):
        resource["selectors"] = {key.removeprefix("selectors."): value}
    else:
        resource[key] = value
    with contextlib.suppress(ConfigError):
        rdma.from_config({"resources": [resource]})
