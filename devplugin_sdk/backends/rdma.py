"""RDMA backend: InfiniBand HCAs, RoCE NICs and their SR-IOV VFs, discovered from sysfs and
handed out whole (``exclusive``) or in shares (``shared``), with health from port state.

It owns the sysfs reading (``scan``), selection (``Selector``), health rules (``evaluate_health``),
the ``RdmaPlugin`` and the YAML schema (``load_config``/``from_config``).

Layouts were learned from: linux ``Documentation/ABI/stable/sysfs-class-infiniband``;
``drivers/infiniband/core/{sysfs.c,uverbs_main.c,user_mad.c,ucma.c}``;
``drivers/infiniband/hw/mlx5/main.c``; ``drivers/infiniband/ulp/ipoib/ipoib_main.c``;
rdma-core ``libibverbs/init-sysfs.c``; Mellanox/rdmamap ``rdma_map.go``;
Mellanox/k8s-rdma-shared-dev-plugin ``pkg/utils/utils.go``, ``pkg/resources/device_selectors.go``,
``pkg/resources/rdma_device_spec.go``, ``README.md``; k8snetworkplumbingwg/
sriov-network-device-plugin ``pkg/infoprovider/rdmaInfoProvider.go``, ``pkg/utils/utils_test.go``.
"""

from __future__ import annotations

import logging
import re
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import anyio
from typing_extensions import Self

from devplugin_sdk import cdi, fswatch
from devplugin_sdk.backends import _sysfs
from devplugin_sdk.config import ConfigReader, shown
from devplugin_sdk.errors import ConfigError
from devplugin_sdk.plugin import DevicePlugin
from devplugin_sdk.types import (
    Allocation,
    Device,
    DeviceNode,
    Health,
    HealthEvent,
    RescanEvent,
    replicate,
)

__all__ = [
    "RdmaConfig",
    "RdmaDeviceInfo",
    "RdmaPlugin",
    "RdmaPort",
    "RdmaResource",
    "Selector",
    "evaluate_health",
    "from_config",
    "load_config",
    "scan",
]

log = logging.getLogger(__name__)

Mode = Literal["exclusive", "shared"]

# ib_core port states and physical states (drivers/infiniband/core/sysfs.c, IBTA PortInfo).
PORT_ACTIVE = 4
PHYS_LINK_UP = 5
# /dev/infiniband/<name> is where udev puts uverbsN, umadN, issmN and rdma_cm: every one of these
# classes has a devnode callback returning "infiniband/%s" (uverbs_main.c, user_mad.c, ucma.c).
_DEV_SUBDIR = "infiniband"
_HOST_DEV = Path("/dev") / _DEV_SUBDIR
_PCI_ADDRESS = re.compile(r"^[0-9a-f]{4,}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
_HEX_ID = re.compile(r"^(0x)?[0-9a-fA-F]{1,4}$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_LINK_TYPES = {
    "infiniband": "InfiniBand",
    "ib": "InfiniBand",
    "ethernet": "Ethernet",
    "ether": "Ethernet",  # what k8s-rdma-shared-dev-plugin's linkTypes selector takes (netlink)
    "eth": "Ethernet",
    "roce": "Ethernet",
}


# ====================================================================== discovery


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


# ====================================================================== selection and health


@dataclass(frozen=True, slots=True)
class Selector:
    """One group of selectors, as the Mellanox and SR-IOV plugins define them: a device matches
    when, for every non-empty list, one of its values is in the list (OR within a list, AND
    across lists). An empty Selector matches every device.

    Args:
        vendors: PCI vendor IDs (``15b3``, ``0x15b3``).
        device_ids: PCI device IDs (``101d``).
        drivers: PCI driver names (``mlx5_core``).
        if_names: Network interface names of any port.
        link_types: ``InfiniBand`` or ``Ethernet`` (aliases ``ib``, ``ether``, ``roce``...),
            of any port.
        rdma_devices: RDMA device names (``mlx5_0``).
        pci_addresses: PCI function addresses (``0000:3b:00.0``).
    """

    vendors: tuple[str, ...] = ()
    device_ids: tuple[str, ...] = ()
    drivers: tuple[str, ...] = ()
    if_names: tuple[str, ...] = ()
    link_types: tuple[str, ...] = ()
    rdma_devices: tuple[str, ...] = ()
    pci_addresses: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        ids = {"vendors": self.vendors, "device_ids": self.device_ids}
        for name, values in ids.items():
            for value in values:
                if not _HEX_ID.match(value):
                    raise ValueError(f"Selector.{name}: {value!r} is not a 4-digit hex PCI ID")
            object.__setattr__(self, name, tuple(_hex_id(v) or v for v in values))
        links: list[str] = []
        for value in self.link_types:
            canonical = _LINK_TYPES.get(value.lower())
            if canonical is None:
                raise ValueError(
                    f"Selector.link_types: {value!r} is not one of {', '.join(sorted(_LINK_TYPES))}"
                )
            links.append(canonical)
        object.__setattr__(self, "link_types", tuple(links))
        object.__setattr__(self, "pci_addresses", tuple(a.lower() for a in self.pci_addresses))

    def matches(self, device: RdmaDeviceInfo) -> bool:
        """Whether ``device`` passes every non-empty list of this group."""
        checks: list[tuple[tuple[str, ...], Iterable[str | None]]] = [
            (self.vendors, [device.vendor]),
            (self.device_ids, [device.device_id]),
            (self.drivers, [device.driver]),
            (self.if_names, device.netdevs),
            (self.link_types, device.link_layers),
            (self.rdma_devices, [device.name]),
            (self.pci_addresses, [device.pci_address]),
        ]
        return all(not wanted or any(v in wanted for v in values) for wanted, values in checks)


def evaluate_health(
    device: RdmaDeviceInfo,
    *,
    ports: Sequence[int] = (),
    dev_root: Path = Path("/dev"),
    require_rdma_cm: bool = True,
) -> tuple[Health, str]:
    """Decide a device's health; blocking (checks ``/dev`` nodes).

    Healthy means: its uverbs node exists (without it no verbs application can open the
    device), ``rdma_cm`` exists when required, and every considered port is ACTIVE with
    physical state LinkUp. A multi-port device is Healthy only if all considered ports are up,
    because the container gets the whole device and cannot choose a port.

    Args:
        device: The device, as ``scan`` returned it.
        ports: Port numbers to consider; empty means every port.
        dev_root: Where the ``infiniband`` node directory is looked up.
        require_rdma_cm: Treat a missing ``/dev/infiniband/rdma_cm`` as unhealthy.

    Returns:
        The health and, when unhealthy, why.
    """
    problems: list[str] = []
    nodes = Path(dev_root) / _DEV_SUBDIR
    if device.uverbs is None:
        problems.append("no uverbs device in sysfs (is ib_uverbs loaded?)")
    elif not (nodes / device.uverbs).exists():
        problems.append(f"{_HOST_DEV / device.uverbs} is missing")
    if require_rdma_cm and not (nodes / "rdma_cm").exists():
        problems.append(f"{_HOST_DEV / 'rdma_cm'} is missing (is rdma_ucm loaded?)")
    by_number = {port.number: port for port in device.ports}
    wanted = list(ports) or sorted(by_number)
    if not wanted:
        problems.append("no ports")
    for number in wanted:
        port = by_number.get(number)
        if port is None:
            problems.append(f"port {number} does not exist")
        elif not port.active:
            problems.append(f"port {number} is {port.state_name}/{port.phys_state_name}")
    if problems:
        return Health.UNHEALTHY, f"{device.name}: " + "; ".join(problems)
    return Health.HEALTHY, ""


# ====================================================================== the plugin


@dataclass(frozen=True, slots=True)
class RdmaResource:
    """One extended resource made of the RDMA devices some selectors pick.

    Args:
        resource_name: Fully qualified name, e.g. ``rdma/hca_shared``.
        selectors: Selector groups, ORed: a device is part of the resource when it matches any
            group. The default (one empty group) takes every RDMA device.
        mode: ``exclusive``: one device ID per RDMA device; ``shared``: ``shares`` IDs per RDMA
            device (``<dev>::<n>``, like ``rdmaHcaMax`` of the Mellanox shared plugin but per
            device), so that one port failure marks every share.
        shares: IDs per RDMA device in shared mode.
        ports: Ports whose state decides health; empty means all.
        issm: Give containers the ``issmN`` nodes too (needed to run a subnet manager).
        rdma_cm: Give containers ``/dev/infiniband/rdma_cm`` and treat its absence as unhealthy.
        cdi_kind: When set (``vendor.com/class``), devices are handed out as CDI names
            ``<kind>=<rdma device>`` instead of device nodes; the host must have a CDI spec.
        env_prefix: Containers get ``<prefix>_DEVICES`` and ``<prefix>_NETDEVS``.
        exclude: Devices matching any of these groups are left out (claimed by an earlier
            resource of the same config).

    Raises:
        ValueError: on an invalid mode, share count, port, CDI kind or env prefix.
    """

    resource_name: str
    selectors: tuple[Selector, ...] = (Selector(),)
    mode: Mode = "exclusive"
    shares: int = 1
    ports: tuple[int, ...] = ()
    issm: bool = True
    rdma_cm: bool = True
    cdi_kind: str | None = None
    env_prefix: str = "RDMA"
    exclude: tuple[Selector, ...] = field(default=())

    def __post_init__(self) -> None:
        if self.mode not in ("exclusive", "shared"):
            raise ValueError(f"mode must be 'exclusive' or 'shared', got {self.mode!r}")
        if self.shares < 1:
            raise ValueError(f"shares must be >= 1, got {self.shares}")
        if self.mode == "exclusive" and self.shares != 1:
            raise ValueError("shares only applies to mode 'shared'")
        if any(p < 1 for p in self.ports):
            raise ValueError(f"port numbers start at 1, got {self.ports}")
        if self.cdi_kind is not None:
            cdi.validate_kind(self.cdi_kind)
        if not _ENV_NAME.match(self.env_prefix):
            raise ValueError(f"env_prefix must be a valid variable name, got {self.env_prefix!r}")

    def selects(self, device: RdmaDeviceInfo) -> bool:
        """Whether ``device`` belongs to this resource."""
        if any(group.matches(device) for group in self.exclude):
            return False
        return any(group.matches(device) for group in self.selectors)


class RdmaPlugin(DevicePlugin):
    """Serves RDMA devices picked by an ``RdmaResource``.

    Every discovery reads each device's health as it is now (``evaluate_health``: port state
    and device nodes). ``watch`` asks for a rescan at once when ``/dev/infiniband`` changes
    (hot-plug, VFs, driver reload) and otherwise every ``rescan_interval`` seconds, because
    sysfs (port state, devices) sends no inotify events; the SDK diffs the devices and their
    health on every rescan, so faults and recoveries both reach the kubelet. In shared mode
    every share of an RDMA device carries that device's health.

    Args:
        resource: What to serve.
        sysfs_root: Where sysfs is read.
        dev_root: Where device nodes are checked. Containers always get host paths under
            ``/dev/infiniband``: mount the host's ``/dev`` elsewhere only for reading.
        rescan_interval: Seconds between rescans when ``/dev/infiniband`` does not change
            (the ``healthInterval`` key): how soon a port-state change is seen.
        socket_name: Overrides the default socket file name.

    Raises:
        ValueError: on an invalid resource name or interval.
    """

    def __init__(
        self,
        resource: RdmaResource,
        *,
        sysfs_root: Path | str = Path("/sys"),
        dev_root: Path | str = Path("/dev"),
        rescan_interval: float = 5.0,
        socket_name: str | None = None,
    ) -> None:
        super().__init__(resource_name=resource.resource_name, socket_name=socket_name)
        if not rescan_interval > 0:
            raise ValueError(f"rescan_interval must be > 0, got {rescan_interval}")
        self.resource = resource
        self.sysfs_root = Path(sysfs_root)
        self.dev_root = Path(dev_root)
        self.rescan_interval = float(rescan_interval)
        # Why each device is unhealthy, as last logged: the SDK logs each health flip, this
        # logs the reason once per change instead of on every rescan. Only for the log.
        self._logged_reasons: dict[str, str] = {}

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> list[Self]:
        """One plugin of this class per configured resource (``devplugin run`` calls it).

        Args:
            config: The backend's keys (see ``load_config``).

        Raises:
            ConfigError: naming the dotted key and what is wrong with it.
        """
        loaded = load_config(config)
        return [
            cls(
                resource,
                sysfs_root=loaded.sysfs_root,
                dev_root=loaded.dev_root,
                rescan_interval=loaded.rescan_interval,
            )
            for resource in loaded.resources
        ]

    # ------------------------------------------------------------------ discovery and health

    def select(self, devices: Iterable[RdmaDeviceInfo]) -> list[RdmaDeviceInfo]:
        """The devices of this resource among ``devices``."""
        return [d for d in devices if self.resource.selects(d)]

    def health_of(self, info: RdmaDeviceInfo) -> tuple[Health, str]:
        """Health of one device under this resource's rules; blocking."""
        return evaluate_health(
            info,
            ports=self.resource.ports,
            dev_root=self.dev_root,
            require_rdma_cm=self.resource.rdma_cm,
        )

    def _device(self, info: RdmaDeviceInfo, health: Health) -> Device:
        nodes_dir = self.dev_root / _DEV_SUBDIR
        names: list[str] = []
        if info.uverbs is not None:
            names.append(info.uverbs)
        for port in info.ports:
            # umad/issm need ib_umad; a node that is not there would fail container creation.
            for name in (port.umad, port.issm if self.resource.issm else None):
                if name is not None and (nodes_dir / name).exists():
                    names.append(name)
        if self.resource.rdma_cm and (nodes_dir / "rdma_cm").exists():
            names.append("rdma_cm")
        nodes = tuple(DeviceNode(str(_HOST_DEV / name), permissions="rw") for name in names)
        prefix = self.resource.env_prefix
        attributes: dict[str, str | int] = {
            "rdmaDevice": info.name,
            "pciAddress": info.pci_address or "",
            "vendor": info.vendor or "",
            "deviceID": info.device_id or "",
            "driver": info.driver or "",
            "nodeGUID": info.node_guid or "",
            "linkLayer": ",".join(info.link_layers),
            "ports": ",".join(str(port.number) for port in info.ports),
            "netdevs": ",".join(info.netdevs),
            "physfn": info.physfn or "",
            "virtualFunction": bool(info.physfn),
        }
        if info.numa_node is not None:
            attributes["numaNode"] = info.numa_node
        if info.pci_address:
            # The names Kubernetes gives these (k8s.io/dynamic-resource-allocation
            # deviceattribute): a GPU and a NIC under one root can be required together.
            attributes["resource.kubernetes.io/pciBusID"] = info.pci_address
            root = _sysfs.pcie_root(self.sysfs_root, info.pci_address)
            if root is not None:
                attributes["resource.kubernetes.io/pcieRoot"] = root
        # A DRA attribute holds at most 64 bytes; a longer list (many netdevs) is left out.
        attributes = {
            k: v for k, v in attributes.items() if not isinstance(v, str) or len(v.encode()) <= 64
        }
        cdi_devices: tuple[str, ...] = ()
        if self.resource.cdi_kind is not None:
            cdi_devices, nodes = (f"{self.resource.cdi_kind}={info.name}",), ()
        return Device(
            id=info.name,
            health=health,
            numa_nodes=(info.numa_node,) if info.numa_node is not None else (),
            device_nodes=nodes,
            env={f"{prefix}_DEVICES": info.name, f"{prefix}_NETDEVS": ",".join(info.netdevs)},
            cdi_devices=cdi_devices,
            attributes=attributes,
        )

    def _scan(self) -> tuple[list[Device], dict[str, str]]:
        """Scan, select and build (blocking): the devices (one per RDMA device, or ``shares``
        per device, each with its RDMA device's health) and why each unhealthy one is."""
        devices: list[Device] = []
        reasons: dict[str, str] = {}
        for info in self.select(scan(self.sysfs_root)):
            health, reason = self.health_of(info)
            if reason:
                reasons[info.name] = reason
            devices.extend(replicate([self._device(info, health)], self.resource.shares))
        return devices, reasons

    async def discover(self) -> Sequence[Device]:
        """Scan sysfs and return this resource's devices, each with its health as of now."""
        devices, reasons = await anyio.to_thread.run_sync(self._scan)
        for name, reason in reasons.items():
            if self._logged_reasons.get(name) != reason:
                log.info("%s", reason, extra={"resource": self.resource_name, "device": name})
        self._logged_reasons = reasons
        return devices

    def watch(self) -> AsyncIterator[HealthEvent | RescanEvent]:
        """Rescans: at once when ``/dev/infiniband`` changes, else every ``rescan_interval``."""
        # udev creates and removes /dev/infiniband nodes (inotify sees them within a
        # millisecond); sysfs sends no inotify events, so port state is read on every rescan.
        return fswatch.watch_or_rescan([self.dev_root / _DEV_SUBDIR], self.rescan_interval)

    # ------------------------------------------------------------------ allocation

    async def allocate(self, devices: Sequence[Device]) -> Allocation:
        """Merge the devices' nodes and name every RDMA device and netdev in the env.

        ``<prefix>_DEVICES`` and ``<prefix>_NETDEVS`` list all allocated devices, comma
        separated, each once (several shares of one device name it once).
        """
        merged = Allocation.merge(devices)
        prefix = self.resource.env_prefix
        names = dict.fromkeys(str(d.attributes.get("rdmaDevice", d.id)) for d in devices)
        netdevs = dict.fromkeys(
            n for d in devices for n in str(d.attributes.get("netdevs", "")).split(",") if n
        )
        env = dict(merged.env)
        env[f"{prefix}_DEVICES"] = ",".join(names)
        env[f"{prefix}_NETDEVS"] = ",".join(netdevs)
        return replace(merged, env=env)

    async def preferred_allocation(
        self, available: Sequence[Device], must_include: Sequence[Device], size: int
    ) -> Sequence[str]:
        """Spread shares over RDMA devices and keep to the NUMA nodes already chosen.

        Greedy: after ``must_include``, repeatedly take the device whose RDMA device is least
        used in the answer so far, then one on a NUMA node already in the answer, then the one
        whose RDMA device has the most free shares, then by ID.
        """
        chosen = list(must_include)
        chosen_ids = {d.id for d in chosen}
        free: dict[str, int] = {}
        for device in available:
            key = _hca(device)
            free[key] = free.get(key, 0) + 1
        candidates = [d for d in available if d.id not in chosen_ids]
        while len(chosen) < size and candidates:
            used: dict[str, int] = {}
            for device in chosen:
                used[_hca(device)] = used.get(_hca(device), 0) + 1
            numa = {n for d in chosen for n in d.numa_nodes}
            ranked: list[tuple[int, int, int, str, Device]] = []
            for device in candidates:
                far = 1 if numa and not numa & set(device.numa_nodes) else 0
                hca = _hca(device)
                ranked.append((used.get(hca, 0), far, -free[hca], device.id, device))
            best = min(ranked, key=lambda r: r[:4])[4]
            chosen.append(best)
            candidates.remove(best)
        return [d.id for d in chosen]


def _hca(device: Device) -> str:
    return device.parent or device.id


# ====================================================================== configuration


@dataclass(frozen=True, slots=True)
class RdmaConfig:
    """A validated RDMA configuration: resources plus the settings they share.

    Args:
        resources: One per served resource, in config order.
        sysfs_root: Where sysfs is read (``sysfsRoot``).
        dev_root: Where device nodes are checked (``devRoot``).
        rescan_interval: Seconds between rescans, which re-read port state
            (``healthInterval``).
    """

    resources: tuple[RdmaResource, ...]
    sysfs_root: Path = Path("/sys")
    dev_root: Path = Path("/dev")
    rescan_interval: float = 5.0


_MODES: tuple[Mode, ...] = ("exclusive", "shared")
# YAML key -> Selector field; the keys of the Mellanox and SR-IOV plugins' selectors.
_SELECTOR_KEYS = {
    "vendors": "vendors",
    "deviceIDs": "device_ids",
    "drivers": "drivers",
    "ifNames": "if_names",
    "linkTypes": "link_types",
    "rdmaDevices": "rdma_devices",
    "pciAddresses": "pci_addresses",
}


def load_config(config: Mapping[str, Any]) -> RdmaConfig:
    """Validate the backend's keys (see ``examples/rdma/config.yaml``).

    Each device goes to the first resource, in config order, whose selectors match it, so an
    HCA is never served twice by accident.

    Args:
        config: The mapping, with ``resources`` and optional ``sysfsRoot``, ``devRoot``,
            ``healthInterval``.

    Returns:
        The validated configuration.

    Raises:
        ConfigError: naming the dotted key and what is wrong with it.
    """
    top = ConfigReader(config)
    top.known("resources", "sysfsRoot", "devRoot", "healthInterval")
    sysfs_root = top.path("sysfsRoot", "/sys")
    dev_root = top.path("devRoot", "/dev")
    interval = top.interval("healthInterval", 5.0)
    resources: list[RdmaResource] = []
    claimed: list[Selector] = []
    for reader in top.sections("resources", required=True):
        resource = _resource(reader, tuple(claimed))
        if any(r.resource_name == resource.resource_name for r in resources):
            raise ConfigError(
                reader.key("resourceName"), f"duplicate {shown(resource.resource_name)}"
            )
        claimed.extend(resource.selectors)
        resources.append(resource)
    return RdmaConfig(
        resources=tuple(resources),
        sysfs_root=sysfs_root,
        dev_root=dev_root,
        rescan_interval=interval,
    )


def from_config(config: Mapping[str, Any]) -> list[DevicePlugin]:
    """One ``RdmaPlugin`` per configured resource (the backend contract of ``devplugin run``).

    Args:
        config: See ``load_config``.

    Raises:
        ConfigError: naming the dotted key and what is wrong with it.
    """
    return list(RdmaPlugin.from_config(config))


def _resource(reader: ConfigReader, exclude: tuple[Selector, ...]) -> RdmaResource:
    reader.known(
        "resourceName",
        "mode",
        "shares",
        "selectors",
        "ports",
        "issm",
        "rdmaCm",
        "cdiKind",
        "envPrefix",
    )
    name = reader.resource_name("resourceName")
    mode = reader.choice("mode", _MODES, "exclusive")
    if mode == "shared":
        if not reader.has("shares"):
            raise ConfigError(reader.key("shares"), "is required in mode 'shared'")
        shares = reader.integer("shares", 1, minimum=1)
    elif reader.has("shares"):
        raise ConfigError(reader.key("shares"), "only applies to mode 'shared'")
    else:
        shares = 1
    cdi_kind = reader.optional_string("cdiKind")
    if cdi_kind is not None:
        try:
            cdi.validate_kind(cdi_kind)
        except ValueError as exc:
            raise ConfigError(reader.key("cdiKind"), str(exc)) from None
    prefix = reader.string("envPrefix", "RDMA")
    if not _ENV_NAME.match(prefix):
        raise ConfigError(
            reader.key("envPrefix"), f"must be a valid variable name, got {shown(prefix)}"
        )
    return RdmaResource(
        resource_name=name,
        selectors=_selectors(reader),
        mode="shared" if mode == "shared" else "exclusive",
        shares=shares,
        ports=tuple(sorted(reader.integers("ports", frozenset(), minimum=1))),
        issm=reader.boolean("issm", True),
        rdma_cm=reader.boolean("rdmaCm", True),
        cdi_kind=cdi_kind,
        env_prefix=prefix,
        exclude=exclude,
    )


def _selectors(reader: ConfigReader) -> tuple[Selector, ...]:
    """``selectors``: absent (every device), one group, or a non-empty list of groups."""
    raw = reader.data.get("selectors")
    if raw is None:
        return (Selector(),)
    if isinstance(raw, list):
        groups = reader.sections("selectors", required=True)
    else:
        groups = [reader.section("selectors")]
    return tuple(_selector(group) for group in groups)


def _selector(group: ConfigReader) -> Selector:
    """One selector group, every value checked here so that ``Selector`` never refuses it."""
    group.known(*_SELECTOR_KEYS)
    values = {key: group.strings(key) for key in _SELECTOR_KEYS}
    for key in ("vendors", "deviceIDs"):
        for i, value in enumerate(values[key]):
            if not _HEX_ID.match(value):
                raise ConfigError(
                    f"{group.key(key)}[{i}]", f"must be a 4-digit hex PCI ID, got {shown(value)}"
                )
    for i, value in enumerate(values["linkTypes"]):
        if value.lower() not in _LINK_TYPES:
            raise ConfigError(
                f"{group.key('linkTypes')}[{i}]",
                f"must be one of {', '.join(sorted(_LINK_TYPES))}, got {shown(value)}",
            )
    return Selector(**{attr: values[key] for key, attr in _SELECTOR_KEYS.items()})
