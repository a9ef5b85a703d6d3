"""An in-memory Kubernetes API holding ResourceClaims and ResourceSlices, for tests and FakeKubelet.

It implements ``resources.ResourceApi`` with the API server's behaviour that a driver relies on:
generated names, resource versions and conflicts on stale updates, a watch that starts with the
slices that exist (one ADDED event each, as from resourceVersion "") and reports every
change (including deletions by someone else; ``changes_since`` keeps the recent ones in order,
as the API server's watch cache does), field-selector lists, the validation a real server
applies to slices and to a claim's device status (``dra._validation``, the rules ``devplugin dra
check`` applies too, as of the newest release it knows), and device taints:
``timeAdded`` set when a taint comes without one, or the whole field dropped silently, as a
server with the ``DRADeviceTaints`` feature off does (``device_taints=False``). Tests add
claims and allocate devices with ``allocate``, playing the scheduler (``kubelet._scheduler``);
``devplugin_sdk.testing`` exports it.
"""

from __future__ import annotations

import datetime
import itertools
import secrets
import uuid
from collections import deque
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from dataclasses import replace

import anyio

from devplugin_sdk.dra import _validation
from devplugin_sdk.dra.resources import (
    ClaimDeviceStatus,
    DeviceConfig,
    NodeEvent,
    ResourceClaim,
    ResourceSlice,
    SliceEvent,
)
from devplugin_sdk.errors import KubeApiError
from devplugin_sdk.kubelet import _scheduler
from devplugin_sdk.types import Quantity

__all__ = ["MemoryApi"]

# How many slice changes ``changes_since`` remembers (the API server's watch cache keeps a
# window too; a watcher further behind is told 410 Gone and lists again).
_HISTORY = 10_000


class MemoryApi:
    """ResourceClaims, ResourceSlices and Nodes held in memory, behind ``ResourceApi``.

    Args:
        nodes: Node names that exist (their UIDs are generated).
        device_taints: Whether the server has the ``DRADeviceTaints`` feature (on by default
            from Kubernetes 1.36); without it, devices' taints are dropped from every write,
            with no error.
        partitionable_devices: Whether it has ``DRAPartitionableDevices`` (on from 1.36);
            without it ``sharedCounters`` and ``consumesCounters`` are dropped, with no error.
        consumable_capacity: Whether it has ``DRAConsumableCapacity`` (on from 1.36); without
            it ``allowMultipleAllocations`` and request policies are dropped, with no error.

    Fault hooks: ``fail_next(status, reason, times)`` makes the next calls fail as an
    unreachable or refusing API server would (``clear_failures`` ends them); ``calls`` counts
    calls by method name. ``claim_status`` holds each claim's ``status.devices[]`` by field
    manager (server-side apply), ``events`` the Node events recorded.
    """

    def __init__(
        self,
        nodes: Iterable[str] = (),
        *,
        device_taints: bool = True,
        partitionable_devices: bool = True,
        consumable_capacity: bool = True,
    ) -> None:
        self.device_taints = device_taints
        self.partitionable_devices = partitionable_devices
        self.consumable_capacity = consumable_capacity
        self.claims: dict[tuple[str, str], ResourceClaim] = {}
        self.slices: dict[str, ResourceSlice] = {}
        self.nodes: dict[str, str] = {}
        self.calls: dict[str, int] = {}
        # (namespace, name) -> field manager -> its status.devices[] entries
        self.claim_status: dict[tuple[str, str], dict[str, tuple[ClaimDeviceStatus, ...]]] = {}
        self.events: list[NodeEvent] = []
        self._versions = itertools.count(1)
        self._changed = anyio.Event()
        self._generation = 0
        self._failures: list[tuple[int, str]] = []
        # (generation, "ADDED" | "MODIFIED" | "DELETED", the slice, its resource version): the
        # recent changes. One counter gives every change its version, deletions included, as
        # etcd's revision does: a watch resumes from any of them.
        self._history: deque[tuple[int, str, ResourceSlice, int]] = deque(maxlen=_HISTORY)
        for node in nodes:
            self.add_node(node)

    # ------------------------------------------------------------------ the test's side

    def add_node(self, name: str) -> str:
        """Create the Node ``name``; return its UID."""
        return self.nodes.setdefault(name, str(uuid.uuid4()))

    def add_claim(
        self,
        namespace: str,
        name: str,
        *,
        uid: str | None = None,
        pod_claim_name: str | None = None,
    ) -> ResourceClaim:
        """Create an unallocated ResourceClaim (as a pod's ResourceClaimTemplate would, with
        ``pod_claim_name`` the pod's name for it)."""
        claim = ResourceClaim(
            namespace, name, uid or str(uuid.uuid4()), pod_claim_name=pod_claim_name
        )
        self.claims[(namespace, name)] = claim
        return claim

    def allocate(
        self,
        namespace: str,
        name: str,
        devices: Mapping[str, Sequence[str]],
        *,
        driver: str,
        pool: str,
        pods: Sequence[str] = (),
        config: Sequence[DeviceConfig] = (),
        capacity: Mapping[str, Mapping[str, Quantity]] | None = None,
        admin_access: bool = False,
        check: bool = True,
    ) -> ResourceClaim:
        """Allocate devices to a claim and reserve it for pods, as the scheduler does.

        The claim is created if it does not exist. A device that allows multiple allocations
        gets a share: a new ``shareID`` and a ``consumedCapacity`` of each capacity, rounded up
        by its request policy (its default for a request that names none; no policy: all of it).

        Args:
            namespace: The claim's namespace.
            name: The claim's name.
            devices: Device names by request name.
            driver: The driver of every device.
            pool: Their pool (the node name for a node-local driver).
            pods: UIDs of the pods the claim is reserved for.
            config: The allocation's opaque configuration entries, as the scheduler copies
                them from the DeviceClasses and the claim (classes' first).
            capacity: The amounts each request asks (``DeviceRequest.capacity.requests``), by
                request name.
            admin_access: Allocate for admin access (``adminAccess: true``): in use or not,
                nothing consumed.
            check: Refuse what the scheduler would not (a device in use, capacity or counters
                exhausted); False allocates anyway, to test a driver's own last line of defence.

        Raises:
            KubeApiError: a device is not in a published slice of that driver and pool; with
                ``check``, it is taken, or its capacity, request policy or counters refuse it.
        """
        results = _scheduler.allocate(
            (namespace, name),
            devices,
            driver=driver,
            pool=pool,
            slices=self.pool(driver, pool),
            claims=self.claims.values(),
            capacity=capacity or {},
            admin_access=admin_access,
            check=check,
        )
        claim = self.claims.get((namespace, name)) or self.add_claim(namespace, name)
        self.claims[(namespace, name)] = claim = replace(
            claim,
            allocated=True,
            results=results,
            reserved_for=tuple(pods),
            config=_scheduler.ordered_config(config),
        )
        return claim

    def deallocate(self, namespace: str, name: str) -> None:
        """Clear a claim's allocation and reservations (its pods are gone)."""
        claim = self.claims[(namespace, name)]
        self.claims[(namespace, name)] = replace(
            claim, allocated=False, results=(), reserved_for=()
        )

    def delete_claim(self, namespace: str, name: str) -> None:
        """Delete a claim."""
        del self.claims[(namespace, name)]
        self.claim_status.pop((namespace, name), None)

    def device_statuses(self, namespace: str, name: str) -> list[ClaimDeviceStatus]:
        """The claim's ``status.devices[]``, every field manager's entries."""
        owned = self.claim_status.get((namespace, name), {})
        return [entry for entries in owned.values() for entry in entries]

    def pool(self, driver: str, pool: str) -> list[ResourceSlice]:
        """The slices of the pool's highest generation, by name."""
        slices = [s for s in self.slices.values() if s.driver == driver and s.pool == pool]
        top = max((s.generation for s in slices), default=0)
        return sorted((s for s in slices if s.generation == top), key=lambda s: s.name)

    def pool_complete(self, driver: str, pool: str) -> bool:
        """Whether the pool's highest generation has all its slices (what the scheduler
        waits for before it allocates from the pool)."""
        slices = self.pool(driver, pool)
        return bool(slices) and all(s.slice_count == len(slices) for s in slices)

    def wipe_slices(self, node_name: str, driver: str | None = None) -> int:
        """Delete the node's slices (of one driver), as the kubelet does when it starts and
        when a driver has been gone for 30 s. Returns how many were deleted."""
        doomed = [
            name
            for name, s in self.slices.items()
            if s.node_name == node_name and (driver is None or s.driver == driver)
        ]
        gone = [self.slices.pop(name) for name in doomed]
        if gone:
            self._notify(*(("DELETED", s) for s in gone))
        return len(doomed)

    def fail_next(self, status: int, reason: str, times: int = 1) -> None:
        """Fail the next ``times`` calls with ``KubeApiError(status, reason)`` (0: unreachable)."""
        self._failures.extend([(status, reason)] * times)

    def clear_failures(self) -> None:
        """Drop the failures ``fail_next`` still holds: the API answers again."""
        self._failures.clear()

    @property
    def generation(self) -> int:
        """Counts every change to the slices (tests wait on it with ``wait_changed``)."""
        return self._generation

    def changes_since(self, generation: int) -> tuple[int, list[tuple[str, ResourceSlice]]] | None:
        """The current generation and every slice change after ``generation``, in order
        (``"ADDED"``, ``"MODIFIED"`` or ``"DELETED"`` with the slice); None when the oldest
        of them is no longer remembered."""
        if generation < self._generation and (
            not self._history or self._history[0][0] > generation + 1
        ):
            return None
        return self._generation, [(kind, s) for g, kind, s, _ in self._history if g > generation]

    async def wait_changed(self, generation: int) -> int:
        """Wait until the slices change past ``generation``; return the new generation."""
        while self._generation == generation:
            await self._changed.wait()
        return self._generation

    async def wait_pool_complete(self, driver: str, pool: str) -> None:
        """Wait until ``pool_complete(driver, pool)`` (bound it with ``anyio.fail_after``)."""
        while not self.pool_complete(driver, pool):
            await self.wait_changed(self._generation)

    # ------------------------------------------------------------------ ResourceApi

    async def read_claim(self, namespace: str, name: str) -> ResourceClaim:
        self._call("read_claim")
        try:
            return self.claims[(namespace, name)]
        except KeyError:
            raise KubeApiError(404, f'resourceclaims.resource.k8s.io "{name}" not found') from None

    async def list_slices(self, driver: str, node_name: str) -> list[ResourceSlice]:
        self._call("list_slices")
        return sorted(
            (s for s in self.slices.values() if s.driver == driver and s.node_name == node_name),
            key=lambda s: s.name,
        )

    async def create_slice(self, resource_slice: ResourceSlice) -> ResourceSlice:
        self._call("create_slice")
        resource_slice = self._without_disabled(resource_slice)
        self._validate(resource_slice)
        name = resource_slice.name
        if not name:
            # generateName: <node>-<driver>- plus five random characters.
            name = f"{resource_slice.node_name}-{resource_slice.driver}-{secrets.token_hex(3)[:5]}"
        if name in self.slices:
            raise KubeApiError(409, f'resourceslices.resource.k8s.io "{name}" already exists')
        stored = replace(
            self._stored(resource_slice), name=name, resource_version=str(next(self._versions))
        )
        self.slices[name] = stored
        self._notify(("ADDED", stored))
        return stored

    async def update_slice(self, resource_slice: ResourceSlice) -> ResourceSlice:
        self._call("update_slice")
        current = self.slices.get(resource_slice.name)
        if current is None:
            raise KubeApiError(
                404, f'resourceslices.resource.k8s.io "{resource_slice.name}" not found'
            )
        if resource_slice.resource_version != current.resource_version:
            raise KubeApiError(
                409,
                f'Operation cannot be fulfilled on resourceslices.resource.k8s.io "'
                f'{resource_slice.name}": the object has been modified',
            )
        resource_slice = self._without_disabled(resource_slice)
        self._validate(resource_slice)
        stored = replace(self._stored(resource_slice), resource_version=str(next(self._versions)))
        self.slices[resource_slice.name] = stored
        self._notify(("MODIFIED", stored))
        return stored

    async def delete_slice(self, name: str) -> None:
        self._call("delete_slice")
        gone = self.slices.pop(name, None)
        if gone is None:
            raise KubeApiError(404, f'resourceslices.resource.k8s.io "{name}" not found')
        self._notify(("DELETED", gone))

    async def watch_slices(
        self, driver: str, node_name: str, resource_version: str = ""
    ) -> AsyncIterator[SliceEvent | None]:
        self._call("watch_slices")

        def ours(s: ResourceSlice) -> bool:
            return s.driver == driver and s.node_name == node_name

        seen = self._generation
        if resource_version:
            # As the API server does from a version: every change after it, then the new ones;
            # 410 Gone when the changes since are no longer all remembered (its watch cache).
            since = _version(resource_version)
            if self._history and self._history[0][3] > since + 1:
                raise KubeApiError(410, f"too old resource version: {resource_version}")
            for _, kind, s, version in [e for e in self._history if e[3] > since]:
                if ours(s):
                    yield SliceEvent(kind, s, str(version))  # type: ignore[arg-type]
        else:
            # From "" (or 0): first an ADDED event for every slice that exists, then changes.
            for s in list(self.slices.values()):
                if ours(s):
                    yield SliceEvent("ADDED", s, s.resource_version)
        while True:
            now = await self.wait_changed(seen)
            if self._history and self._history[0][0] > seen + 1:
                raise KubeApiError(410, "the watch fell too far behind")
            batch = [e for e in self._history if seen < e[0] <= now]
            seen = now
            for _, kind, s, version in batch:
                if ours(s):
                    yield SliceEvent(kind, s, str(version))  # type: ignore[arg-type]

    async def node_uid(self, node_name: str) -> str:
        self._call("node_uid")
        try:
            return self.nodes[node_name]
        except KeyError:
            raise KubeApiError(404, f'nodes "{node_name}" not found') from None

    async def apply_claim_status(
        self, claim: ResourceClaim, field_manager: str, devices: Sequence[ClaimDeviceStatus]
    ) -> None:
        self._call("apply_claim_status")
        key = (claim.namespace, claim.name)
        current = self.claims.get(key)
        if current is None:
            raise KubeApiError(404, f'resourceclaims.resource.k8s.io "{claim.name}" not found')
        if claim.uid and current.uid != claim.uid:
            raise KubeApiError(
                409,
                f"Precondition failed: UID in precondition: {claim.uid}, UID in object meta: "
                f"{current.uid}",
            )
        allocated = {(r.driver, r.pool, r.device) for r in current.results}
        problems = _validation.claim_status_problems(allocated, devices)
        if problems:
            shown = "; ".join(f"status.{where}: {why}" for where, why in problems)
            raise KubeApiError(422, f"ResourceClaim is invalid: {shown}")
        # Server-side apply: this manager's entries are replaced by what it applies now; the
        # other managers' stay (the list is a map keyed by driver, pool, device).
        self.claim_status.setdefault(key, {})[field_manager] = tuple(devices)

    async def create_event(self, event: NodeEvent) -> None:
        self._call("create_event")
        if event.node_name not in self.nodes:
            # The API server accepts an Event about any object; a test wants to hear of it.
            raise KubeApiError(422, f"Event is invalid: no Node {event.node_name}")
        self.events.append(event)

    async def aclose(self) -> None:
        return None

    # ------------------------------------------------------------------ internals

    def _call(self, method: str) -> None:
        self.calls[method] = self.calls.get(method, 0) + 1
        if self._failures:
            status, reason = self._failures.pop(0)
            raise KubeApiError(status, reason)

    def _notify(self, *changes: tuple[str, ResourceSlice]) -> None:
        self._generation += 1
        self._history.extend(
            (
                self._generation,
                kind,
                s,
                next(self._versions) if kind == "DELETED" else int(s.resource_version),
            )
            for kind, s in changes
        )
        self._changed.set()
        self._changed = anyio.Event()

    def _stored(self, s: ResourceSlice) -> ResourceSlice:
        """What the server stores of a valid write: a missing ``timeAdded`` set to now (whole
        seconds, as metav1.Time keeps)."""
        now = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0)
        devices = tuple(
            replace(d, taints=tuple(replace(t, time_added=t.time_added or now) for t in d.taints))
            if any(t.time_added is None for t in d.taints)
            else d
            for d in s.devices
        )
        return replace(s, devices=devices)

    def _without_disabled(self, s: ResourceSlice) -> ResourceSlice:
        """The fields of disabled features dropped before validation, as the API server's
        strategy does (dropDisabledFields in pkg/registry/resource/resourceslice)."""
        if self.partitionable_devices and self.consumable_capacity and self.device_taints:
            return s
        devices = s.devices
        if not self.device_taints:
            devices = tuple(replace(d, taints=()) for d in devices)
        if not self.partitionable_devices:
            devices = tuple(replace(d, consumes_counters=()) for d in devices)
        if not self.consumable_capacity:
            devices = tuple(
                replace(d, allow_multiple_allocations=False, request_policies={}) for d in devices
            )
        counters = s.shared_counters if self.partitionable_devices else ()
        return replace(s, devices=devices, shared_counters=counters)

    def _validate(self, s: ResourceSlice) -> None:
        """What the API server's validation of a ResourceSlice refuses (422 Invalid), as of the
        newest release ``dra._validation`` knows."""
        problems = _validation.slice_problems(_validation.slice_spec(s))
        if problems:
            shown = "; ".join(
                f"spec{'.' if where else ''}{where}: {why}" for where, why in problems
            )
            raise KubeApiError(422, f"ResourceSlice is invalid: {shown}")


def _version(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise KubeApiError(400, f"invalid resource version {text!r}") from None
