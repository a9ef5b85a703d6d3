"""The plain data a plugin author works with: devices, what a container gets, health.

Everything here is a frozen dataclass or an enum; hooks receive and return these and never
see protobuf (only ``_convert`` and the gRPC service and registration modules do; an
import-linter contract checks it).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace

__all__ = [
    "Allocation",
    "Device",
    "DeviceNode",
    "Health",
    "HealthEvent",
    "HealthReport",
    "Mount",
    "RescanEvent",
    "replicate",
]


class Health(str, enum.Enum):
    """A device's health as the kubelet sees it.

    The kubelet compares with the exact string ``"Healthy"``; every other value is unhealthy.
    """

    HEALTHY = "Healthy"
    UNHEALTHY = "Unhealthy"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, slots=True)
class DeviceNode:
    """A device node to expose in the container (a cgroup device rule plus the node itself).

    Args:
        host_path: Path of the node on the host, e.g. ``/dev/nvidia0``.
        container_path: Path inside the container; defaults to ``host_path``.
        permissions: cgroup access string made of ``r``, ``w`` and ``m``.
    """

    host_path: str
    container_path: str = ""
    permissions: str = "rw"

    def __post_init__(self) -> None:
        if not self.host_path:
            raise ValueError("DeviceNode.host_path must not be empty")
        if not self.permissions or set(self.permissions) - set("rwm"):
            raise ValueError(
                f"DeviceNode.permissions must be made of 'r', 'w' and 'm', got {self.permissions!r}"
            )
        if not self.container_path:
            object.__setattr__(self, "container_path", self.host_path)


@dataclass(frozen=True, slots=True)
class Mount:
    """A bind mount from the host into the container.

    Args:
        host_path: Source path on the host.
        container_path: Target path in the container; defaults to ``host_path``.
        read_only: Mount read-only.
    """

    host_path: str
    container_path: str = ""
    read_only: bool = False

    def __post_init__(self) -> None:
        if not self.host_path:
            raise ValueError("Mount.host_path must not be empty")
        if not self.container_path:
            object.__setattr__(self, "container_path", self.host_path)


@dataclass(frozen=True, slots=True)
class Device:
    """One schedulable unit of a resource, with everything a container needs to use it.

    Args:
        id: The ID the kubelet schedules; unique within the resource, stable across restarts,
            printable, at most 63 characters by convention.
        health: Health as discovered: the device's first health report. A later report
            (an event, a poll, a rescan that sees otherwise) replaces it (see ``DevicePlugin``).
        numa_nodes: NUMA nodes the device is attached to; empty when unknown. Reporting
            topology for any device opts the resource into Topology Manager alignment.
        device_nodes: Device nodes the container gets when this device is allocated.
        mounts: Bind mounts the container gets.
        env: Environment variables the container gets; merged over all allocated devices.
        annotations: Container annotations (passed to the runtime).
        cdi_devices: Fully qualified CDI device names (``vendor.com/class=name``).
        parent: ID of the physical device this one is a share or partition of. A health
            event for the parent applies to this device too.
        attributes: Free-form facts for the backend's own use (model, PCI address, ...);
            never sent to the kubelet.
    """

    id: str
    health: Health = Health.HEALTHY
    numa_nodes: tuple[int, ...] = ()
    device_nodes: tuple[DeviceNode, ...] = ()
    mounts: tuple[Mount, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)
    cdi_devices: tuple[str, ...] = ()
    parent: str | None = None
    attributes: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.id:
            raise ValueError("Device.id must not be empty")
        if not self.id.isprintable():
            raise ValueError(f"Device.id must be printable, got {self.id!r}")
        # Accept "Healthy"/"Unhealthy" strings but nothing the kubelet would misread.
        object.__setattr__(self, "health", Health(self.health))
        for name in ("numa_nodes", "device_nodes", "mounts", "cdi_devices"):
            value = getattr(self, name)
            if not isinstance(value, tuple):
                object.__setattr__(self, name, tuple(value))
        if any(n < 0 for n in self.numa_nodes):
            raise ValueError(
                f"Device {self.id!r}: NUMA node IDs must be >= 0, got {self.numa_nodes}"
            )

    @property
    def healthy(self) -> bool:
        """Whether the device is healthy as discovered."""
        return self.health is Health.HEALTHY


def replicate(devices: Iterable[Device], replicas: int) -> list[Device]:
    """Share each device between ``replicas`` containers (time-slicing).

    Each device becomes ``replicas`` devices with IDs ``<id>::<n>`` (n from 0) carrying the same
    nodes, mounts and env, with ``parent`` set to the original ID so that one health event marks
    every replica. ``replicas == 1`` returns the devices unchanged.

    Raises:
        ValueError: if ``replicas`` is less than 1.
    """
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    out: list[Device] = []
    for device in devices:
        if replicas == 1:
            out.append(device)
            continue
        out.extend(
            replace(device, id=f"{device.id}::{n}", parent=device.parent or device.id)
            for n in range(replicas)
        )
    return out


@dataclass(frozen=True, slots=True)
class Allocation:
    """What one container gets for the devices allocated to it (one Allocate container response).

    Args:
        device_nodes: Device nodes; deduplicated by container path, first wins.
        mounts: Bind mounts; deduplicated by container path, first wins.
        env: Environment variables.
        annotations: Container annotations.
        cdi_devices: Fully qualified CDI device names; deduplicated.
    """

    device_nodes: tuple[DeviceNode, ...] = ()
    mounts: tuple[Mount, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)
    cdi_devices: tuple[str, ...] = ()

    @classmethod
    def merge(cls, devices: Sequence[Device]) -> Allocation:
        """Merge the declared nodes, mounts, env, annotations and CDI names of ``devices``.

        Order is kept; a container path or CDI name seen twice is kept once (the first), as
        the kubelet would do. Env and annotation values of later devices win.
        """
        nodes: dict[str, DeviceNode] = {}
        mounts: dict[str, Mount] = {}
        env: dict[str, str] = {}
        annotations: dict[str, str] = {}
        cdi: dict[str, None] = {}
        for device in devices:
            for node in device.device_nodes:
                nodes.setdefault(node.container_path, node)
            for mount in device.mounts:
                mounts.setdefault(mount.container_path, mount)
            env.update(device.env)
            annotations.update(device.annotations)
            cdi.update(dict.fromkeys(device.cdi_devices))
        return cls(
            device_nodes=tuple(nodes.values()),
            mounts=tuple(mounts.values()),
            env=env,
            annotations=annotations,
            cdi_devices=tuple(cdi),
        )


@dataclass(frozen=True, slots=True)
class HealthEvent:
    """A pushed health change, yielded by ``DevicePlugin.watch``.

    Args:
        device_id: The device's ID, or the ID of a parent: the event then applies to every
            device whose ``parent`` is this ID as well.
        health: The new health.
        reason: Why, for the log (e.g. ``"Xid 79"``).
    """

    device_id: str
    health: Health
    reason: str = ""


@dataclass(frozen=True, slots=True)
class RescanEvent:
    """Ask the SDK to call ``discover()`` again (devices appeared, disappeared or changed).

    Args:
        reason: Why, for the log.
    """

    reason: str = ""


@dataclass(frozen=True, eq=False)
class HealthReport(Mapping[str, Health]):
    """A ``check_health`` answer that says why: health by device or parent ID, with reasons.

    It is the ``Mapping[str, Health]`` that ``check_health`` returns (a plain ``dict`` works as
    well), so callers read it as one. The SDK takes an ID's reason into the log line and the
    observer's ``health_changed`` call when the report changes that device's health; an ID
    without a reason is reported as ``"polled"``. Put the stable cause first and details after
    a colon (``"row remapping pending: 2 rows"``): metrics label changes by the cause.

    Args:
        health: Health by device ID or parent ID.
        reasons: Why, by the same IDs (``"Xid 79 (GPU has fallen off the bus)"``).
    """

    health: Mapping[str, Health]
    reasons: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "health", {k: Health(v) for k, v in self.health.items()})
        object.__setattr__(self, "reasons", dict(self.reasons))

    def __getitem__(self, device_id: str) -> Health:
        return self.health[device_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self.health)

    def __len__(self) -> int:
        return len(self.health)
