"""The Kubernetes API server's validation rules for what a DRA driver writes, written once.

``devplugin dra check`` (offline, per release) and ``MemoryApi`` (the in-memory API server of the
tests) both ask this module, so they cannot disagree: a ResourceSlice's spec in its v1 object form
(plain dicts, lists, strings; ``slice_spec`` gives it for the SDK's ``ResourceSlice``) and a claim's
``status.devices[]`` entries. Each rule names where it comes from: k8s.io/kubernetes
``pkg/apis/resource/validation/validation.go`` (below: validation.go) and k8s.io/api
``resource/v1/types.go`` (types.go); the per-release differences take a ``version``.
"""

from __future__ import annotations

import ipaddress
import json
import re
from collections.abc import Collection, Iterator, Mapping, Sequence
from typing import Any

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
    RequestPolicy,
    ResourceSlice,
    SliceDevice,
)
from devplugin_sdk.types import (
    MAX_ATTRIBUTE_VALUE_BYTES,
    MAX_ATTRIBUTES_AND_CAPACITIES,
    DeviceCondition,
    DeviceStatus,
    NetworkData,
    Quantity,
    Version,
)

__all__ = [
    "LATEST",
    "Problem",
    "claim_status_problems",
    "device_status_problems",
    "slice_problems",
    "slice_spec",
]

#: The newest release whose rules this module knows; MemoryApi validates as it does.
LATEST = "1.37"

#: A rule broken: the field's path inside the object's spec (``devices[3].attributes[model]``;
#: empty for the spec itself) and what is wrong.
Problem = tuple[str, str]


# ------------------------------------------------------------------ ResourceSlice


def slice_problems(spec: Mapping[str, Any], version: str = LATEST) -> list[Problem]:
    """What an API server of ``version`` refuses in a ResourceSlice ``spec`` (v1 form)
    (validation.go ``validateResourceSliceSpec``)."""
    problems = list(_pool_problems(spec))
    devices = list(spec.get("devices") or [])
    counter_sets = list(spec.get("sharedCounters") or [])
    if devices and counter_sets and version >= "1.35":
        # "only one of `sharedCounters` or `devices` is allowed", since 1.35 (KEP-4815 moved
        # the counter sets into slices of their own).
        problems.append(
            (
                "",
                "devices and sharedCounters in one slice: from 1.35 counters go in a slice of "
                "their own",
            )
        )
    problems += _counter_set_problems(counter_sets)
    # ResourceSliceMaxDevices (128), or ResourceSliceMaxDevicesWithTaintsOrConsumesCounters (64)
    # when any device has taints or consumes counters. validateSet stops at the count.
    limited = any(d.get("taints") or d.get("consumesCounters") for d in devices)
    limit = MAX_DEVICES_PER_SLICE_WITH_TAINTS if limited else MAX_DEVICES_PER_SLICE
    if len(devices) > limit:
        why = " (a device has taints or consumes counters)" if limited else ""
        problems.append(("devices", f"{len(devices)} devices: at most {limit} per slice{why}"))
        return problems
    problems += _duplicates("devices", [str(d.get("name", "")) for d in devices], "device name")
    for j, device in enumerate(devices):
        problems += [(f"devices[{j}]{w}", m) for w, m in _device_problems(device, version)]
    return problems


def _pool_problems(spec: Mapping[str, Any]) -> Iterator[Problem]:
    # validateDriverName (a CSI driver name) and validateResourcePool: a pool name of
    # '/'-separated DNS subdomains, resourceSliceCount > 0, generation >= 0.
    driver = str(spec.get("driver", ""))
    problem = _names.driver_name_problem(driver)
    if problem:
        yield "driver", f"{driver!r}: {problem}"
    pool = spec.get("pool") or {}
    name = str(pool.get("name", ""))
    problem = _names.pool_name_problem(name)
    if problem:
        yield "pool.name", f"{name!r}: {problem}"
    if int(pool.get("generation", 0)) < 0:
        yield "pool.generation", "must be >= 0"
    if int(pool.get("resourceSliceCount", 0)) <= 0:
        yield "pool.resourceSliceCount", "must be > 0"


def _duplicates(where: str, keys: Sequence[str], what: str) -> list[Problem]:
    # validateSet: every key once ("Duplicate value").
    seen: set[str] = set()
    problems = []
    for i, key in enumerate(keys):
        if key in seen:
            problems.append((f"{where}[{i}]", f"duplicate {what} {key!r}"))
        seen.add(key)
    return problems


def _counters_problems(where: str, counters: Mapping[str, Any]) -> list[Problem]:
    # validateCounterSet / validateDeviceCounterConsumption: counters required, at most 32
    # (ResourceSliceMaxCountersPerCounterSet, ResourceSliceMaxCountersPerDeviceCounterConsumption;
    # validateMap stops at the count), each name a DNS label (validateCounterName).
    if not counters:
        return [(where, "required: at least one counter")]
    if len(counters) > MAX_COUNTERS_PER_SET:
        return [(where, f"{len(counters)} counters: at most {MAX_COUNTERS_PER_SET} per set")]
    return [
        (f"{where}[{key}]", f"{key!r}: {problem}")
        for key in counters
        if (problem := _names.device_name_problem(str(key)))
    ]


def _counter_set_problems(counter_sets: Sequence[Mapping[str, Any]]) -> list[Problem]:
    # ResourceSliceMaxCounterSets (8; validateSet stops at the count), names unique DNS labels.
    if len(counter_sets) > MAX_COUNTER_SETS_PER_SLICE:
        count = len(counter_sets)
        return [("sharedCounters", f"{count} counter sets: at most {MAX_COUNTER_SETS_PER_SLICE}")]
    names = [str(c.get("name", "")) for c in counter_sets]
    problems = _duplicates("sharedCounters", names, "counter set")
    for k, (name, counter_set) in enumerate(zip(names, counter_sets, strict=True)):
        problem = _names.device_name_problem(name)
        if problem:
            problems.append((f"sharedCounters[{k}].name", f"{name!r}: {problem}"))
        counters = counter_set.get("counters") or {}
        problems += _counters_problems(f"sharedCounters[{k}].counters", counters)
    return problems


def _device_problems(device: Mapping[str, Any], version: str) -> Iterator[Problem]:
    # validateDevice.
    name = str(device.get("name", ""))
    problem = _names.device_name_problem(name)
    if problem:
        yield ".name", f"{name!r}: {problem}"
    attributes: Mapping[str, Any] = device.get("attributes") or {}
    capacity: Mapping[str, Any] = device.get("capacity") or {}
    # ResourceSliceMaxAttributesAndCapacitiesPerDevice (types.go): 32 together.
    if len(attributes) + len(capacity) > MAX_ATTRIBUTES_AND_CAPACITIES:
        yield (
            "",
            f"{len(attributes)} attributes and {len(capacity)} capacities: at most "
            f"{MAX_ATTRIBUTES_AND_CAPACITIES} together",
        )
    for key, value in attributes.items():
        for message in _attribute_problems(str(key), value):
            yield f".attributes[{key}]", message
    multiple = bool(device.get("allowMultipleAllocations"))
    for key, value in capacity.items():
        problem = _names.attribute_name_problem(str(key))
        if problem:
            yield f".capacity[{key}]", problem
        for message in _capacity_problems(value, multiple):
            yield f".capacity[{key}]", message
    yield from _taint_problems(list(device.get("taints") or []), version)
    yield from _consumption_problems(list(device.get("consumesCounters") or []))


def _attribute_problems(key: str, value: Any) -> Iterator[str]:
    # validateQualifiedName and validateDeviceAttribute: exactly one of int, bool, string,
    # version; a string at most 64 bytes, a version semver 2.0.0 of at most 64
    # (DeviceAttributeMaxValueLength).
    problem = _names.attribute_name_problem(key)
    if problem:
        yield problem
    if not isinstance(value, Mapping) or len(value) != 1:
        yield "must have exactly one of int, bool, string, version"
        return
    ((kind, raw),) = value.items()
    if kind == "string" and len(str(raw).encode()) > MAX_ATTRIBUTE_VALUE_BYTES:
        yield f"a string of {len(str(raw).encode())} bytes: at most {MAX_ATTRIBUTE_VALUE_BYTES}"
    elif kind == "version":
        try:
            Version(str(raw))
        except ValueError:
            yield f"{str(raw)[:40]!r} is not a semantic version"
        if len(str(raw)) > MAX_ATTRIBUTE_VALUE_BYTES:
            yield f"a version of {len(str(raw))} characters: at most {MAX_ATTRIBUTE_VALUE_BYTES}"
    elif kind not in ("int", "bool", "string", "version"):
        yield f"{kind!r} is not one of int, bool, string, version"


def _quantity(raw: Any) -> int | None:
    if isinstance(raw, Quantity):  # a typed slice's own (MemoryApi's writes): already valid
        return raw.value
    try:
        return Quantity.parse(str(raw)).value
    except ValueError:
        return None


def _capacity_problems(value: Any, multiple: bool) -> Iterator[str]:
    if not isinstance(value, Mapping) or "value" not in value:
        yield "must be an object with a value"
        return
    total = _quantity(value.get("value"))
    if total is None:
        yield f"value {str(value.get('value'))[:40]!r} is not a quantity"
        return
    policy = value.get("requestPolicy")
    if policy is None:
        return
    if not multiple:
        # validateSingleAllocatableDeviceCapacity: "allowMultipleAllocations must be true". The
        # API server says only that; the policy's own problems are told too, to fix both at once.
        yield "requestPolicy needs allowMultipleAllocations: true"
    yield from _policy_problems(policy, total)


def _policy_problems(policy: Mapping[str, Any], total: int) -> Iterator[str]:
    # validateRequestPolicy: at most one of validValues and validRange; with either, a default
    # (validateValidRequestValues). A policy with neither is not checked further: nothing
    # compares its default with the capacity.
    values, valid_range = policy.get("validValues") or [], policy.get("validRange")
    if values and valid_range is not None:
        yield "requestPolicy: only one of validValues and validRange may be set"
        return
    if not values and valid_range is None:
        return
    raw_default = policy.get("default")
    if raw_default is None:
        yield f"requestPolicy.default is required with {'validValues' if values else 'validRange'}"
        return
    default = _quantity(raw_default)
    if default is None:
        yield f"requestPolicy.default {str(raw_default)[:40]!r} is not a quantity"
        return
    if values:
        yield from _valid_values(values, default, total)
    elif valid_range is not None:
        yield from _valid_range(valid_range, default, total)


def _valid_values(raw: Sequence[Any], default: int, total: int) -> Iterator[str]:
    # validateRequestPolicyValidValues: ascending, at most 10 (CapacityRequestPolicyDiscreteMax-
    # Options; validateSet stops at the count), unique, none past the capacity, the default one
    # of them.
    values = [_quantity(v) for v in raw]
    numbers = [v for v in values if v is not None]
    if len(numbers) != len(values):
        yield "requestPolicy.validValues: every value must be a quantity"
        return
    if numbers != sorted(numbers):
        yield "requestPolicy.validValues: values must be sorted in ascending order"
    if len(numbers) > MAX_VALID_VALUES:
        yield f"requestPolicy.validValues: at most {MAX_VALID_VALUES} values, got {len(numbers)}"
        return
    if len(set(numbers)) != len(numbers):
        yield "requestPolicy.validValues: values must be unique"
    if any(v > total for v in numbers):
        yield "requestPolicy.validValues: a value is larger than the capacity"
    if default not in numbers:
        yield "requestPolicy.default must be one of validValues"


def _valid_range(raw: Mapping[str, Any], default: int, total: int) -> Iterator[str]:
    # validateRequestPolicyRange: min required and at most the capacity, the default at least
    # min; max (if set) at least min, at most the capacity, at least the default; step (if set)
    # > 0 with min + step within the capacity, and the default and max each a multiple of step
    # *from min* (validateRequestPolicyRangeStep: (value - min) % step == 0; types.go: requests
    # round up to "Min + (n * Step)").
    low = _quantity(raw.get("min")) if raw.get("min") is not None else None
    if low is None:
        yield "requestPolicy.validRange.min is required"
        return
    high = _quantity(raw.get("max")) if raw.get("max") is not None else None
    step = _quantity(raw.get("step")) if raw.get("step") is not None else None
    if low > total:
        yield "requestPolicy.validRange.min is larger than the capacity"
    if default < low:
        yield "requestPolicy.default is less than validRange.min"
    if high is not None:
        if low > high:
            yield "requestPolicy.validRange.min is larger than max"
        if high > total:
            yield "requestPolicy.validRange.max is larger than the capacity"
        if default > high:
            yield "requestPolicy.default is larger than validRange.max"
    if step is None:
        return
    if step <= 0:
        yield "requestPolicy.validRange.step must be > 0"
        return
    if low + step > total:
        yield "requestPolicy.validRange.step: min + step is larger than the capacity"
    for what, value in (("default", default), ("validRange.max", high)):
        if value is not None and (value - low) % step:
            yield f"requestPolicy.{what} is not a multiple of step from min"


def _taint_problems(taints: Sequence[Mapping[str, Any]], version: str) -> Iterator[Problem]:
    # DeviceTaintsMaxLength (16; validateSlice stops at the count) and validateDeviceTaint: the
    # key a label name, the value (if any) a label value, the effect NoSchedule or NoExecute,
    # and None from 1.35.
    if len(taints) > MAX_TAINTS_PER_DEVICE:
        yield ".taints", f"{len(taints)} taints: at most {MAX_TAINTS_PER_DEVICE}"
        return
    effects = ("NoSchedule", "NoExecute") + (("None",) if version >= "1.35" else ())
    for k, taint in enumerate(taints):
        key = str(taint.get("key", ""))
        problem = _names.label_name_problem(key)
        if problem:
            yield f".taints[{k}].key", f"{key!r}: {problem}"
        value = str(taint.get("value") or "")
        problem = _names.label_value_problem(value) if value else None
        if problem:
            yield f".taints[{k}].value", f"{value[:70]!r}: {problem}"
        effect = taint.get("effect")
        if effect not in effects:
            yield f".taints[{k}].effect", f"{effect!r}: must be one of {', '.join(effects)}"


def _consumption_problems(consumes: Sequence[Mapping[str, Any]]) -> Iterator[Problem]:
    # ResourceSliceMaxDeviceCounterConsumptionsPerDevice (2; validateSet stops at the count),
    # one entry per counter set, and validateDeviceCounterConsumption: the set's name a DNS
    # label, its counters as a counter set's.
    if len(consumes) > MAX_COUNTER_CONSUMPTIONS_PER_DEVICE:
        limit = MAX_COUNTER_CONSUMPTIONS_PER_DEVICE
        yield ".consumesCounters", f"at most {limit} entries, got {len(consumes)}"
        return
    names = [str(c.get("counterSet", "")) for c in consumes]
    yield from _duplicates(".consumesCounters", names, "counter set")
    for k, (name, consumed) in enumerate(zip(names, consumes, strict=True)):
        problem = _names.device_name_problem(name)
        if problem:
            yield f".consumesCounters[{k}].counterSet", f"{name!r}: {problem}"
        counters = consumed.get("counters") or {}
        yield from _counters_problems(f".consumesCounters[{k}].counters", counters)


def slice_spec(s: ResourceSlice) -> dict[str, Any]:
    """The spec of the SDK's ``ResourceSlice`` in its v1 object form, as the API server
    receives it (what ``slice_problems`` reads)."""
    spec: dict[str, Any] = {
        "driver": s.driver,
        "nodeName": s.node_name,
        "pool": {"name": s.pool, "generation": s.generation, "resourceSliceCount": s.slice_count},
    }
    if s.devices:
        spec["devices"] = [_device_spec(d) for d in s.devices]
    if s.shared_counters:
        spec["sharedCounters"] = [
            {"name": c.name, "counters": _counters_spec(c.counters)} for c in s.shared_counters
        ]
    return spec


def _counters_spec(counters: Mapping[str, Quantity]) -> dict[str, Any]:
    return {key: {"value": amount} for key, amount in counters.items()}


def _device_spec(d: SliceDevice) -> dict[str, Any]:
    kinds = {bool: "bool", int: "int", str: "string", Version: "version"}
    device: dict[str, Any] = {
        "name": d.name,
        "attributes": {
            k: {kinds.get(type(v), type(v).__name__): str(v) if isinstance(v, Version) else v}
            for k, v in d.attributes.items()
        },
        # Quantities stay typed (``_quantity`` takes them as they are): a write of 64 devices
        # would otherwise print and parse every capacity again.
        "capacity": {k: {"value": v} for k, v in d.capacity.items()},
    }
    for key, policy in d.request_policies.items():
        # A policy for a capacity the device lacks has no v1 form: it stands without a value
        # here, which the capacity rule refuses.
        device["capacity"].setdefault(key, {})["requestPolicy"] = _policy_spec(policy)
    if d.allow_multiple_allocations:
        device["allowMultipleAllocations"] = True
    if d.taints:
        device["taints"] = [{"key": t.key, "value": t.value, "effect": t.effect} for t in d.taints]
    if d.consumes_counters:
        device["consumesCounters"] = [
            {"counterSet": c.counter_set, "counters": _counters_spec(c.counters)}
            for c in d.consumes_counters
        ]
    return device


def _policy_spec(policy: RequestPolicy) -> dict[str, Any]:
    out: dict[str, Any] = {"default": policy.default}
    if policy.valid_values:
        out["validValues"] = list(policy.valid_values)
    if policy.minimum is not None:
        bounds = (("min", policy.minimum), ("max", policy.maximum), ("step", policy.step))
        out["validRange"] = {k: v for k, v in bounds if v is not None}
    return out


# ------------------------------------------------------------------ ResourceClaim status

# metav1.Condition (k8s.io/apimachinery meta/v1/validation ValidateConditions): the type a
# qualified name of at most 316 characters, the reason CamelCase of at most 1024, the message at
# most 32768.
_REASON = re.compile(r"[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?")
_TYPE = re.compile(r"([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")


def claim_status_problems(
    allocated: Collection[tuple[str, str, str]], entries: Sequence[ClaimDeviceStatus]
) -> list[Problem]:
    """What the API server refuses in a claim's ``status.devices[]`` (validation.go
    ``validateResourceClaimStatusUpdate``): each entry an allocated device (``allocated``:
    driver, pool, device) given once, and each entry's own rules."""
    problems: list[Problem] = []
    seen: set[tuple[str, str, str]] = set()
    for i, entry in enumerate(entries):
        key = (entry.driver, entry.pool, entry.device)
        if key not in allocated:
            problems.append((f"devices[{i}]", "must be an allocated device in the claim"))
        if key in seen:
            problems.append((f"devices[{i}]", "duplicate value"))
        seen.add(key)
        problems += [(f"devices[{i}]", p) for p in device_status_problems(entry.status)]
    return problems


def device_status_problems(status: DeviceStatus) -> list[str]:
    """What the API server refuses in one device's status (validation.go
    ``validateDeviceStatus``; the limits are types.go's ``AllocatedDeviceStatus``)."""
    problems = []
    if len(status.conditions) > MAX_DEVICE_CONDITIONS:
        problems.append(f"{len(status.conditions)} conditions; at most {MAX_DEVICE_CONDITIONS}")
    types = [c.type for c in status.conditions]
    if len(set(types)) != len(types):
        problems.append("two conditions of one type")
    problems += [p for c in status.conditions if (p := _condition_problem(c))]
    if status.data is not None:
        # validateRawExtension: a JSON object of at most AllocatedDeviceStatusDataMaxLength.
        try:
            size = len(json.dumps(status.data, separators=(",", ":")).encode())
        except (TypeError, ValueError) as exc:
            problems.append(f"data is not JSON: {exc}")
        else:
            if size > MAX_DEVICE_DATA_BYTES:
                problems.append(f"data is {size} bytes as JSON; at most {MAX_DEVICE_DATA_BYTES}")
    if status.network_data is not None:
        problems += _network_problems(status.network_data)
    return problems


def _condition_problem(c: DeviceCondition) -> str | None:
    if not _TYPE.fullmatch(c.type) or len(c.type) > 316:
        return f"condition type {c.type!r} is not a qualified name"
    if c.status not in ("True", "False", "Unknown"):
        return f"condition {c.type}: status must be True, False or Unknown"
    if not _REASON.fullmatch(c.reason) or len(c.reason) > 1024:
        return f"condition {c.type}: reason {c.reason!r} is not CamelCase"
    if len(c.message) > 32768:
        return f"condition {c.type}: message longer than 32768"
    return None


def _network_problems(net: NetworkData) -> list[str]:
    # validateNetworkDeviceData: the interface name and hardware address lengths
    # (NetworkDeviceData*MaxLength), at most 16 IPs (NetworkDeviceDataMaxIPs), each once and an
    # interface address in canonical CIDR form (apimachinery IsValidInterfaceAddress).
    problems = []
    if len(net.interface_name) > MAX_INTERFACE_NAME:
        problems.append(f"interface name longer than {MAX_INTERFACE_NAME}")
    if len(net.hardware_address) > MAX_HARDWARE_ADDRESS:
        problems.append(f"hardware address longer than {MAX_HARDWARE_ADDRESS}")
    if len(net.ips) > MAX_IPS:
        return [*problems, f"{len(net.ips)} IPs; at most {MAX_IPS}"]
    if len(set(net.ips)) != len(net.ips):
        problems.append("an IP is listed twice")
    for ip in net.ips:
        try:
            canonical = str(ipaddress.ip_interface(ip))
        except ValueError:
            canonical = ""
        if "/" not in ip or not canonical:
            problems.append(f"IP {ip!r} is not in CIDR form (address/prefix)")
        elif canonical != ip:
            problems.append(f"IP {ip!r} is not in canonical form ({canonical!r})")
    return problems
