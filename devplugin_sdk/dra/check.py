"""Offline checks of ResourceSlices against the resource.k8s.io/v1 rules of Kubernetes 1.34-1.37.

``check_slices`` takes slices in their v1 object form (what ``kubectl get resourceslices -o yaml``
prints, or ``slice_objects`` of the SDK's own) and returns every problem an API server of each
version would refuse (``error``), or would silently drop because the field's feature gate is off
by default there (``warning``). The rules are k8s.io/kubernetes
``pkg/apis/resource/validation/validation.go`` and ``resource/v1/types.go`` as of 1.37: 128
devices per slice, 64 when a device has taints or consumes counters; 32 attributes and capacities
per device; 16 taints, effect ``None`` from 1.35; 8 counter sets of 32 counters, 2
``consumesCounters`` per device, counters in their own slice from 1.35; ``requestPolicy``
``validValues`` (sorted, at most 10, holding the default) and ``validRange`` (default and max a
multiple of step from min); and the name formats.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from devplugin_sdk import _names
from devplugin_sdk.dra.resources import (
    MAX_DEVICES_PER_SLICE,
    MAX_DEVICES_PER_SLICE_WITH_TAINTS,
    MAX_TAINTS_PER_DEVICE,
)
from devplugin_sdk.types import Quantity, Version

__all__ = ["VERSIONS", "Problem", "check_slices", "slice_objects"]

#: The Kubernetes versions checked.
VERSIONS = ("1.34", "1.35", "1.36", "1.37")

#: ResourceSliceMaxAttributesAndCapacitiesPerDevice.
MAX_ATTRIBUTES_AND_CAPACITIES = 32
#: ResourceSliceMaxCounterSets and ResourceSliceMaxCountersPerCounterSet.
MAX_COUNTER_SETS = 8
MAX_COUNTERS_PER_SET = 32
#: ResourceSliceMaxDeviceCounterConsumptionsPerDevice.
MAX_CONSUMES_COUNTERS = 2
#: CapacityRequestPolicyDiscreteMaxOptions.
MAX_VALID_VALUES = 10
#: DeviceAttributeMaxValueLength: string and version attributes.
MAX_ATTRIBUTE_VALUE = 64

# Where a feature is alpha (its gate off by default): an API server drops the field.
_ALPHA = {
    "taints": ("1.34", "1.35"),  # DRADeviceTaints: beta and on from 1.36
    "counters": ("1.34", "1.35"),  # DRAPartitionableDevices
    "consumable capacity": ("1.34", "1.35"),  # DRAConsumableCapacity
}

Severity = Literal["error", "warning"]


@dataclass(frozen=True, slots=True)
class Problem:
    """One thing an API server would refuse (``error``) or drop (``warning``).

    Attributes:
        where: The slice and the field path (``slice gpu-0: devices[3].attributes[model]``).
        message: What is wrong.
        versions: The Kubernetes versions it holds for.
        severity: ``error`` or ``warning``.
    """

    where: str
    message: str
    versions: tuple[str, ...]
    severity: Severity = "error"

    def __str__(self) -> str:
        versions = (
            "all versions"
            if self.versions == VERSIONS
            else "Kubernetes " + ", ".join(self.versions)
        )
        return f"{self.severity}: {self.where}: {self.message} ({versions})"


def check_slices(
    slices: Sequence[Mapping[str, Any]], versions: Sequence[str] = VERSIONS
) -> list[Problem]:
    """Every problem of ``slices`` (v1 objects) for each of ``versions``, merged across versions."""
    found: dict[tuple[str, str, Severity], list[str]] = {}
    for version in versions:
        for where, message, severity in _check_all(slices, version):
            found.setdefault((where, message, severity), []).append(version)
    return [Problem(w, m, tuple(v), s) for (w, m, s), v in found.items()]


def _check_all(
    slices: Sequence[Mapping[str, Any]], version: str
) -> Iterator[tuple[str, str, Severity]]:
    pools: dict[tuple[str, str], list[tuple[str, Mapping[str, Any]]]] = {}
    for i, obj in enumerate(slices):
        spec = obj.get("spec") or {}
        name = (obj.get("metadata") or {}).get("name") or f"#{i}"
        pool = (spec.get("pool") or {}).get("name", "")
        pools.setdefault((str(spec.get("driver", "")), str(pool)), []).append((str(name), spec))
    for members in pools.values():
        yield from _check_pool(members, version)


def _check_pool(
    members: list[tuple[str, Mapping[str, Any]]], version: str
) -> Iterator[tuple[str, str, Severity]]:
    pool_sets: dict[str, set[str]] = {}
    for _, spec in members:
        for counter_set in spec.get("sharedCounters") or []:
            pool_sets[str(counter_set.get("name"))] = set(counter_set.get("counters") or {})
    names: dict[str, str] = {}
    generations = {int((s.get("pool") or {}).get("generation", 0)) for _, s in members}
    latest = max(generations, default=0)
    current = [m for m in members if int((m[1].get("pool") or {}).get("generation", 0)) == latest]
    for slice_name, spec in current:
        count = (spec.get("pool") or {}).get("resourceSliceCount")
        if count != len(current):
            yield (
                f"slice {slice_name}",
                f"pool.resourceSliceCount is {count} but the pool has {len(current)} slices "
                f"of generation {latest}: the scheduler waits for the missing ones",
                "error",
            )
        sets = pool_sets if version >= "1.35" else _sets_of(spec)
        for where, message, severity in _check_slice(spec, version, sets):
            yield (
                f"slice {slice_name}: {where}" if where else f"slice {slice_name}",
                message,
                severity,
            )
        for j, device in enumerate(spec.get("devices") or []):
            name = str(device.get("name", ""))
            if name in names:
                yield (
                    f"slice {slice_name}: devices[{j}].name",
                    f"{name} is also in slice {names[name]}: names are unique in a pool",
                    "error",
                )
            names.setdefault(name, slice_name)


def _sets_of(spec: Mapping[str, Any]) -> dict[str, set[str]]:
    return {
        str(s.get("name")): set(s.get("counters") or {}) for s in spec.get("sharedCounters") or []
    }


def _check_slice(
    spec: Mapping[str, Any], version: str, sets: Mapping[str, set[str]]
) -> Iterator[tuple[str, str, Severity]]:
    driver = str(spec.get("driver", ""))
    problem = _names.driver_name_problem(driver)
    if problem:
        yield "driver", f"{driver!r}: {problem}", "error"
    pool = str((spec.get("pool") or {}).get("name", ""))
    problem = _names.pool_name_problem(pool)
    if problem:
        yield "pool.name", f"{pool!r}: {problem}", "error"
    devices = list(spec.get("devices") or [])
    counter_sets = list(spec.get("sharedCounters") or [])
    if devices and counter_sets and version >= "1.35":
        yield (
            "",
            "devices and sharedCounters in one slice: from 1.35 counters go in a slice of "
            "their own",
            "error",
        )
    if counter_sets and version in _ALPHA["counters"]:
        yield "sharedCounters", "dropped: DRAPartitionableDevices is alpha (off)", "warning"
    yield from _check_counter_sets(counter_sets)
    limited = any(d.get("taints") or d.get("consumesCounters") for d in devices)
    limit = MAX_DEVICES_PER_SLICE_WITH_TAINTS if limited else MAX_DEVICES_PER_SLICE
    if len(devices) > limit:
        why = " (a device has taints or consumes counters)" if limited else ""
        yield "devices", f"{len(devices)} devices: at most {limit} per slice{why}", "error"
        return  # the API server stops at the count
    for j, device in enumerate(devices):
        for where, message, severity in _check_device(device, version, sets):
            yield f"devices[{j}]{where}", message, severity


def _check_counter_sets(
    counter_sets: list[Mapping[str, Any]],
) -> Iterator[tuple[str, str, Severity]]:
    if len(counter_sets) > MAX_COUNTER_SETS:
        yield (
            "sharedCounters",
            f"{len(counter_sets)} counter sets: at most {MAX_COUNTER_SETS}",
            "error",
        )
        return
    for k, counter_set in enumerate(counter_sets):
        name = str(counter_set.get("name", ""))
        problem = _names.device_name_problem(name)
        if problem:
            yield f"sharedCounters[{k}].name", f"{name!r}: {problem}", "error"
        counters = counter_set.get("counters") or {}
        if len(counters) > MAX_COUNTERS_PER_SET:
            yield (
                f"sharedCounters[{k}].counters",
                f"{len(counters)} counters: at most {MAX_COUNTERS_PER_SET} per set",
                "error",
            )


def _check_device(
    device: Mapping[str, Any], version: str, sets: Mapping[str, set[str]]
) -> Iterator[tuple[str, str, Severity]]:
    name = str(device.get("name", ""))
    problem = _names.device_name_problem(name)
    if problem:
        yield ".name", f"{name!r}: {problem}", "error"
    attributes: Mapping[str, Any] = device.get("attributes") or {}
    capacity: Mapping[str, Any] = device.get("capacity") or {}
    if len(attributes) + len(capacity) > MAX_ATTRIBUTES_AND_CAPACITIES:
        yield (
            "",
            f"{len(attributes)} attributes and {len(capacity)} capacities: at most "
            f"{MAX_ATTRIBUTES_AND_CAPACITIES} together",
            "error",
        )
    for key, value in attributes.items():
        for message in _attribute_problems(str(key), value):
            yield f".attributes[{key}]", message, "error"
    multiple = bool(device.get("allowMultipleAllocations"))
    if multiple and version in _ALPHA["consumable capacity"]:
        yield ".allowMultipleAllocations", "dropped: DRAConsumableCapacity is alpha", "warning"
    for key, value in capacity.items():
        problem = _names.attribute_name_problem(str(key))
        if problem:
            yield f".capacity[{key}]", problem, "error"
        for message in _capacity_problems(value):
            yield f".capacity[{key}]", message, "error"
    yield from _check_taints(device.get("taints") or [], version)
    yield from _check_consumes(list(device.get("consumesCounters") or []), version, sets)


def _check_consumes(
    consumes: list[Mapping[str, Any]], version: str, sets: Mapping[str, set[str]]
) -> Iterator[tuple[str, str, Severity]]:
    if consumes and version in _ALPHA["counters"]:
        yield ".consumesCounters", "dropped: DRAPartitionableDevices is alpha", "warning"
    if len(consumes) > MAX_CONSUMES_COUNTERS:
        yield (
            ".consumesCounters",
            f"{len(consumes)} entries: at most {MAX_CONSUMES_COUNTERS}",
            "error",
        )
    for k, consumed in enumerate(consumes):
        set_name = str(consumed.get("counterSet", ""))
        where = "this slice" if version < "1.35" else "the pool"
        if set_name not in sets:
            yield (
                f".consumesCounters[{k}].counterSet",
                f"{set_name!r} is not a counter set of {where}",
                "error",
            )
            continue
        for counter in consumed.get("counters") or {}:
            if counter not in sets[set_name]:
                yield (
                    f".consumesCounters[{k}].counters[{counter}]",
                    f"counter set {set_name} has no counter {counter}",
                    "error",
                )


def _attribute_problems(key: str, value: Any) -> Iterator[str]:
    problem = _names.attribute_name_problem(key)
    if problem:
        yield problem
    if not isinstance(value, Mapping) or len(value) != 1:
        yield "must have exactly one of int, bool, string, version"
        return
    ((kind, raw),) = value.items()
    if kind == "string" and len(str(raw).encode()) > MAX_ATTRIBUTE_VALUE:
        yield f"a string of {len(str(raw).encode())} bytes: at most {MAX_ATTRIBUTE_VALUE}"
    elif kind == "version":
        try:
            Version(str(raw))
        except ValueError:
            yield f"{str(raw)[:40]!r} is not a semantic version"
        if len(str(raw)) > MAX_ATTRIBUTE_VALUE:
            yield f"a version of {len(str(raw))} characters: at most {MAX_ATTRIBUTE_VALUE}"
    elif kind not in ("int", "bool", "string", "version"):
        yield f"{kind!r} is not one of int, bool, string, version"


def _quantity(raw: Any) -> int | None:
    try:
        return Quantity.parse(str(raw)).value
    except ValueError:
        return None


def _capacity_problems(value: Any) -> Iterator[str]:
    if not isinstance(value, Mapping):
        yield "must be an object with a value"
        return
    total = _quantity(value.get("value"))
    if total is None:
        yield f"value {str(value.get('value'))[:40]!r} is not a quantity"
        return
    policy = value.get("requestPolicy")
    if policy is None:
        return
    default = _quantity(policy.get("default")) if policy.get("default") is not None else None
    if policy.get("validValues") is not None:
        yield from _valid_values(policy["validValues"], default, total)
    elif policy.get("validRange") is not None:
        yield from _valid_range(policy["validRange"], default, total)


def _valid_values(raw: Any, default: int | None, total: int) -> Iterator[str]:
    values = [_quantity(v) for v in raw]
    if any(v is None for v in values):
        yield "requestPolicy.validValues: every value must be a quantity"
        return
    numbers = [v for v in values if v is not None]
    if len(numbers) > MAX_VALID_VALUES:
        yield f"requestPolicy.validValues: {len(numbers)} values, at most {MAX_VALID_VALUES}"
    if numbers != sorted(numbers):
        yield "requestPolicy.validValues: values must be sorted in ascending order"
    if len(set(numbers)) != len(numbers):
        yield "requestPolicy.validValues: values must be unique"
    if any(v > total for v in numbers):
        yield "requestPolicy.validValues: a value is larger than the capacity"
    if default not in numbers:
        yield "requestPolicy.default must be one of validValues"


def _valid_range(raw: Mapping[str, Any], default: int | None, total: int) -> Iterator[str]:
    low = _quantity(raw.get("min")) if raw.get("min") is not None else None
    if low is None:
        yield "requestPolicy.validRange.min is required"
        return
    high = _quantity(raw.get("max")) if raw.get("max") is not None else None
    step = _quantity(raw.get("step")) if raw.get("step") is not None else None
    if low > total:
        yield "requestPolicy.validRange.min is larger than the capacity"
    if default is not None and default < low:
        yield "requestPolicy.default is less than validRange.min"
    if high is not None and low > high:
        yield "requestPolicy.validRange.min is larger than max"
    if high is not None and default is not None and default > high:
        yield "requestPolicy.default is larger than validRange.max"
    if step is not None and step > 0:
        for what, value in (("default", default), ("validRange.max", high)):
            if value is not None and (value - low) % step:
                yield f"requestPolicy.{what} is not a multiple of step from min"
    elif step is not None:
        yield "requestPolicy.validRange.step must be > 0"


def _check_taints(
    taints: list[Mapping[str, Any]], version: str
) -> Iterator[tuple[str, str, Severity]]:
    if not taints:
        return
    if version in _ALPHA["taints"]:
        yield ".taints", "dropped: DRADeviceTaints is alpha (off)", "warning"
    if len(taints) > MAX_TAINTS_PER_DEVICE:
        yield ".taints", f"{len(taints)} taints: at most {MAX_TAINTS_PER_DEVICE}", "error"
        return
    effects = ("NoSchedule", "NoExecute") + (("None",) if version >= "1.35" else ())
    for k, taint in enumerate(taints):
        key = str(taint.get("key", ""))
        problem = _names.label_name_problem(key)
        if problem:
            yield f".taints[{k}].key", f"{key!r}: {problem}", "error"
        value = str(taint.get("value", ""))
        problem = _names.label_value_problem(value) if value else None
        if problem:
            yield f".taints[{k}].value", f"{value[:70]!r}: {problem}", "error"
        effect = taint.get("effect")
        if effect not in effects:
            yield (
                f".taints[{k}].effect",
                f"{effect!r}: must be one of {', '.join(effects)}",
                "error",
            )


def slice_objects(slices: Sequence[Any]) -> list[dict[str, Any]]:
    """The SDK's ``ResourceSlice``s as v1 objects (the form ``check_slices`` reads), through the
    same conversion the driver writes them with (the ``dra`` extra's lightkube models)."""
    from devplugin_sdk.dra import _kube  # noqa: PLC0415 - the optional extra

    out = []
    for s in slices:
        obj: dict[str, Any] = _kube.slice_to_kube(s).to_dict()
        obj.setdefault("metadata", {})["name"] = s.name
        out.append(obj)
    return out
