"""What a plugin lists and answers, as the probe shows it: ListAndWatch messages, the changes
between two of them, and a container response as JSON."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from devplugin_sdk._wire import convert
from devplugin_sdk.types import Allocation

__all__ = [
    "DeviceChange",
    "DeviceList",
    "ListedDevice",
    "PluginOptions",
    "allocation_json",
    "diff_devices",
]

# The plugin's DevicePluginOptions, which the kubelet reads once per registration.
PluginOptions = convert.PluginOptions

# One device of a ListAndWatch message, as sent; shared with FakeKubelet.
ListedDevice = convert.ListedDevice


@dataclass(frozen=True, slots=True)
class DeviceList:
    """One ListAndWatch message: the complete device set (each message replaces the last).

    Attributes:
        devices: The devices in message order, duplicates kept.
        size: Encoded size of the message in bytes.
        received_at: ``time.time()`` when it arrived.
    """

    devices: tuple[ListedDevice, ...]
    size: int
    received_at: float

    @property
    def healthy(self) -> list[ListedDevice]:
        return [d for d in self.devices if d.healthy]

    def by_id(self) -> dict[str, ListedDevice]:
        # Duplicate IDs: the kubelet keeps the last entry in its device map.
        return {d.id: d for d in self.devices}


@dataclass(frozen=True, slots=True)
class DeviceChange:
    """How one device differs between two ListAndWatch messages."""

    id: str
    before: ListedDevice | None
    after: ListedDevice | None

    def describe(self) -> str:
        if self.before is None and self.after is not None:
            return f"+{self.id} {self.after.health}{_numa_suffix(self.after)}"
        if self.after is None:
            return f"-{self.id}"
        assert self.before is not None
        parts = []
        if self.before.health != self.after.health:
            parts.append(f"{self.before.health} -> {self.after.health}")
        if self.before.numa_nodes != self.after.numa_nodes:
            parts.append(
                f"NUMA {_numa_text(self.before.numa_nodes)} -> {_numa_text(self.after.numa_nodes)}"
            )
        return f"{self.id} {', '.join(parts)}"

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "before": None if self.before is None else self.before.to_json(),
            "after": None if self.after is None else self.after.to_json(),
        }


def _numa_text(nodes: tuple[int, ...]) -> str:
    return ",".join(map(str, nodes)) if nodes else "-"


def _numa_suffix(device: ListedDevice) -> str:
    return f" NUMA {_numa_text(device.numa_nodes)}" if device.numa_nodes else ""


def diff_devices(before: DeviceList, after: DeviceList) -> list[DeviceChange]:
    """The devices added, removed or changed (health or NUMA) from ``before`` to ``after``."""
    old, new = before.by_id(), after.by_id()
    changes = []
    for device_id in [*old, *(i for i in new if i not in old)]:
        a, b = old.get(device_id), new.get(device_id)
        if a != b:
            changes.append(DeviceChange(device_id, a, b))
    return changes


def allocation_json(allocation: Allocation) -> dict[str, Any]:
    """A ContainerAllocateResponse as plain JSON, with the protocol's field names."""
    return {
        "devices": [
            {
                "container_path": n.container_path,
                "host_path": n.host_path,
                "permissions": n.permissions,
            }
            for n in allocation.device_nodes
        ],
        "mounts": [
            {"container_path": m.container_path, "host_path": m.host_path, "read_only": m.read_only}
            for m in allocation.mounts
        ],
        "envs": dict(allocation.env),
        "annotations": dict(allocation.annotations),
        "cdi_devices": list(allocation.cdi_devices),
    }
