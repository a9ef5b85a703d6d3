"""``RdmaPlugin``: the hooks of one RDMA resource: discovery with health read at every scan, a
watch on /dev/infiniband plus periodic rescans, and an allocation that names the devices, their
nodes and netdevs (or their CDI names).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import anyio
from typing_extensions import Self

from devplugin_sdk import fswatch
from devplugin_sdk.backends import _sysfs
from devplugin_sdk.backends.rdma.config import load_config
from devplugin_sdk.backends.rdma.discovery import _DEV_SUBDIR, _HOST_DEV, RdmaDeviceInfo, scan
from devplugin_sdk.backends.rdma.health import evaluate_health
from devplugin_sdk.backends.rdma.selection import RdmaResource
from devplugin_sdk.plugin import DevicePlugin
from devplugin_sdk.types import (
    Allocation,
    Device,
    DeviceNode,
    DeviceStatus,
    Health,
    HealthEvent,
    NetworkData,
    RescanEvent,
    replicate,
)

__all__ = ["RdmaPlugin"]

# The backend's logger, whichever of its modules logs (the name is in every JSON log line).
log = logging.getLogger("devplugin_sdk.backends.rdma")


class RdmaPlugin(DevicePlugin):
    """Serves RDMA devices picked by an ``RdmaResource``.

    Every discovery reads each device's health as it is now (``evaluate_health``: port state
    and device nodes). ``watch`` asks for a rescan at once when ``/dev/infiniband`` changes
    (hot-plug, VFs, driver reload) and otherwise every ``watch_interval`` seconds, because
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

    rescan_interval = 0.0  # the SDK's periodic rescan: watch() rescans every watch_interval

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
        self.watch_interval = float(rescan_interval)
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
        attributes.update(_sysfs.numa_attribute(info.numa_node))
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
        """Rescans: at once when ``/dev/infiniband`` changes, else every ``watch_interval``."""
        # udev creates and removes /dev/infiniband nodes (inotify sees them within a
        # millisecond); sysfs sends no inotify events, so port state is read on every rescan.
        return fswatch.watch_or_rescan([self.dev_root / _DEV_SUBDIR], self.watch_interval)

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

    async def device_status(self, device: Device) -> DeviceStatus | None:
        """The device's first netdev and its hardware address, for the DRA claim's status
        (``networkData``) and its ``metadata.json``: the interface stays in the host's network
        namespace (RDMA shares it), so this is the host's name for it."""
        netdevs = [n for n in str(device.attributes.get("netdevs", "")).split(",") if n]
        if not netdevs:
            return None
        name = netdevs[0]
        address = await anyio.to_thread.run_sync(
            _sysfs.read_attr, self.sysfs_root / "class" / "net" / name / "address"
        )
        return DeviceStatus(
            network_data=NetworkData(interface_name=name, hardware_address=address or "")
        )

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
