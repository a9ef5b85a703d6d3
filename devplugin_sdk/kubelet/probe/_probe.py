"""``probe`` and ``watch``: what the kubelet would get from a plugin (its options, first list and
an allocation made the kubelet's way), and the device changes it would see."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from devplugin_sdk.kubelet.probe._client import PluginClient
from devplugin_sdk.kubelet.probe._errors import ProtocolViolation
from devplugin_sdk.kubelet.probe._lists import (
    DeviceChange,
    DeviceList,
    PluginOptions,
    allocation_json,
    diff_devices,
)
from devplugin_sdk.types import Allocation

__all__ = ["AllocationReport", "ProbeReport", "allocate_like_kubelet", "probe", "watch"]


@dataclass(frozen=True, slots=True)
class AllocationReport:
    """An allocation made the kubelet's way, and what the plugin answered.

    Attributes:
        requested: A device count, or the explicit IDs asked for.
        preferred: GetPreferredAllocation's answer (None when not advertised or not called;
            an empty tuple when the plugin answered with no container response).
        device_ids: The IDs sent in Allocate.
        allocation: The container response.
        containers: How many container responses the plugin sent (the kubelet sends one
            request and reads only the first response).
    """

    requested: int | tuple[str, ...]
    preferred: tuple[str, ...] | None
    device_ids: tuple[str, ...]
    allocation: Allocation
    containers: int = 1

    def to_json(self) -> dict[str, Any]:
        return {
            "requested": self.requested
            if isinstance(self.requested, int)
            else list(self.requested),
            "preferred": None if self.preferred is None else list(self.preferred),
            "device_ids": list(self.device_ids),
            "container_responses": self.containers,
            "response": allocation_json(self.allocation),
        }


@dataclass(frozen=True, slots=True)
class ProbeReport:
    """What the kubelet gets from a plugin: its options, first device list and an allocation.

    Attributes:
        socket: The socket probed.
        connect_seconds: Time to a READY connection.
        options: The plugin's options.
        options_seconds: Time GetDevicePluginOptions took.
        devices: The first ListAndWatch message.
        list_seconds: Time from opening the stream to its first message.
        allocation: The allocation, when one was asked for.
    """

    socket: str
    connect_seconds: float
    options: PluginOptions
    options_seconds: float
    devices: DeviceList
    list_seconds: float
    allocation: AllocationReport | None = None
    notes: tuple[str, ...] = field(default=())

    def to_json(self) -> dict[str, Any]:
        healthy = len(self.devices.healthy)
        return {
            "socket": self.socket,
            "connect_ms": round(self.connect_seconds * 1000, 3),
            "options": self.options.to_json(),
            "options_ms": round(self.options_seconds * 1000, 3),
            "list_ms": round(self.list_seconds * 1000, 3),
            "list_bytes": self.devices.size,
            "capacity": len(self.devices.by_id()),
            "allocatable": healthy,
            "devices": [d.to_json() for d in self.devices.devices],
            "allocation": None if self.allocation is None else self.allocation.to_json(),
            "notes": list(self.notes),
        }


async def allocate_like_kubelet(
    client: PluginClient,
    options: PluginOptions,
    devices: DeviceList,
    request: int | Sequence[str],
) -> AllocationReport:
    """Allocate for one container as the kubelet would, or with explicit IDs.

    For a count: candidates are the healthy devices; GetPreferredAllocation is asked when
    advertised, its valid IDs are taken first and the rest filled in list order (the kubelet
    fills in random order). Explicit IDs go to Allocate as they are.

    Raises:
        ProtocolViolation: fewer healthy devices than requested (the kubelet's admission error).
        PluginRpcError: an RPC failed.
    """
    preferred: tuple[str, ...] | None = None
    if isinstance(request, int):
        if request < 1:
            raise ValueError(f"allocation size must be >= 1, got {request}")
        available = list(dict.fromkeys(d.id for d in devices.healthy))
        if len(available) < request:
            # The kubelet's admission message for this case.
            raise ProtocolViolation(
                "requested number of devices unavailable. "
                f"Requested: {request}, Available: {len(available)}"
            )
        chosen: list[str] = []
        if options.preferred_allocation:
            answer = await client.preferred_allocation(available, [], request)
            preferred = () if answer is None else answer
            # Only IDs among the candidates count; extra IDs are dropped.
            candidates = set(available)
            chosen = [i for i in dict.fromkeys(preferred) if i in candidates][:request]
        for device_id in available:
            if len(chosen) >= request:
                break
            if device_id not in chosen:
                chosen.append(device_id)
        ids = tuple(chosen)
        requested: int | tuple[str, ...] = request
    else:
        ids = tuple(request)
        requested = ids
    responses = await client.allocate(ids)
    if not responses:
        # The kubelet's admission error for an empty answer.
        raise ProtocolViolation("Allocate answered no container response")
    return AllocationReport(requested, preferred, ids, responses[0], len(responses))


async def probe(
    client: PluginClient, *, allocate: int | Sequence[str] | None = None
) -> ProbeReport:
    """Ask a connected plugin what the kubelet would ask: options, first list, an allocation.

    Args:
        client: A connected client.
        allocate: A device count, explicit device IDs, or None for no allocation.

    Raises:
        ProbeError: the plugin failed one of the calls, or is not a device plugin.
    """
    started = time.perf_counter()
    options = await client.options()
    options_seconds = time.perf_counter() - started
    stream = client.list_and_watch()
    try:
        try:
            devices = await stream.next(timeout=client.rpc_timeout)
        except TimeoutError:
            raise ProtocolViolation(
                f"no ListAndWatch message within {client.rpc_timeout:g} s; the kubelet sees no "
                "devices (capacity 0) until the plugin sends its first list"
            ) from None
        list_seconds = time.perf_counter() - stream.opened_at
    finally:
        stream.cancel()
    notes: list[str] = []
    if options.pre_start_required:
        notes.append("PreStartContainer is required (the kubelet calls it before every start)")
    allocation = None
    if allocate is not None:
        allocation = await allocate_like_kubelet(client, options, devices, allocate)
        if options.pre_start_required:
            notes.append("probe does not call PreStartContainer")
    return ProbeReport(
        socket=str(client.path),
        connect_seconds=client.connect_seconds,
        options=options,
        options_seconds=options_seconds,
        devices=devices,
        list_seconds=list_seconds,
        allocation=allocation,
        notes=tuple(notes),
    )


async def watch(
    client: PluginClient, since: DeviceList | None = None
) -> AsyncIterator[tuple[DeviceList, list[DeviceChange]]]:
    """Follow ListAndWatch, yielding each message that changes the device set.

    Args:
        client: A connected client.
        since: The list already shown; the stream's first message is yielded only if it differs.

    Yields:
        The new list and its changes from the previous one.

    Raises:
        ProbeError: the stream ended (the kubelet would drop the plugin) or failed.
    """
    stream = client.list_and_watch()
    previous = since
    try:
        async for devices in stream:
            changes = [] if previous is None else diff_devices(previous, devices)
            if previous is None or changes:
                yield devices, changes
            previous = devices
    finally:
        stream.cancel()
