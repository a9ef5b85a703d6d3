"""An in-memory Kubernetes API holding ResourceClaims and ResourceSlices, for tests and FakeKubelet.

It implements ``resources.ResourceApi`` with the API server's behaviour that a driver relies on:
generated names, resource versions and conflicts on stale updates, a watch that starts with the
slices that exist (one ADDED event each, as from resourceVersion "") and reports every
change (including deletions by someone else; ``changes_since`` keeps the recent ones in order,
as the API server's watch cache does), field-selector lists, the validation a real
server applies to slices (names, device count, attribute and taint limits, counters and request
policies, the 1.35 rule that a slice holds devices or counter sets), and device taints:
``timeAdded`` set when a taint comes without one, or the whole field dropped silently, as a
server with the ``DRADeviceTaints`` feature off does (``device_taints=False``). Tests add
claims and allocate devices with ``allocate``, playing the scheduler (``kubelet._scheduler``);
``devplugin_sdk.testing`` exports it.
"""

from __future__ import annotations

import datetime
import ipaddress
import itertools
import json
import secrets
import uuid
from collections import deque
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from dataclasses import replace

import anyio

from devplugin_sdk import _names
from devplugin_sdk.dra.resources import (
    MAX_COUNTER_CONSUMPTIONS_PER_DEVICE,
    MAX_COUNTER_SETS_PER_SLICE,
    MAX_COUNTERS_PER_SET,
    MAX_DEVICE_CONDITIONS,
    MAX_DEVICE_DATA_BYTES,
    MAX_DEVICES_PER_SLICE,
    MAX_DEVICES_PER_SLICE_WITH_TAINTS,
    MAX_HARDWARE_ADDRESS,
    MAX_INTERFACE_NAME,
    MAX_IPS,
    MAX_TAINTS_PER_DEVICE,
    MAX_VALID_VALUES,
    ClaimDeviceStatus,
    DeviceConfig,
    NodeEvent,
    RequestPolicy,
    ResourceClaim,
    ResourceSlice,
    SliceDevice,
    SliceEvent,
)
from devplugin_sdk.errors import KubeApiError
from devplugin_sdk.kubelet import _scheduler
from devplugin_sdk.types import MAX_ATTRIBUTES_AND_CAPACITIES, NetworkData, Quantity

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
        problems = _status_problems(current, devices)
        if problems:
            raise KubeApiError(422, f"ResourceClaim is invalid: {'; '.join(problems)}")
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
        """What the server stores of a valid write: taints dropped without the feature, a
        missing ``timeAdded`` set to now (whole seconds, as metav1.Time keeps)."""
        now = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0)
        devices = tuple(
            replace(
                d,
                taints=tuple(replace(t, time_added=t.time_added or now) for t in d.taints)
                if self.device_taints
                else (),
            )
            for d in s.devices
        )
        return replace(s, devices=devices)

    def _without_disabled(self, s: ResourceSlice) -> ResourceSlice:
        """The fields of disabled features dropped before validation, as the API server's
        strategy does (dropDisabledFields in pkg/registry/resource/resourceslice)."""
        if self.partitionable_devices and self.consumable_capacity:
            return s
        devices = s.devices
        if not self.partitionable_devices:
            devices = tuple(replace(d, consumes_counters=()) for d in devices)
        if not self.consumable_capacity:
            devices = tuple(
                replace(d, allow_multiple_allocations=False, request_policies={}) for d in devices
            )
        counters = s.shared_counters if self.partitionable_devices else ()
        return replace(s, devices=devices, shared_counters=counters)

    def _validate(self, s: ResourceSlice) -> None:
        """What the API server's validation of a ResourceSlice refuses (422 Invalid)."""
        problems = []
        for what, problem in (
            ("spec.driver", _names.driver_name_problem(s.driver)),
            ("spec.pool.name", _names.pool_name_problem(s.pool)),
        ):
            if problem is not None:
                problems.append(f"{what}: {problem}")
        if s.generation < 0:
            problems.append("spec.pool.generation: must be >= 0")
        if s.slice_count <= 0:
            problems.append("spec.pool.resourceSliceCount: must be > 0")
        tainted = self.device_taints and any(d.taints for d in s.devices)
        counting = any(d.consumes_counters for d in s.devices)
        most = MAX_DEVICES_PER_SLICE_WITH_TAINTS if tainted or counting else MAX_DEVICES_PER_SLICE
        if s.devices and s.shared_counters:
            # Kubernetes >= 1.35 (validation of ResourceSliceSpec).
            problems.append("spec: only one of devices and sharedCounters can be set")
        problems.extend(_counter_set_problems(s))
        if len(s.devices) > most:
            problems.append(f"spec.devices: at most {most} devices")
        names = [d.name for d in s.devices]
        if len(set(names)) != len(names):
            problems.append("spec.devices: duplicate device names")
        for i, device in enumerate(s.devices):
            problems.extend(_device_problems(i, device))
            problems.extend(_sharing_problems(i, device))
            if self.device_taints:
                problems.extend(_taint_problems(i, device))
        if problems:
            raise KubeApiError(422, f"ResourceSlice is invalid: {'; '.join(problems)}")


def _version(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise KubeApiError(400, f"invalid resource version {text!r}") from None


def _device_problems(i: int, device: SliceDevice) -> list[str]:
    """What the API server's validation of a device's name, attributes and capacities refuses."""
    problems = []
    problem = _names.device_name_problem(device.name)
    if problem is not None:
        problems.append(f"spec.devices[{i}].name: {problem}")
    if len(device.attributes) + len(device.capacity) > MAX_ATTRIBUTES_AND_CAPACITIES:
        problems.append(f"spec.devices[{i}]: too many attributes and capacities")
    for key in (*device.attributes, *device.capacity):
        problem = _names.attribute_name_problem(key)
        if problem is not None:
            problems.append(f"spec.devices[{i}]: {key}: {problem}")
    return problems


def _taint_problems(i: int, device: SliceDevice) -> list[str]:
    """What the API server's validation of a device's taints refuses."""
    problems = []
    if len(device.taints) > MAX_TAINTS_PER_DEVICE:
        problems.append(f"spec.devices[{i}].taints: at most {MAX_TAINTS_PER_DEVICE}")
    for j, taint in enumerate(device.taints):
        where = f"spec.devices[{i}].taints[{j}]"
        key_problem = _names.label_name_problem(taint.key)
        if key_problem is not None:
            problems.append(f"{where}.key: {key_problem}")
        value_problem = _names.label_value_problem(taint.value)
        if value_problem is not None:
            problems.append(f"{where}.value: {value_problem}")
        if taint.effect not in ("None", "NoSchedule", "NoExecute"):
            problems.append(f"{where}.effect: unsupported value {taint.effect!r}")
    return problems


def _counter_set_problems(s: ResourceSlice) -> list[str]:
    """What the API server's validation of ``spec.sharedCounters`` refuses."""
    problems = []
    if len(s.shared_counters) > MAX_COUNTER_SETS_PER_SLICE:
        problems.append(f"spec.sharedCounters: at most {MAX_COUNTER_SETS_PER_SLICE}")
    names = [c.name for c in s.shared_counters]
    if len(set(names)) != len(names):
        problems.append("spec.sharedCounters: duplicate names")
    for i, counter_set in enumerate(s.shared_counters):
        where = f"spec.sharedCounters[{i}]"
        problem = _names.device_name_problem(counter_set.name)
        if problem is not None:
            problems.append(f"{where}.name: {problem}")
        if not counter_set.counters:
            problems.append(f"{where}.counters: required")
        if len(counter_set.counters) > MAX_COUNTERS_PER_SET:
            problems.append(f"{where}.counters: at most {MAX_COUNTERS_PER_SET}")
        for key in counter_set.counters:
            problem = _names.device_name_problem(key)
            if problem is not None:
                problems.append(f"{where}.counters[{key}]: {problem}")
    return problems


def _sharing_problems(i: int, device: SliceDevice) -> list[str]:
    """What the API server's validation of a device's counters and request policies refuses."""
    problems = []
    where = f"spec.devices[{i}]"
    if len(device.consumes_counters) > MAX_COUNTER_CONSUMPTIONS_PER_DEVICE:
        problems.append(f"{where}.consumesCounters: at most {MAX_COUNTER_CONSUMPTIONS_PER_DEVICE}")
    sets = [c.counter_set for c in device.consumes_counters]
    if len(set(sets)) != len(sets):
        problems.append(f"{where}.consumesCounters: one entry per counter set")
    for j, consumption in enumerate(device.consumes_counters):
        if len(consumption.counters) > MAX_COUNTERS_PER_SET:
            problems.append(
                f"{where}.consumesCounters[{j}].counters: at most {MAX_COUNTERS_PER_SET}"
            )
    if device.request_policies and not device.allow_multiple_allocations:
        problems.append(f"{where}.capacity: requestPolicy needs allowMultipleAllocations")
    for key, policy in device.request_policies.items():
        value = device.capacity.get(key)
        if value is None:
            problems.append(f"{where}.capacity[{key}].requestPolicy: no such capacity")
            continue
        problems.extend(
            f"{where}.capacity[{key}].requestPolicy: {p}" for p in _policy_problems(policy, value)
        )
    return problems


def _policy_problems(policy: RequestPolicy, capacity: Quantity) -> list[str]:
    """ValidateCapacityRequestPolicy (k8s.io/kubernetes pkg/apis/resource/validation)."""
    problems = []
    if policy.valid_values and policy.minimum is not None:
        problems.append("only one of validValues and validRange may be set")
    if policy.valid_values:
        problems.extend(_values_problems(policy, capacity))
    elif policy.minimum is not None:
        problems.extend(_range_problems(policy, capacity))
    if policy.default.value > capacity.value:
        problems.append("default: larger than the capacity")
    return problems


def _values_problems(policy: RequestPolicy, capacity: Quantity) -> list[str]:
    problems = []
    values = [v.value for v in policy.valid_values]
    if len(values) > MAX_VALID_VALUES:
        problems.append(f"validValues: at most {MAX_VALID_VALUES}")
    if values != sorted(set(values)):
        problems.append("validValues: must be sorted ascending, without duplicates")
    if policy.default.value not in values:
        problems.append("default: must be one of validValues")
    if values[-1] > capacity.value:
        problems.append("validValues: larger than the capacity")
    return problems


def _range_problems(policy: RequestPolicy, capacity: Quantity) -> list[str]:
    assert policy.minimum is not None
    problems = []
    default = policy.default.value
    low = policy.minimum.value
    high = policy.maximum.value if policy.maximum is not None else None
    step = policy.step.value if policy.step is not None else None
    if low > capacity.value:
        problems.append("validRange.min: larger than the capacity")
    if high is not None and (high > capacity.value or high < low):
        problems.append("validRange.max: must be between min and the capacity")
    if not low <= default <= (high if high is not None else capacity.value):
        problems.append("default: must be within validRange")
    if step is not None:
        if step <= 0 or low + step > capacity.value:
            problems.append("validRange.step: min + step must not exceed the capacity")
        elif (high is not None and high % step) or default % step:
            problems.append("validRange: max and default must be multiples of step")
    return problems


def _status_problems(claim: ResourceClaim, devices: Sequence[ClaimDeviceStatus]) -> list[str]:
    """What the API server's validation of a claim's status.devices[] refuses (k8s.io/api
    resource/v1 types.go, pkg/apis/resource/validation): entries only for allocated devices,
    one per key, and the size limits."""
    problems = []
    allocated = {(r.driver, r.pool, r.device) for r in claim.results}
    seen: set[tuple[str, str, str]] = set()
    for i, entry in enumerate(devices):
        where = f"status.devices[{i}]"
        key = (entry.driver, entry.pool, entry.device)
        if key not in allocated:
            problems.append(f"{where}: must be an allocated device in the claim")
        if key in seen:
            problems.append(f"{where}: duplicate value")
        seen.add(key)
        status = entry.status
        if len(status.conditions) > MAX_DEVICE_CONDITIONS:
            problems.append(f"{where}.conditions: at most {MAX_DEVICE_CONDITIONS}")
        if status.data is not None:
            size = len(json.dumps(status.data, separators=(",", ":")).encode())
            if size > MAX_DEVICE_DATA_BYTES:
                problems.append(f"{where}.data: at most {MAX_DEVICE_DATA_BYTES} bytes")
        if status.network_data is not None:
            problems.extend(_network_problems(where, status.network_data))
    return problems


def _network_problems(where: str, net: NetworkData) -> list[str]:
    problems = []
    if len(net.interface_name) > MAX_INTERFACE_NAME:
        problems.append(f"{where}.networkData.interfaceName: too long")
    if len(net.ips) > MAX_IPS:
        problems.append(f"{where}.networkData.ips: at most {MAX_IPS}")
    if len(net.hardware_address) > MAX_HARDWARE_ADDRESS:
        problems.append(f"{where}.networkData.hardwareAddress: too long")
    for ip in net.ips:
        try:
            ipaddress.ip_interface(ip)
            valid = "/" in ip
        except ValueError:
            valid = False
        if not valid:
            problems.append(f"{where}.networkData.ips: {ip!r} is not in CIDR form")
    return problems
