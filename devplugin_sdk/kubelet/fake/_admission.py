"""Admission: how the kubelet's device manager gives a container devices, and the allocations
it keeps (what its checkpoint records as ``PodDeviceEntries``).

The kubelet checks the resource before it asks the plugin anything, picks candidates in Go's
random set order, asks GetPreferredAllocation when offered and keeps only the valid part of the
answer, calls Allocate with one container request, then PreStartContainer before each start when
the plugin requires it (protocol reference, section 5). The plugin is never told of a release.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable

import grpc

from devplugin_sdk.api import constants
from devplugin_sdk.kubelet.fake._device_manager import DeviceManager, Endpoint, call, rpc_error
from devplugin_sdk.kubelet.fake._records import (
    AdmissionError,
    ContainerAllocation,
    ContainerStartError,
)
from devplugin_sdk.types import Allocation

__all__ = ["Admission"]

# The kubelet's message dumps the empty response, which protobuf's text format prints as nothing.
_NO_CONTAINERS = "no containers return in allocation response "


class Admission:
    """The containers' allocations and the calls that make them.

    Args:
        devices: The device manager, whose endpoints and healthy devices are allocated.
        seed: Seed of the random order in which the kubelet iterates its sets.
        checkpoint: Schedules a checkpoint write (after every allocation and release).
        notify: Wakes the kubelet's waiters on every change.
    """

    def __init__(
        self,
        devices: DeviceManager,
        *,
        seed: int,
        checkpoint: Callable[[], None],
        notify: Callable[[], None],
    ) -> None:
        self._devices = devices
        self._random = random.Random(seed)
        self._checkpoint = checkpoint
        self._notify = notify
        self._allocations: dict[tuple[str, str, str], ContainerAllocation] = {}
        self._pod_counter = 0

    def entries(self) -> list[ContainerAllocation]:
        """Every allocation held, in the order made (the checkpoint's entries)."""
        return list(self._allocations.values())

    async def allocate(
        self, resource: str, count: int, *, pod: str | None, container: str, start: bool
    ) -> ContainerAllocation:
        """Admit a container asking for ``count`` devices; see ``FakeKubelet.allocate``."""
        if pod is None:
            self._pod_counter += 1
            pod = f"pod-{self._pod_counter}"
        key = (pod, container, resource)
        existing = self._allocations.get(key)
        if existing is not None:
            if len(existing.device_ids) != count:
                raise AdmissionError(
                    f'pod "{pod}" container "{container}" changed request for resource '
                    f'"{resource}" from {len(existing.device_ids)} to {count}'
                )
            if start:
                await self.start_container(existing)
            return existing
        client, available = self._candidates(resource, count)
        chosen, preferred = await self._choose(client, available, count)
        ids = list(chosen)
        self._random.shuffle(ids)
        try:
            allocation = await call(client.plugin.allocate_first(ids))
        except grpc.aio.AioRpcError as exc:
            raise AdmissionError(rpc_error(exc)) from None
        if allocation is None:
            raise AdmissionError(_NO_CONTAINERS)
        result = ContainerAllocation(
            pod=pod,
            container=container,
            resource_name=resource,
            device_ids=tuple(sorted(ids)),
            allocation=allocation,
            preferred=preferred,
        )
        self._allocations[key] = result
        self._checkpoint()
        self._notify()
        if start:
            await self.start_container(result)
        return result

    def _candidates(self, resource: str, count: int) -> tuple[Endpoint, list[str]]:
        """The endpoint and the healthy free devices, in Go's random set order (the kubelet's
        checks before it asks the plugin anything)."""
        books = self._devices.live_books(resource)
        if books is None or not books.seen_list:
            raise AdmissionError(f"cannot allocate unregistered device {resource}")
        if not books.healthy:
            raise AdmissionError(
                f"no healthy devices present; cannot allocate unhealthy devices {resource}"
            )
        available = sorted(books.healthy - self.allocated(resource))
        self._random.shuffle(available)  # Go set iteration order is random
        if len(available) < count:
            raise AdmissionError(
                f"requested number of devices unavailable for {resource}. "
                f"Requested: {count}, Available: {len(available)}"
            )
        client = books.endpoint
        if client is None:
            raise AdmissionError(f"unknown Device Plugin {resource}")
        if client.stopped_at is not None:
            raise AdmissionError(f"endpoint {client.socket_path} has been stopped")
        return client, available

    async def _choose(
        self, client: Endpoint, available: list[str], count: int
    ) -> tuple[list[str], tuple[str, ...] | None]:
        """The devices to allocate: the plugin's preference (intersected with the candidates),
        filled up from the candidates; and what the plugin preferred."""
        chosen: list[str] = []
        preferred: tuple[str, ...] | None = None
        if client.options.preferred_allocation:
            try:
                preferred = await call(client.plugin.preferred_allocation(available, [], count))
            except grpc.aio.AioRpcError as exc:
                raise AdmissionError(
                    f"device plugin GetPreferredAllocation rpc failed with err: {rpc_error(exc)}"
                ) from None
            if preferred is not None:
                # Only the intersection with the candidates counts; order means nothing.
                valid = [i for i in dict.fromkeys(preferred) if i in set(available)]
                if len(valid) > count:
                    valid = self._random.sample(valid, count)
                chosen = valid
        for device_id in available:
            if len(chosen) >= count:
                break
            if device_id not in chosen:
                chosen.append(device_id)
        return chosen, preferred

    async def start_container(self, allocation: ContainerAllocation) -> None:
        """PreStartContainer when the plugin requires it; see ``FakeKubelet.start_container``."""
        books = self._devices.live_books(allocation.resource_name)
        client = books.endpoint if books is not None else None
        if client is None:
            raise ContainerStartError(
                f"endpoint not found in cache for a registered resource: {allocation.resource_name}"
            )
        if client.stopped_at is not None or not client.options.pre_start_required:
            return
        try:
            await call(
                client.plugin.pre_start_container(
                    allocation.device_ids, timeout=constants.PRE_START_CONTAINER_TIMEOUT_S
                )
            )
        except grpc.aio.AioRpcError as exc:
            raise ContainerStartError(
                f"device plugin PreStartContainer rpc failed with err: {rpc_error(exc)}"
            ) from None

    def release(self, allocation: ContainerAllocation) -> None:
        """The pod ended: its devices are free again (the plugin is never told)."""
        self._allocations.pop(
            (allocation.pod, allocation.container, allocation.resource_name), None
        )
        self._checkpoint()
        self._notify()

    def allocated(self, resource: str) -> set[str]:
        """IDs of ``resource`` held by containers."""
        return {
            i
            for a in self._allocations.values()
            if a.resource_name == resource
            for i in a.device_ids
        }

    async def call_allocate(self, resource: str, device_ids: Iterable[str]) -> Allocation:
        """Allocate with ``device_ids``, no admission checks; see ``FakeKubelet.call_allocate``."""
        books = self._devices.books(resource)
        if books is None or books.endpoint is None:
            raise AdmissionError(f"unknown Device Plugin {resource}")
        allocation = await books.endpoint.plugin.allocate_first(list(device_ids))
        if allocation is None:
            raise AdmissionError(_NO_CONTAINERS)
        return allocation
