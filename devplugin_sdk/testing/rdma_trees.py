"""Fake sysfs/devfs trees of RDMA hosts (Mellanox ConnectX, mlx5), for tests of RDMA plugins.

Builds, under a temporary directory, the files, symlinks and ``/dev/infiniband`` nodes a real
mlx5 host shows: PCI functions under ``/sys/devices/pci*``, the ``bus``/``class`` symlinks that
point at them, ``infiniband``/``infiniband_verbs``/``infiniband_mad``/``net`` class devices, and
SR-IOV ``virtfnN``/``physfn`` links. Layouts follow the kernel's sysfs ABI (see
``devplugin_sdk.backends.rdma``).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "PHYS_STATES",
    "PORT_STATES",
    "RdmaFunction",
    "RdmaHost",
    "connectx_host",
    "connectx_ib_host",
    "connectx_roce_host",
]

# drivers/infiniband/core/sysfs.c: state_show prints "%d: %s" with these names.
PORT_STATES = {"NOP": 0, "DOWN": 1, "INIT": 2, "ARMED": 3, "ACTIVE": 4, "ACTIVE_DEFER": 5}
# drivers/infiniband/core/sysfs.c: phys_state_to_str, printed as "%u: %s".
PHYS_STATES = {
    "Sleep": 1,
    "Polling": 2,
    "Disabled": 3,
    "PortConfigurationTraining": 4,
    "LinkUp": 5,
    "LinkErrorRecovery": 6,
    "Phy Test": 7,
}
# Documentation/ABI/stable/sysfs-class-infiniband: ports/<n>/counters/* (PortCounters).
_COUNTERS = (
    "VL15_dropped",
    "excessive_buffer_overrun_errors",
    "link_downed",
    "link_error_recovery",
    "local_link_integrity_errors",
    "multicast_rcv_packets",
    "multicast_xmit_packets",
    "port_rcv_constraint_errors",
    "port_rcv_data",
    "port_rcv_errors",
    "port_rcv_packets",
    "port_rcv_remote_physical_errors",
    "port_rcv_switch_relay_errors",
    "port_xmit_constraint_errors",
    "port_xmit_data",
    "port_xmit_discards",
    "port_xmit_packets",
    "port_xmit_wait",
    "symbol_error",
    "unicast_rcv_packets",
    "unicast_xmit_packets",
)
# Character device numbers: ib_uverbs uses major 231 from minor 192, ib_umad major 231 from
# minor 0 (umadN) and 64 (issmN) (drivers/infiniband/core/{uverbs_main.c,user_mad.c}).
_UVERBS_MINOR_BASE = 192
_ISSM_MINOR_BASE = 64
# ARPHRD_ETHER and ARPHRD_INFINIBAND, shown in /sys/class/net/<if>/type.
_ARPHRD = {"Ethernet": 1, "InfiniBand": 32}
# PCI class codes: 0x0200 Ethernet controller, 0x0207 InfiniBand controller.
_PCI_CLASS = {"Ethernet": "0x020000", "InfiniBand": "0x020700"}


@dataclass
class RdmaFunction:
    """One PCI function of a fake host and the RDMA device on it.

    Attributes:
        pci_address: e.g. ``0000:3b:00.0``.
        ibdev: RDMA device name, e.g. ``mlx5_0``.
        netdev: Its network interface (``ib0``, ``ens1f0np0``), or None.
        link_layer: ``"InfiniBand"`` or ``"Ethernet"`` (RoCE).
        uverbs: ``uverbsN`` node name.
        umad: ``umadN`` node name (the one port's; mlx5 functions have one port).
        issm: ``issmN`` node name.
        device_dir: The function's real directory under ``sys/devices``.
        physfn: PCI address of the PF when this is an SR-IOV VF.
    """

    pci_address: str
    ibdev: str
    netdev: str | None
    link_layer: str
    uverbs: str
    umad: str
    issm: str
    device_dir: Path
    physfn: str | None = None
    vfs: list[str] = field(default_factory=list)


class RdmaHost:
    """A fake RDMA host: ``<root>/sys`` and ``<root>/dev``, filled by ``add_function``.

    Every path a real host has as a symlink is a symlink here (``/sys/class/*/<name>``,
    ``/sys/bus/pci/devices/<addr>``, ``device``, ``driver``, ``subsystem``, ``virtfnN``,
    ``physfn``); ``/dev/infiniband`` nodes are regular files standing in for character devices.
    Unused GID-table entries, which exist on a real host but fail to read with EINVAL, are left
    out: a reader that treats unreadable attributes as absent sees the same thing.

    Args:
        root: An empty directory (e.g. pytest's ``tmp_path``).
    """

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.sysfs_root = self.root / "sys"
        self.dev_root = self.root / "dev"
        self.functions: dict[str, RdmaFunction] = {}
        self._next_uverbs = 0
        self._next_umad = 0
        self._base()

    # ------------------------------------------------------------------ building

    def _base(self) -> None:
        sys_ = self.sysfs_root
        # Class-wide ABI versions (Documentation/ABI/stable/sysfs-class-infiniband).
        _write(sys_ / "class/infiniband_verbs/abi_version", "6")
        _write(sys_ / "class/infiniband_mad/abi_version", "5")
        (sys_ / "class/infiniband").mkdir(parents=True, exist_ok=True)
        (sys_ / "class/net").mkdir(parents=True, exist_ok=True)
        (sys_ / "bus/pci/devices").mkdir(parents=True, exist_ok=True)
        # rdma_cm is a misc device (drivers/infiniband/core/ucma.c) with a dynamic minor.
        misc = sys_ / "devices/virtual/misc/rdma_cm"
        _write(misc / "dev", "10:58")
        _link(misc / "subsystem", "../../../../class/misc")
        _link(sys_ / "class/misc/rdma_cm", "../../devices/virtual/misc/rdma_cm")
        _write(self.dev_root / "infiniband/rdma_cm", "")

    def add_function(
        self,
        pci_address: str,
        *,
        ibdev: str,
        netdev: str | None,
        link_layer: str = "Ethernet",
        vendor: str = "0x15b3",
        device: str = "0x101d",
        driver: str = "mlx5_core",
        numa_node: int = 0,
        node_guid: str = "b859:9f03:00d4:2a3c",
        state: str = "ACTIVE",
        phys_state: str = "LinkUp",
        physfn: str | None = None,
        sriov_totalvfs: int | None = 8,
        root_port: str | None = None,
    ) -> RdmaFunction:
        """Add a PCI function with an RDMA device that has one port, as mlx5 does.

        Args:
            pci_address: The function's address, e.g. ``0000:3b:00.0``.
            ibdev: RDMA device name (``mlx5_N``).
            netdev: Network interface name, or None for none.
            link_layer: ``"InfiniBand"`` or ``"Ethernet"``.
            vendor: PCI vendor ID as sysfs prints it (``0x15b3`` is Mellanox).
            device: PCI device ID (``0x101b`` ConnectX-6, ``0x101d`` ConnectX-6 Dx,
                ``0x101e`` its VF, ``0x1021`` ConnectX-7).
            driver: Bound driver name.
            numa_node: NUMA node (-1 for none).
            node_guid: Node GUID as sysfs prints it (four groups of four hex digits).
            state: Port logical state name (``PORT_STATES``).
            phys_state: Port physical state name (``PHYS_STATES``).
            physfn: PF address when this function is an SR-IOV VF (links ``physfn``/``virtfnN``).
            sriov_totalvfs: Written for PFs; None leaves SR-IOV files out.
            root_port: Address of the upstream root port; defaults to ``<domain>:<bus-1>:02.0``
                (VFs take their PF's).

        Returns:
            The new function.
        """
        if link_layer not in _ARPHRD:
            raise ValueError(f"link_layer must be 'InfiniBand' or 'Ethernet', got {link_layer!r}")
        if pci_address in self.functions:
            raise ValueError(f"function {pci_address} already exists")
        if physfn is not None:
            parent = self.functions[physfn]
            root_dir = parent.device_dir.parent
        else:
            root_dir = self.sysfs_root / "devices" / _root_path(pci_address, root_port)
        dev_dir = root_dir / pci_address
        rel_from_sys = dev_dir.relative_to(self.sysfs_root)
        self._pci_function(
            dev_dir,
            rel_from_sys,
            vendor=vendor,
            device=device,
            link_layer=link_layer,
            driver=driver,
            numa_node=numa_node,
        )
        self._sriov(dev_dir, physfn, sriov_totalvfs)
        self._rdma_device(dev_dir, rel_from_sys, ibdev, device=device, node_guid=node_guid)
        self._write_port(
            dev_dir / "infiniband" / ibdev / "ports/1",
            link_layer=link_layer,
            netdev=netdev,
            node_guid=node_guid,
            state=state,
            phys_state=phys_state,
        )
        uverbs = self._uverbs(dev_dir, rel_from_sys, ibdev)
        umad, issm = self._mad(dev_dir, rel_from_sys, ibdev)
        if netdev is not None:
            self._netdev(dev_dir, rel_from_sys, netdev, link_layer=link_layer, state=state)
        function = RdmaFunction(
            pci_address=pci_address,
            ibdev=ibdev,
            netdev=netdev,
            link_layer=link_layer,
            uverbs=uverbs,
            umad=umad,
            issm=issm,
            device_dir=dev_dir,
            physfn=physfn,
        )
        self.functions[pci_address] = function
        return function

    def _pci_function(
        self,
        dev_dir: Path,
        rel_from_sys: Path,
        *,
        vendor: str,
        device: str,
        link_layer: str,
        driver: str,
        numa_node: int,
    ) -> None:
        """The PCI function itself (Documentation/ABI/testing/sysfs-bus-pci)."""
        pci_address = dev_dir.name
        # e.g. devices/pci0000:3a/0000:3a:02.0/0000:3b:00.0: four levels back up to /sys.
        up = "/".join([".."] * len(rel_from_sys.parts))
        _write(dev_dir / "vendor", vendor)
        _write(dev_dir / "device", device)
        _write(dev_dir / "subsystem_vendor", vendor)
        _write(dev_dir / "subsystem_device", "0x0016")
        _write(dev_dir / "class", _PCI_CLASS[link_layer])
        _write(dev_dir / "numa_node", str(numa_node))
        _write(dev_dir / "local_cpulist", "0-15" if numa_node <= 0 else "16-31")
        _write(dev_dir / "enable", "1")
        _write(dev_dir / "uevent", f"DRIVER={driver}\nPCI_SLOT_NAME={pci_address}")
        _link(dev_dir / "subsystem", f"{up}/bus/pci")
        _link(dev_dir / "driver", f"{up}/bus/pci/drivers/{driver}")
        drivers_dir = self.sysfs_root / "bus/pci/drivers" / driver
        _link(drivers_dir / pci_address, f"../../../../{rel_from_sys}")
        _link(self.sysfs_root / "bus/pci/devices" / pci_address, f"../../../{rel_from_sys}")

    def _sriov(self, dev_dir: Path, physfn: str | None, totalvfs: int | None) -> None:
        """A PF's SR-IOV files, or a VF's links to and from its PF."""
        if physfn is None:
            if totalvfs is not None:
                _write(dev_dir / "sriov_totalvfs", str(totalvfs))
                _write(dev_dir / "sriov_numvfs", "0")
            return
        parent = self.functions[physfn]
        # SR-IOV: <vf>/physfn -> ../<pf>, <pf>/virtfnN -> ../<vf> (drivers/pci/iov.c).
        _link(dev_dir / "physfn", f"../{physfn}")
        index = len(parent.vfs)
        _link(parent.device_dir / f"virtfn{index}", f"../{dev_dir.name}")
        parent.vfs.append(dev_dir.name)
        _write(parent.device_dir / "sriov_numvfs", str(len(parent.vfs)))

    def _rdma_device(
        self, dev_dir: Path, rel_from_sys: Path, ibdev: str, *, device: str, node_guid: str
    ) -> None:
        """The RDMA device; its parent is the PCI function (mlx5_ib: ib_dev.dev.parent =
        mdev->device)."""
        up = "/".join([".."] * len(rel_from_sys.parts))
        ib_dir = dev_dir / "infiniband" / ibdev
        _link(ib_dir / "device", f"../../../{dev_dir.name}")
        _link(ib_dir / "subsystem", f"../../{up}/class/infiniband")
        _write(ib_dir / "node_type", "1: CA")
        _write(ib_dir / "node_guid", node_guid)
        _write(ib_dir / "sys_image_guid", node_guid)
        _write(ib_dir / "node_desc", f"host {ibdev}")
        _write(ib_dir / "fw_ver", "22.39.1002")
        # mlx5 prints the PCI device ID in decimal: MT4123 is ConnectX-6 (0x101b).
        _write(ib_dir / "hca_type", f"MT{int(device, 16)}")
        _write(ib_dir / "hw_rev", "0x0")
        _write(ib_dir / "board_id", "MT_0000000359")
        self._class_link("infiniband", ibdev, rel_from_sys)

    def _uverbs(self, dev_dir: Path, rel_from_sys: Path, ibdev: str) -> str:
        """uverbsN: its parent is the RDMA device's parent (uverbs_main.c ib_uverbs_add_one)."""
        uverbs = f"uverbs{self._next_uverbs}"
        uv_dir = dev_dir / "infiniband_verbs" / uverbs
        _write(uv_dir / "ibdev", ibdev)
        _write(uv_dir / "abi_version", "1")
        _write(uv_dir / "dev", f"231:{_UVERBS_MINOR_BASE + self._next_uverbs}")
        _link(uv_dir / "device", f"../../../{dev_dir.name}")
        self._class_link("infiniband_verbs", uverbs, rel_from_sys)
        _write(self.dev_root / "infiniband" / uverbs, "")
        self._next_uverbs += 1
        return uverbs

    def _mad(self, dev_dir: Path, rel_from_sys: Path, ibdev: str) -> tuple[str, str]:
        """umadN and issmN of the port, same N (user_mad.c ib_umad_init_port)."""
        n = self._next_umad
        umad, issm = f"umad{n}", f"issm{n}"
        for name, minor in ((umad, n), (issm, _ISSM_MINOR_BASE + n)):
            mad_dir = dev_dir / "infiniband_mad" / name
            _write(mad_dir / "ibdev", ibdev)
            _write(mad_dir / "port", "1")
            _write(mad_dir / "dev", f"231:{minor}")
            _link(mad_dir / "device", f"../../../{dev_dir.name}")
            self._class_link("infiniband_mad", name, rel_from_sys)
            _write(self.dev_root / "infiniband" / name, "")
        self._next_umad += 1
        return umad, issm

    def _netdev(
        self, dev_dir: Path, rel_from_sys: Path, netdev: str, *, link_layer: str, state: str
    ) -> None:
        """The netdev: its parent is the PCI function too (ipoib sets dev_port = port - 1)."""
        net_dir = dev_dir / "net" / netdev
        _write(net_dir / "type", str(_ARPHRD[link_layer]))
        _write(net_dir / "dev_port", "0")
        _write(net_dir / "dev_id", "0x0")
        _write(net_dir / "operstate", "up" if state == "ACTIVE" else "down")
        _write(net_dir / "ifindex", str(10 + len(self.functions)))
        # A MAC for Ethernet; IPoIB's 20-byte address (QPN, then the port GID).
        index = len(self.functions)
        mac = f"b8:ce:f6:00:00:{index:02x}"
        if link_layer == "InfiniBand":
            mac = f"00:00:10:49:fe:80:00:00:00:00:00:00:b8:ce:f6:03:00:00:00:{index:02x}"
        _write(net_dir / "address", mac)
        _link(net_dir / "device", f"../../../{dev_dir.name}")
        self._class_link("net", netdev, rel_from_sys)

    def _class_link(self, class_name: str, name: str, function_dir: Path) -> None:
        """``/sys/class/<class>/<name> -> ../../devices/.../<function>/<class>/<name>``."""
        target = f"../../{function_dir}/{class_name}/{name}"
        _link(self.sysfs_root / "class" / class_name / name, target)

    def _write_port(
        self,
        port_dir: Path,
        *,
        link_layer: str,
        netdev: str | None,
        node_guid: str,
        state: str,
        phys_state: str,
    ) -> None:
        _write(port_dir / "link_layer", link_layer)
        _write(port_dir / "state", _state_text(state))
        _write(port_dir / "phys_state", _phys_text(phys_state))
        _write(port_dir / "cap_mask", "0x00010000" if link_layer == "Ethernet" else "0xa651e848")
        _write(port_dir / "lid_mask_count", "0")
        _write(port_dir / "sm_sl", "0")
        if link_layer == "InfiniBand":
            _write(port_dir / "rate", "200 Gb/sec (4X HDR)")
            _write(port_dir / "lid", "0x7")
            _write(port_dir / "sm_lid", "0x1")
        else:
            _write(port_dir / "rate", "100 Gb/sec (2X HDR)")
            _write(port_dir / "lid", "0x0")
            _write(port_dir / "sm_lid", "0x0")
        for counter in _COUNTERS:
            _write(port_dir / "counters" / counter, "0")
        _write(port_dir / "pkeys/0", "0xffff")
        guid = node_guid.replace(":", "")
        interface_id = ":".join(guid[i : i + 4] for i in range(0, 16, 4))
        link_local = f"fe80:0000:0000:0000:{interface_id}"
        if link_layer == "InfiniBand":
            # IB GIDs carry no netdev: reading gid_attrs/ndevs/<n> fails (EINVAL), left out here.
            _write(port_dir / "gids/0", link_local)
            _write(port_dir / "gid_attrs/types/0", "IB/RoCE v1")
            return
        # RoCE: GID 0/1 are the link-local GID as RoCE v1 and v2; 2/3 an IPv4-mapped address.
        gids = [
            (link_local, "IB/RoCE v1"),
            (link_local, "RoCE v2"),
            ("0000:0000:0000:0000:0000:ffff:c0a8:010a", "IB/RoCE v1"),
            ("0000:0000:0000:0000:0000:ffff:c0a8:010a", "RoCE v2"),
        ]
        for index, (gid, gid_type) in enumerate(gids):
            _write(port_dir / "gids" / str(index), gid)
            _write(port_dir / "gid_attrs/types" / str(index), gid_type)
            if netdev is not None:
                _write(port_dir / "gid_attrs/ndevs" / str(index), netdev)

    # ------------------------------------------------------------------ changing

    def set_port_state(
        self, ibdev: str, port: int = 1, *, state: str, phys_state: str | None = None
    ) -> None:
        """Change a port's logical and physical state, as a link flap or cable pull would.

        Args:
            ibdev: RDMA device name.
            port: Port number.
            state: New logical state name (``ACTIVE``, ``DOWN``, ``INIT``...).
            phys_state: New physical state name; defaults to ``LinkUp`` when ``state`` is
                ``ACTIVE``, else ``Disabled`` on Ethernet (netdev down) and ``Polling`` on
                InfiniBand (no peer).
        """
        port_dir = self.sysfs_root / "class/infiniband" / ibdev / "ports" / str(port)
        if not port_dir.is_dir():
            raise ValueError(f"{ibdev} has no port {port}")
        if phys_state is None:
            if state == "ACTIVE":
                phys_state = "LinkUp"
            elif (port_dir / "link_layer").read_text().strip() == "Ethernet":
                phys_state = "Disabled"
            else:
                phys_state = "Polling"
        _write(port_dir / "state", _state_text(state))
        _write(port_dir / "phys_state", _phys_text(phys_state))

    def remove_function(self, pci_address: str) -> None:
        """Hot-unplug a function (or destroy a VF): its sysfs entries and /dev nodes go away."""
        function = self.functions.pop(pci_address)
        sys_ = self.sysfs_root
        for vf in list(function.vfs):
            self.remove_function(vf)
        _unlink(sys_ / "class/infiniband" / function.ibdev)
        _unlink(sys_ / "class/infiniband_verbs" / function.uverbs)
        for name in (function.umad, function.issm):
            _unlink(sys_ / "class/infiniband_mad" / name)
            _unlink(self.dev_root / "infiniband" / name)
        _unlink(self.dev_root / "infiniband" / function.uverbs)
        if function.netdev is not None:
            _unlink(sys_ / "class/net" / function.netdev)
        _unlink(sys_ / "bus/pci/devices" / pci_address)
        for driver_dir in (sys_ / "bus/pci/drivers").iterdir():
            _unlink(driver_dir / pci_address)
        if function.physfn is not None:
            parent = self.functions.get(function.physfn)
            if parent is not None:
                index = parent.vfs.index(pci_address)
                _unlink(parent.device_dir / f"virtfn{index}")
                parent.vfs.remove(pci_address)
                _write(parent.device_dir / "sriov_numvfs", str(len(parent.vfs)))
        shutil.rmtree(function.device_dir)

    def remove_dev_node(self, name: str) -> None:
        """Delete ``/dev/infiniband/<name>`` (e.g. ``rdma_cm`` before its module is loaded)."""
        _unlink(self.dev_root / "infiniband" / name)

    def add_dev_node(self, name: str) -> None:
        """Create ``/dev/infiniband/<name>``."""
        _write(self.dev_root / "infiniband" / name, "")


# ---------------------------------------------------------------------- ready-made hosts


def connectx_roce_host(root: Path, *, vfs: int = 2) -> RdmaHost:
    """A host with one dual-port ConnectX-6 Dx in RoCE mode (two PFs) and ``vfs`` VFs on port 0.

    ``mlx5_0``/``ens1f0np0`` at ``0000:3b:00.0`` and ``mlx5_1``/``ens1f1np1`` at
    ``0000:3b:00.1`` on NUMA node 0; VFs ``0000:3b:00.2``... are ``mlx5_2``... with netdevs
    ``ens1f0v0``... (device ID ``0x101e``).
    """
    host = RdmaHost(root)
    for n in range(2):
        host.add_function(
            f"0000:3b:00.{n}",
            ibdev=f"mlx5_{n}",
            netdev=f"ens1f{n}np{n}",
            node_guid=f"b859:9f03:00d4:2a3{12 + n:x}",
        )
    for n in range(vfs):
        host.add_function(
            f"0000:3b:00.{2 + n}",
            ibdev=f"mlx5_{2 + n}",
            netdev=f"ens1f0v{n}",
            device="0x101e",
            physfn="0000:3b:00.0",
            node_guid=f"0000:0000:0000:00{n:02x}",
        )
    return host


def connectx_ib_host(root: Path) -> RdmaHost:
    """A host with two ConnectX-6 HDR InfiniBand functions on different NUMA nodes.

    ``mlx5_0``/``ib0`` at ``0000:17:00.0`` (NUMA 0) and ``mlx5_1``/``ib1`` at ``0000:ca:00.0``
    (NUMA 1), device ID ``0x101b``.
    """
    host = RdmaHost(root)
    host.add_function(
        "0000:17:00.0",
        ibdev="mlx5_0",
        netdev="ib0",
        link_layer="InfiniBand",
        device="0x101b",
        numa_node=0,
        node_guid="0c42:a103:0065:9d50",
    )
    host.add_function(
        "0000:ca:00.0",
        ibdev="mlx5_1",
        netdev="ib1",
        link_layer="InfiniBand",
        device="0x101b",
        numa_node=1,
        node_guid="0c42:a103:0065:9d60",
    )
    return host


def connectx_host(root: Path, *, vfs: int = 2) -> RdmaHost:
    """A mixed host: two InfiniBand functions (``mlx5_0``, ``mlx5_1``, as ``connectx_ib_host``)
    and a ConnectX-6 Dx RoCE PF (``mlx5_2``/``ens3f0np0`` at ``0000:b1:00.0``, NUMA 1) with
    ``vfs`` VFs (``mlx5_3``..., ``ens3f0v0``..., device ID ``0x101e``).
    """
    host = connectx_ib_host(root)
    host.add_function(
        "0000:b1:00.0",
        ibdev="mlx5_2",
        netdev="ens3f0np0",
        numa_node=1,
        node_guid="1070:fd03:00a1:b2c0",
    )
    for n in range(vfs):
        host.add_function(
            f"0000:b1:00.{2 + n}",
            ibdev=f"mlx5_{3 + n}",
            netdev=f"ens3f0v{n}",
            device="0x101e",
            numa_node=1,
            physfn="0000:b1:00.0",
            node_guid=f"0000:0000:0001:00{n:02x}",
        )
    return host


# ---------------------------------------------------------------------- helpers


def _root_path(pci_address: str, root_port: str | None) -> str:
    domain, bus, _ = pci_address.split(":", 2)
    if root_port is None:
        upstream_bus = max(int(bus, 16) - 1, 0)
        root_port = f"{domain}:{upstream_bus:02x}:02.0"
    root_domain, root_bus, _ = root_port.split(":", 2)
    return f"pci{root_domain}:{root_bus}/{root_port}"


def _state_text(state: str) -> str:
    if state not in PORT_STATES:
        raise ValueError(f"unknown port state {state!r}; one of {sorted(PORT_STATES)}")
    return f"{PORT_STATES[state]}: {state}"


def _phys_text(phys_state: str) -> str:
    if phys_state not in PHYS_STATES:
        raise ValueError(f"unknown physical state {phys_state!r}; one of {sorted(PHYS_STATES)}")
    return f"{PHYS_STATES[phys_state]}: {phys_state}"


def _write(path: Path, text: str) -> None:
    """Write an attribute the way sysfs shows it: the value and a newline.

    A change replaces the file at once (a new file renamed over it), as a read of a real
    attribute is atomic: a plugin rescanning while a test flips a port never reads a
    half-written state.
    """
    content = text + "\n" if text else ""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content, encoding="utf-8")
        return
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(content, encoding="utf-8")
    os.replace(temporary, path)


def _link(path: Path, target: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_symlink():
        path.unlink()
    os.symlink(target, path)


def _unlink(path: Path) -> None:
    path.unlink(missing_ok=True)
