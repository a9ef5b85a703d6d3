"""The only bridge between the SDK's dataclasses and the generated protobuf messages.

ListAndWatch messages are built from per-device encoded entries: a ``ListAndWatchResponse`` is
one repeated field, so its encoding is the concatenation of each device's one-entry encoding.
Caching entries makes a health flip at 50k devices cost one re-encode plus a join. Allocate
answers are built the same way, from one encoded entry per container.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from devplugin_sdk.api import constants
from devplugin_sdk.api.deviceplugin.v1beta1 import deviceplugin_pb2 as pb
from devplugin_sdk.types import Allocation, Device, DeviceNode, Health, Mount

__all__ = [
    "ListedDevice",
    "PluginOptions",
    "allocate_entry",
    "allocate_request",
    "allocation_from_response",
    "allocation_to_response",
    "decode_list_and_watch",
    "decode_listed_devices",
    "first_preferred",
    "list_and_watch_entry",
    "listed_devices",
    "options",
    "plugin_options",
    "pre_start_request",
    "preferred_request",
    "preferred_response",
]


def list_and_watch_entry(device: Device, health: Health) -> bytes:
    """Encoding of a ListAndWatchResponse holding only ``device`` with ``health``."""
    message = pb.ListAndWatchResponse()
    entry = message.devices.add(ID=device.id, health=health.value)
    if device.numa_nodes:
        # Topology only when known: reporting it opts the resource into NUMA alignment.
        entry.topology.nodes.extend(pb.NUMANode(ID=n) for n in device.numa_nodes)
    return message.SerializeToString()


def decode_list_and_watch(payload: bytes) -> pb.ListAndWatchResponse:
    """Parse an encoded ListAndWatchResponse."""
    return pb.ListAndWatchResponse.FromString(payload)


@dataclass(frozen=True, slots=True)
class ListedDevice:
    """One device of a ListAndWatch message as the kubelet reads it (health not validated)."""

    id: str
    health: str
    numa_nodes: tuple[int, ...] = ()

    @property
    def healthy(self) -> bool:
        # The kubelet counts a device as healthy only for the exact string "Healthy".
        return self.health == constants.HEALTHY

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "health": self.health, "numa_nodes": list(self.numa_nodes)}


def listed_devices(message: pb.ListAndWatchResponse) -> tuple[ListedDevice, ...]:
    """The devices of a ListAndWatch message, in order."""
    return tuple(
        ListedDevice(d.ID, d.health, tuple(n.ID for n in d.topology.nodes)) for d in message.devices
    )


def options(*, pre_start_required: bool, preferred_allocation: bool) -> pb.DevicePluginOptions:
    """The plugin's DevicePluginOptions."""
    return pb.DevicePluginOptions(
        pre_start_required=pre_start_required,
        get_preferred_allocation_available=preferred_allocation,
    )


def allocation_to_response(allocation: Allocation) -> pb.ContainerAllocateResponse:
    """One ContainerAllocateResponse from an ``Allocation``."""
    return pb.ContainerAllocateResponse(
        envs=dict(allocation.env),
        mounts=[
            pb.Mount(container_path=m.container_path, host_path=m.host_path, read_only=m.read_only)
            for m in allocation.mounts
        ],
        devices=[
            pb.DeviceSpec(
                container_path=n.container_path, host_path=n.host_path, permissions=n.permissions
            )
            for n in allocation.device_nodes
        ],
        annotations=dict(allocation.annotations),
        cdi_devices=[pb.CDIDevice(name=name) for name in allocation.cdi_devices],
    )


def allocate_entry(allocation: Allocation) -> bytes:
    """Encoding of an AllocateResponse holding only ``allocation``'s container response.

    An AllocateResponse is one repeated field, so the answer to several containers is the
    concatenation of their entries, in request order.
    """
    return pb.AllocateResponse(
        container_responses=[allocation_to_response(allocation)]
    ).SerializeToString()


def allocation_from_response(response: pb.ContainerAllocateResponse) -> Allocation:
    """An ``Allocation`` from one ContainerAllocateResponse (what the kubelet records)."""
    return Allocation(
        device_nodes=tuple(
            DeviceNode(
                host_path=d.host_path,
                container_path=d.container_path,
                permissions=d.permissions or "rw",
            )
            for d in response.devices
        ),
        mounts=tuple(
            Mount(host_path=m.host_path, container_path=m.container_path, read_only=m.read_only)
            for m in response.mounts
        ),
        env=dict(response.envs),
        annotations=dict(response.annotations),
        cdi_devices=tuple(c.name for c in response.cdi_devices),
    )


def preferred_response(choices: Iterable[Sequence[str]]) -> pb.PreferredAllocationResponse:
    """A PreferredAllocationResponse with one container response per choice."""
    return pb.PreferredAllocationResponse(
        container_responses=[
            pb.ContainerPreferredAllocationResponse(deviceIDs=list(ids)) for ids in choices
        ]
    )


# ------------------------------------------------------------------ the kubelet's side of the calls


@dataclass(frozen=True, slots=True)
class PluginOptions:
    """A plugin's DevicePluginOptions, which the kubelet reads once per registration."""

    pre_start_required: bool
    preferred_allocation: bool

    def to_json(self) -> dict[str, bool]:
        return {
            "pre_start_required": self.pre_start_required,
            "get_preferred_allocation_available": self.preferred_allocation,
        }


def plugin_options(message: pb.DevicePluginOptions) -> PluginOptions:
    """``PluginOptions`` from a GetDevicePluginOptions answer."""
    return PluginOptions(
        pre_start_required=message.pre_start_required,
        preferred_allocation=message.get_preferred_allocation_available,
    )


def decode_listed_devices(payload: bytes) -> tuple[ListedDevice, ...]:
    """The devices of an encoded ListAndWatchResponse, in order.

    Raises:
        google.protobuf.message.DecodeError: ``payload`` is not a ListAndWatchResponse.
    """
    return listed_devices(decode_list_and_watch(payload))


def preferred_request(
    available: Iterable[str], must_include: Iterable[str], size: int
) -> pb.PreferredAllocationRequest:
    """A GetPreferredAllocation request for one container, as the kubelet sends it."""
    return pb.PreferredAllocationRequest(
        container_requests=[
            pb.ContainerPreferredAllocationRequest(
                available_deviceIDs=list(available),
                must_include_deviceIDs=list(must_include),
                allocation_size=size,
            )
        ]
    )


def first_preferred(response: pb.PreferredAllocationResponse) -> tuple[str, ...] | None:
    """The IDs of the first container response (the only one the kubelet reads), or None."""
    if not response.container_responses:
        return None
    return tuple(response.container_responses[0].deviceIDs)


def allocate_request(containers: Iterable[Iterable[str]]) -> pb.AllocateRequest:
    """An AllocateRequest with one container request per ID list."""
    return pb.AllocateRequest(
        container_requests=[pb.ContainerAllocateRequest(devices_ids=list(c)) for c in containers]
    )


def pre_start_request(device_ids: Iterable[str]) -> pb.PreStartContainerRequest:
    """A PreStartContainer request for one container's devices."""
    return pb.PreStartContainerRequest(devices_ids=list(device_ids))
