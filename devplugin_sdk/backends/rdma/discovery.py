"""What the RDMA backend finds in sysfs: each RDMA device (an HCA, a RoCE NIC, an SR-IOV VF)
with its PCI identity, ports and their state, netdevs and /dev/infiniband nodes (``scan``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from devplugin_sdk.backends import _sysfs

__all__ = ["PHYS_LINK_UP", "PORT_ACTIVE", "RdmaDeviceInfo", "RdmaPort", "scan"]

# ib_core port states and physical states (drivers/infiniband/core/sysfs.c, IBTA PortInfo).
PORT_ACTIVE = 4
PHYS_LINK_UP = 5

# /dev/infiniband/<name> is where udev puts uverbsN, umadN, issmN and rdma_cm: every one of these
# classes has a devnode callback returning "infiniband/%s" (uverbs_main.c, user_mad.c, ucma.c).
_DEV_SUBDIR = "infiniband"
_HOST_DEV = Path("/dev") / _DEV_SUBDIR
_PCI_ADDRESS = re.compile(r"^[0-9a-f]{4,}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")


@dataclass(frozen=True, slots=True)
class RdmaPort:
    """One port of an RDMA device, as ``/sys/class/infiniband/<dev>/ports/<n>`` shows it.

    Attributes:
        number: Port number (from 1 on HCAs).
        state: Logical state code (4 = ACTIVE), None if unreadable.
        state_name: Its name (``ACTIVE``, ``DOWN``, ``INIT``...).
        phys_state: Physical state code (5 = LinkUp), None if unreadable.
        phys_state_name: Its name (``LinkUp``, ``Polling``, ``Disabled``...).
        link_layer: ``InfiniBand``, ``Ethernet`` (RoCE) or ``Unknown``.
        netdevs: Network interfaces of this port.
        umad: ``umadN`` node of this port, if any.
        issm: ``issmN`` node of this port, if any.
    """

    number: int
    state: int | None
    state_name: str
    phys_state: int | None
    phys_state_name: str
    link_layer: str
    netdevs: tuple[str, ...] = ()
    umad: str | None = None
    issm: str | None = None

    @property
    def active(self) -> bool:
        """ACTIVE and LinkUp: the port passes traffic (INIT + LinkUp means no subnet manager)."""
        return self.state == PORT_ACTIVE and self.phys_state == PHYS_LINK_UP


@dataclass(frozen=True, slots=True)
class RdmaDeviceInfo:
    """An RDMA device found in sysfs, with its PCI function and character devices.

    Attributes:
        name: RDMA device name (``mlx5_0``).
        pci_address: Its PCI function, or None when the parent is not a PCI device
            (soft-RoCE, sub-functions).
        vendor: PCI vendor ID, lowercase hex without ``0x`` (``15b3``).
        device_id: PCI device ID, lowercase hex without ``0x`` (``101d``).
        driver: Driver bound to the PCI function (``mlx5_core``).
        node_guid: Node GUID as sysfs prints it.
        numa_node: NUMA node of the PCI function, None when unknown.
        physfn: PCI address of the physical function when this is an SR-IOV VF.
        uverbs: ``uverbsN`` node name, None when ib_uverbs exposes none.
        ports: The device's ports, by number.
    """

    name: str
    pci_address: str | None
    vendor: str | None
    device_id: str | None
    driver: str | None
    node_guid: str | None
    numa_node: int | None
    physfn: str | None
    uverbs: str | None
    ports: tuple[RdmaPort, ...]

    @property
    def netdevs(self) -> tuple[str, ...]:
        """Network interfaces of every port, without repeats."""
        return tuple(dict.fromkeys(n for port in self.ports for n in port.netdevs))

    @property
    def link_layers(self) -> tuple[str, ...]:
        """Link layers of the ports, without repeats."""
        return tuple(dict.fromkeys(port.link_layer for port in self.ports))

    @property
    def is_vf(self) -> bool:
        """Whether the device sits on an SR-IOV virtual function."""
        return self.physfn is not None


def scan(sysfs_root: Path = Path("/sys")) -> list[RdmaDeviceInfo]:
    """Read every RDMA device under ``<sysfs_root>/class/infiniband``; blocking.

    A device whose attributes cannot be read is still returned, with those fields None, so
    that health can report it rather than the device silently vanishing.

    Args:
        sysfs_root: Root of sysfs (``/sys`` on a host).

    Returns:
        Devices sorted by name.
    """
    sysfs_root = Path(sysfs_root)
    uverbs_by_dev = _uverbs_nodes(sysfs_root)
    mad_by_port = _mad_nodes(sysfs_root)
    devices: list[RdmaDeviceInfo] = []
    # /sys/class/infiniband/<dev> are symlinks into the parent device's directory.
    class_dir = sysfs_root / "class" / "infiniband"
    for name in sorted(_sysfs.list_dir(class_dir), key=_natural_key):
        ib_dir = class_dir / name
        # <dev>/device -> the parent device: a PCI function for mlx5 PFs and VFs
        # (mlx5_ib sets ib_dev.dev.parent = mdev->device).
        parent_name = _sysfs.read_link_name(ib_dir / "device")
        parent_dir = ib_dir / "device"
        pci_address = parent_name if parent_name and _PCI_ADDRESS.match(parent_name) else None
        devices.append(
            RdmaDeviceInfo(
                name=name,
                pci_address=pci_address,
                vendor=_hex_id(_sysfs.read_attr(parent_dir / "vendor")),
                device_id=_hex_id(_sysfs.read_attr(parent_dir / "device")),
                # <pci>/driver -> ../../../../bus/pci/drivers/<name>
                driver=_sysfs.read_link_name(parent_dir / "driver"),
                node_guid=_sysfs.read_attr(ib_dir / "node_guid"),
                numa_node=_sysfs.numa_node(parent_dir),
                # An SR-IOV VF has physfn -> ../<pf address> (drivers/pci/iov.c).
                physfn=_sysfs.read_link_name(parent_dir / "physfn"),
                uverbs=uverbs_by_dev.get(name),
                ports=_read_ports(ib_dir, parent_dir, name, mad_by_port),
            )
        )
    return devices


def _read_ports(
    ib_dir: Path, parent_dir: Path, name: str, mad_by_port: Mapping[tuple[str, int], dict[str, str]]
) -> tuple[RdmaPort, ...]:
    ports: list[RdmaPort] = []
    for entry in _sysfs.list_dir(ib_dir / "ports"):
        if not entry.isdigit():
            continue
        number = int(entry)
        port_dir = ib_dir / "ports" / entry
        # state is "4: ACTIVE", phys_state "5: LinkUp" (sysfs.c state_show/phys_state_show).
        state, state_name = _coded(_sysfs.read_attr(port_dir / "state"))
        phys, phys_name = _coded(_sysfs.read_attr(port_dir / "phys_state"))
        # link_layer is "InfiniBand", "Ethernet" or "Unknown" (sysfs.c link_layer_show).
        link_layer = _sysfs.read_attr(port_dir / "link_layer") or "Unknown"
        mad = mad_by_port.get((name, number), {})
        ports.append(
            RdmaPort(
                number=number,
                state=state,
                state_name=state_name,
                phys_state=phys,
                phys_state_name=phys_name,
                link_layer=link_layer,
                netdevs=_port_netdevs(port_dir, parent_dir, number),
                umad=mad.get("umad"),
                issm=mad.get("issm"),
            )
        )
    return tuple(sorted(ports, key=lambda p: p.number))


def _port_netdevs(port_dir: Path, parent_dir: Path, number: int) -> tuple[str, ...]:
    """The port's own interfaces, then (only if it has none) the interfaces its GIDs name."""
    names: list[str] = []
    # Interfaces whose parent is the PCI function sit in <pci>/net/; a multi-port device tells
    # them apart by dev_port = port - 1 (ipoib_main.c; mlx4_en does the same).
    for netdev in _sysfs.list_dir(parent_dir / "net"):
        dev_port = _sysfs.read_int(parent_dir / "net" / netdev / "dev_port", 10)
        if dev_port is None or dev_port == number - 1:
            names.append(netdev)
    if names:
        return tuple(names)
    # RoCE GID entries name their netdev in gid_attrs/ndevs/<index>; unused entries and every
    # InfiniBand entry fail to read (EINVAL), which read_attr maps to None. These also list
    # upper devices (VLANs, bonds), which is why they are only the fallback (e.g. for
    # sub-functions, whose netdev's parent is not the PCI function).
    ndev_dir = port_dir / "gid_attrs" / "ndevs"
    entries = sorted(_sysfs.list_dir(ndev_dir), key=_natural_key)
    found = (_sysfs.read_attr(ndev_dir / index) for index in entries)
    return tuple(dict.fromkeys(n for n in found if n))


def _uverbs_nodes(sysfs_root: Path) -> dict[str, str]:
    """``{ibdev: "uverbsN"}`` from ``/sys/class/infiniband_verbs/uverbsN/ibdev``."""
    class_dir = sysfs_root / "class" / "infiniband_verbs"
    out: dict[str, str] = {}
    for entry in _sysfs.list_dir(class_dir):
        if not entry.startswith("uverbs"):
            continue  # abi_version is a class attribute, not a device
        # Compare the whole name: rdmamap once matched by substring (mlx5_1 in mlx5_10).
        ibdev = _sysfs.read_attr(class_dir / entry / "ibdev")
        if ibdev:
            out.setdefault(ibdev, entry)
    return out


def _mad_nodes(sysfs_root: Path) -> dict[tuple[str, int], dict[str, str]]:
    """``{(ibdev, port): {"umad": "umadN", "issm": "issmN"}}`` from ``/sys/class/infiniband_mad``.

    Each port has one umadN and one issmN, each with ``ibdev`` and ``port`` attributes
    (Documentation/ABI/stable/sysfs-class-infiniband).
    """
    class_dir = sysfs_root / "class" / "infiniband_mad"
    out: dict[tuple[str, int], dict[str, str]] = {}
    for entry in _sysfs.list_dir(class_dir):
        kind = "umad" if entry.startswith("umad") else "issm" if entry.startswith("issm") else None
        if kind is None:
            continue
        ibdev = _sysfs.read_attr(class_dir / entry / "ibdev")
        port = _sysfs.read_int(class_dir / entry / "port", 10)
        if ibdev and port is not None:
            out.setdefault((ibdev, port), {}).setdefault(kind, entry)
    return out


def _coded(text: str | None) -> tuple[int | None, str]:
    """Split ``"4: ACTIVE"`` into ``(4, "ACTIVE")``."""
    if text is None:
        return None, "unreadable"
    code, sep, name = text.partition(":")
    if not sep:
        return None, text
    try:
        return int(code.strip()), name.strip()
    except ValueError:
        return None, text


def _hex_id(text: str | None) -> str | None:
    """``"0x15b3"`` (as sysfs prints PCI IDs) -> ``"15b3"``."""
    if text is None:
        return None
    text = text.strip().lower()
    return text[2:] if text.startswith("0x") else text


def _natural_key(name: str) -> tuple[str, int, str]:
    """Sort ``mlx5_2`` before ``mlx5_10``."""
    match = re.match(r"^(.*?)(\d+)$", name)
    if match is None:
        return name, -1, name
    return match.group(1), int(match.group(2)), name
