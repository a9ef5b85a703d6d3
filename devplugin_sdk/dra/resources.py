"""The resource.k8s.io/v1 objects a DRA driver reads and writes, and the API it uses for them.

A DRA kubelet plugin needs few Kubernetes operations: read a ResourceClaim and apply its
devices' status, list, create, update, delete and watch the ResourceSlices of its driver on its
node, and record an Event on its Node. ``ResourceApi`` is that
interface, in the SDK's own frozen dataclasses; ``devplugin_sdk.dra.kube_api`` implements it
with a Kubernetes client (the ``dra`` extra) and ``devplugin_sdk.testing.MemoryApi`` in memory,
for tests. Field meanings follow k8s.io/api resource/v1 types.go.
"""

from __future__ import annotations

import datetime
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from devplugin_sdk.types import AttributeValue, DeviceStatus, Quantity

__all__ = [
    "MAX_COUNTERS_PER_SET",
    "MAX_COUNTER_CONSUMPTIONS_PER_DEVICE",
    "MAX_COUNTER_SETS_PER_SLICE",
    "MAX_DEVICES_PER_SLICE",
    "MAX_DEVICES_PER_SLICE_WITH_TAINTS",
    "MAX_DEVICE_CONDITIONS",
    "MAX_DEVICE_DATA_BYTES",
    "MAX_TAINTS_PER_DEVICE",
    "MAX_VALID_VALUES",
    "AllocatedDevice",
    "ClaimDeviceStatus",
    "CounterConsumption",
    "CounterSet",
    "DeviceConfig",
    "DeviceTaint",
    "NodeEvent",
    "RequestPolicy",
    "ResourceApi",
    "ResourceClaim",
    "ResourceSlice",
    "SliceDevice",
    "SliceEvent",
]

#: ResourceSliceMaxDevices: a slice lists at most this many devices; a bigger pool takes
#: several slices of one generation.
MAX_DEVICES_PER_SLICE = 128
#: ResourceSliceMaxDevicesWithTaintsOrConsumesCounters: a slice any of whose devices has taints
#: lists at most this many.
MAX_DEVICES_PER_SLICE_WITH_TAINTS = 64
#: DeviceTaintsMaxLength: taints per device.
MAX_TAINTS_PER_DEVICE = 16
#: ResourceSliceMaxCounterSets: counter sets per slice (ResourceSliceSpec.sharedCounters).
MAX_COUNTER_SETS_PER_SLICE = 8
#: ResourceSliceMaxCountersPerCounterSet: counters per set, and per device consumption.
MAX_COUNTERS_PER_SET = 32
#: ResourceSliceMaxDeviceCounterConsumptionsPerDevice: consumesCounters entries per device.
MAX_COUNTER_CONSUMPTIONS_PER_DEVICE = 2
#: CapacityRequestPolicyDiscreteMaxOptions: entries of requestPolicy.validValues.
MAX_VALID_VALUES = 10

# The limits of a claim's status.devices[] (k8s.io/api resource/v1 types.go:
# AllocatedDeviceStatus, NetworkDeviceData; enforced by the API server's validation).
#: Conditions per device.
MAX_DEVICE_CONDITIONS = 8
#: ``data``, JSON-encoded.
MAX_DEVICE_DATA_BYTES = 10 * 1024
#: ``networkData.interfaceName``, characters.
MAX_INTERFACE_NAME = 256
#: ``networkData.ips``.
MAX_IPS = 16
#: ``networkData.hardwareAddress``, characters.
MAX_HARDWARE_ADDRESS = 128

TaintEffect = Literal["None", "NoSchedule", "NoExecute"]


@dataclass(frozen=True, slots=True)
class DeviceTaint:
    """A taint on a device in a ResourceSlice (``devices[].taints[]``, ``DRADeviceTaints``).

    Args:
        key: A label name; the SDK's are in the driver's domain (``gpu.acme.com/health``).
        value: A label value (the reason's cause).
        effect: ``None`` (the scheduler ignores it: advisory), ``NoSchedule`` (no new claims
            get the device unless they tolerate it) or ``NoExecute`` (pods using it are also
            evicted).
        time_added: When the taint was added; the API server sets it when absent. Kept while the
            taint stays, so tolerations with ``tolerationSeconds`` count from the first time.
    """

    key: str
    value: str
    effect: TaintEffect
    time_added: datetime.datetime | None = None


@dataclass(frozen=True, slots=True)
class RequestPolicy:
    """How claims consume a capacity of a device that allows multiple allocations
    (``capacity[].requestPolicy``, KEP-5075).

    Exactly one of ``valid_values`` and the range (``minimum``, with optional ``maximum`` and
    ``step``) is set; ``default`` is what a claim that names no amount consumes. The scheduler
    rounds a request up to the next valid value and refuses one past the largest.

    Args:
        default: Consumed by a request that does not name this capacity.
        valid_values: The amounts a request may consume, ascending (at most 10).
        minimum: The range's ``min``.
        maximum: The range's ``max`` (a multiple of ``step``); None is the capacity.
        step: The range's ``step``; requests round up to ``minimum + n * step``.
    """

    default: Quantity
    valid_values: tuple[Quantity, ...] = ()
    minimum: Quantity | None = None
    maximum: Quantity | None = None
    step: Quantity | None = None

    def consumed(self, requested: Quantity | None, capacity: Quantity) -> Quantity | None:
        """What a request of ``requested`` (None: it names none) consumes, rounded as the
        scheduler rounds it; None when the policy refuses it."""
        if requested is None:
            return self.default
        want = requested.value
        if self.valid_values:
            fits = [v for v in self.valid_values if v.value >= want]
            return fits[0] if fits else None
        low = self.minimum.value if self.minimum is not None else 0
        want = max(want, low)
        if self.step is not None and self.step.value > 0:
            over = (want - low) % self.step.value
            if over:
                want += self.step.value - over
        top = self.maximum.value if self.maximum is not None else capacity.value
        return Quantity(want) if want <= top else None


@dataclass(frozen=True, slots=True)
class CounterSet:
    """A named set of counters devices of the pool consume (``spec.sharedCounters[]``).

    Args:
        name: A DNS label, unique in the pool.
        counters: The amounts by counter name (DNS labels; at most 32).
    """

    name: str
    counters: Mapping[str, Quantity]


@dataclass(frozen=True, slots=True)
class CounterConsumption:
    """What a device consumes of one counter set (``devices[].consumesCounters[]``).

    Args:
        counter_set: The set's name.
        counters: The amounts by counter name.
    """

    counter_set: str
    counters: Mapping[str, Quantity]


@dataclass(frozen=True, slots=True)
class SliceDevice:
    """One device as a ResourceSlice lists it.

    Args:
        name: Unique in the pool, a DNS label (``devplugin_sdk.dra.device_name``).
        attributes: Typed attributes by qualified name.
        capacity: Capacities by qualified name.
        taints: Its taints (at most ``MAX_TAINTS_PER_DEVICE``).
        allow_multiple_allocations: Several claims may be allocated the device at once, each
            consuming part of its capacities (``allowMultipleAllocations``).
        request_policies: How claims consume each capacity, by capacity name (only with
            ``allow_multiple_allocations``).
        consumes_counters: What the device takes of the pool's counter sets (at most 2).
    """

    name: str
    attributes: Mapping[str, AttributeValue] = field(default_factory=dict)
    capacity: Mapping[str, Quantity] = field(default_factory=dict)
    taints: tuple[DeviceTaint, ...] = ()
    allow_multiple_allocations: bool = False
    request_policies: Mapping[str, RequestPolicy] = field(default_factory=dict)
    consumes_counters: tuple[CounterConsumption, ...] = ()


@dataclass(frozen=True, slots=True)
class ResourceSlice:
    """A ResourceSlice of one driver's pool on one node.

    Args:
        name: The object's name; empty when creating (the API generates one from
            ``<node>-<driver>-``).
        driver: The DRA driver name (``spec.driver``).
        node_name: The node (``spec.nodeName``).
        pool: The pool name (``spec.pool.name``).
        generation: The pool's generation (``spec.pool.generation``): consumers use only the
            slices of the highest one.
        slice_count: How many slices the pool has at that generation
            (``spec.pool.resourceSliceCount``).
        devices: The devices (at most ``MAX_DEVICES_PER_SLICE``).
        shared_counters: The pool's counter sets in this slice (at most 8); since Kubernetes
            1.35 a slice holds either devices or counter sets, never both.
        resource_version: ``metadata.resourceVersion`` as read; an update with a stale one
            fails with a conflict.
        node_uid: UID of the Node that owns the slice (``metadata.ownerReferences``): the
            garbage collector deletes the slices with the node.
    """

    name: str
    driver: str
    node_name: str
    pool: str
    generation: int
    slice_count: int
    devices: tuple[SliceDevice, ...] = ()
    resource_version: str = ""
    node_uid: str = ""
    shared_counters: tuple[CounterSet, ...] = ()


@dataclass(frozen=True, slots=True)
class AllocatedDevice:
    """One entry of a claim's ``status.allocation.devices.results``.

    Args:
        request: The request (``name`` or ``name/subrequest``) the device was allocated for.
        driver: The driver of the device.
        pool: Its pool.
        device: Its name in the pool.
        share_id: Which share of a device that allows multiple allocations this is
            (``shareID``); empty for an exclusive allocation.
        consumed: What the share consumes of each capacity (``consumedCapacity``).
        admin_access: Allocated for administrative access (``adminAccess``): not exclusive,
            for monitoring.
    """

    request: str
    driver: str
    pool: str
    device: str
    share_id: str = ""
    consumed: Mapping[str, Quantity] = field(default_factory=dict)
    admin_access: bool = False


ConfigSource = Literal["FromClass", "FromClaim"]


@dataclass(frozen=True, slots=True)
class DeviceConfig:
    """One ``DeviceAllocationConfiguration`` of a claim's ``status.allocation.devices.config``.

    Args:
        source: ``FromClass`` (a DeviceClass's config, set by the administrator) or ``FromClaim``
            (the claim's own); a claim's entries override its classes' for the same request.
        requests: The requests (``name`` or ``name/subrequest``) it applies to; empty: all.
        driver: ``opaque.driver``: the driver whose kubelet plugin reads it.
        parameters: ``opaque.parameters``, as decoded from JSON (a driver-defined object with
            ``apiVersion`` and ``kind``; at most 10 KiB).
    """

    source: ConfigSource
    requests: tuple[str, ...]
    driver: str
    parameters: Any


@dataclass(frozen=True, slots=True)
class ResourceClaim:
    """A ResourceClaim as a kubelet plugin reads it.

    Args:
        namespace: ``metadata.namespace``.
        name: ``metadata.name``.
        uid: ``metadata.uid``.
        allocated: Whether ``status.allocation`` is set.
        results: The allocated devices, of every driver.
        reserved_for: UIDs of the pods in ``status.reservedFor``.
        config: The opaque configuration entries of the allocation, of every driver, classes'
            first (``status.allocation.devices.config``).
        pod_claim_name: The pod's name for a claim made from a ResourceClaimTemplate (the
            ``resource.kubernetes.io/pod-claim-name`` annotation), else None.
    """

    namespace: str
    name: str
    uid: str
    allocated: bool = False
    results: tuple[AllocatedDevice, ...] = ()
    reserved_for: tuple[str, ...] = ()
    config: tuple[DeviceConfig, ...] = ()
    pod_claim_name: str | None = None


@dataclass(frozen=True, slots=True)
class ClaimDeviceStatus:
    """One entry of a claim's ``status.devices[]``, keyed by driver, pool and device.

    Args:
        driver: The driver (the entries' writer, and their field manager).
        pool: The device's pool.
        device: The device's name in the pool.
        status: Its conditions, data and network data.
    """

    driver: str
    pool: str
    device: str
    status: DeviceStatus


@dataclass(frozen=True, slots=True)
class SliceEvent:
    """One change a ResourceSlice watch reports.

    Args:
        kind: ``"ADDED"``, ``"MODIFIED"``, ``"DELETED"``, or ``"BOOKMARK"`` (no change: only
            ``resource_version`` says how far the watch has come).
        slice: The slice as stored (as it was last, for DELETED).
        resource_version: The version to resume the watch from after this event.
    """

    kind: Literal["ADDED", "MODIFIED", "DELETED", "BOOKMARK"]
    slice: ResourceSlice | None
    resource_version: str


@dataclass(frozen=True, slots=True)
class NodeEvent:
    """A Kubernetes Event about a Node (core/v1, in the ``default`` namespace, where the
    kubelet records its own Node events).

    Args:
        node_name: The Node.
        node_uid: Its UID (empty when unknown).
        reason: CamelCase (``CheckpointCorrupted``).
        message: For people (at most 1024 characters are kept).
        type: ``Warning`` or ``Normal``.
        component: Who reports it (the driver's name).
    """

    node_name: str
    node_uid: str
    reason: str
    message: str
    type: Literal["Normal", "Warning"] = "Warning"
    component: str = ""


class ResourceApi(Protocol):
    """The Kubernetes operations a DRA kubelet plugin performs.

    Every method raises ``errors.KubeApiError`` when the API server refuses, cannot be reached,
    or answers anything but the expected object (``malformed``); ``not_found`` and ``conflict``
    tell the two cases callers act on.
    """

    async def read_claim(self, namespace: str, name: str) -> ResourceClaim:
        """The ResourceClaim ``namespace/name``."""
        ...

    async def list_slices(self, driver: str, node_name: str) -> list[ResourceSlice]:
        """Every ResourceSlice of ``driver`` on ``node_name``."""
        ...

    async def create_slice(self, resource_slice: ResourceSlice) -> ResourceSlice:
        """Create a slice (its name generated when empty); return it as stored."""
        ...

    async def update_slice(self, resource_slice: ResourceSlice) -> ResourceSlice:
        """Replace the slice of that name; a stale ``resource_version`` is a conflict."""
        ...

    async def delete_slice(self, name: str) -> None:
        """Delete the slice ``name``."""
        ...

    def watch_slices(
        self, driver: str, node_name: str, resource_version: str = ""
    ) -> AsyncIterator[SliceEvent | None]:
        """Yield whenever a slice of ``driver`` on ``node_name`` is added, changed or deleted
        (by anyone: the kubelet deletes a node's slices when it starts): a ``SliceEvent``, or
        None from an implementation that cannot say what changed (the caller then lists).

        From ``resource_version`` "" the watch starts with an ADDED event for every slice that
        exists; from a version seen earlier it sends every change after it (a
        ``KubeApiError`` 410 when that version is too old). Ends or raises when the watch
        breaks; the caller watches anew (from the last version it saw)."""
        ...

    async def node_uid(self, node_name: str) -> str:
        """The UID of the Node ``node_name`` (the owner of its slices)."""
        ...

    async def apply_claim_status(
        self, claim: ResourceClaim, field_manager: str, devices: Sequence[ClaimDeviceStatus]
    ) -> None:
        """Server-side apply ``devices`` as the ``status.devices[]`` entries that
        ``field_manager`` owns in ``claim`` (an empty list removes that manager's entries);
        the claim's UID is a precondition."""
        ...

    async def create_event(self, event: NodeEvent) -> None:
        """Record ``event`` on its Node."""
        ...

    async def aclose(self) -> None:
        """Release connections."""
        ...
