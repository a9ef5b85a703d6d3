"""Offline checks of ResourceSlices against the resource.k8s.io/v1 rules of Kubernetes 1.34-1.37.

``check_slices`` takes slices in their v1 object form (what ``kubectl get resourceslices -o yaml``
prints, or ``slice_objects`` of the SDK's own) and returns every problem an API server of each
version would refuse (``error``), or would silently drop because the field's feature gate is off
by default there (``warning``). The API server's rules are ``dra._validation``'s, the ones the
in-memory API of the tests applies too (k8s.io/kubernetes ``pkg/apis/resource/validation``: 128
devices per slice, 64 when a device has taints or consumes counters; 32 attributes and capacities
per device; 16 taints, effect ``None`` from 1.35; 8 counter sets of 32 counters, 2
``consumesCounters`` per device, counters in their own slice from 1.35; ``requestPolicy``
``validValues`` and ``validRange`` (default and max a multiple of step from min); the name
formats). This module adds what a pool needs beyond one slice: every slice of its generation,
device names unique across its slices, and counters consumed from sets it publishes.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from devplugin_sdk.dra import _shapes, _validation

__all__ = ["VERSIONS", "Problem", "check_slices", "slice_objects"]

#: The Kubernetes versions checked.
VERSIONS = ("1.34", "1.35", "1.36", _validation.LATEST)

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
    """Every problem of ``slices`` (v1 objects) for each of ``versions``, merged across versions.

    A slice of the wrong shape (an int where a mapping goes: ``dra._shapes``) has one error per
    wrong field, for every version, and is left out of the other checks, which read its fields.
    """
    problems: list[Problem] = []
    shaped = []
    for i, obj in enumerate(slices):
        wrong = _shapes.slice_problems(obj)
        shaped += [] if wrong else [obj]
        meta = obj.get("metadata") if isinstance(obj, Mapping) else None
        name = meta.get("name") if isinstance(meta, Mapping) else None
        label = f"slice {name if isinstance(name, str) else f'#{i}'}"
        problems += [Problem(f"{label}: {key}", why, tuple(versions)) for key, why in wrong]
    found: dict[tuple[str, str, Severity], list[str]] = {}
    for version in versions:
        for where, message, severity in _check_all(shaped, version):
            found.setdefault((where, message, severity), []).append(version)
    return problems + [Problem(w, m, tuple(v), s) for (w, m, s), v in found.items()]


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
    names: dict[str, tuple[int, str]] = {}  # device name -> the first slice listing it
    generations = {int((s.get("pool") or {}).get("generation", 0)) for _, s in members}
    latest = max(generations, default=0)
    current = [m for m in members if int((m[1].get("pool") or {}).get("generation", 0)) == latest]
    for i, (slice_name, spec) in enumerate(current):
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
            # Twice in one slice is the API server's to refuse; across slices, the pool's.
            name = str(device.get("name", ""))
            if names.get(name, (i,))[0] != i:
                yield (
                    f"slice {slice_name}: devices[{j}].name",
                    f"{name} is also in slice {names[name][1]}: names are unique in a pool",
                    "error",
                )
            names.setdefault(name, (i, slice_name))


def _sets_of(spec: Mapping[str, Any]) -> dict[str, set[str]]:
    return {
        str(s.get("name")): set(s.get("counters") or {}) for s in spec.get("sharedCounters") or []
    }


def _check_slice(
    spec: Mapping[str, Any], version: str, sets: Mapping[str, set[str]]
) -> Iterator[tuple[str, str, Severity]]:
    for where, message in _validation.slice_problems(spec, version):
        yield where, message, "error"
    devices = list(spec.get("devices") or [])
    if spec.get("sharedCounters") and version in _ALPHA["counters"]:
        yield "sharedCounters", "dropped: DRAPartitionableDevices is alpha (off)", "warning"
    for j, device in enumerate(devices):
        for where, message, severity in _check_device(device, version, sets):
            yield f"devices[{j}]{where}", message, severity


def _check_device(
    device: Mapping[str, Any], version: str, sets: Mapping[str, set[str]]
) -> Iterator[tuple[str, str, Severity]]:
    """What the API server's rules leave to the pool: fields dropped where their feature is
    alpha, and counters consumed from sets the pool does not publish."""
    if device.get("allowMultipleAllocations") and version in _ALPHA["consumable capacity"]:
        yield ".allowMultipleAllocations", "dropped: DRAConsumableCapacity is alpha", "warning"
    if device.get("taints") and version in _ALPHA["taints"]:
        yield ".taints", "dropped: DRADeviceTaints is alpha (off)", "warning"
    consumes = list(device.get("consumesCounters") or [])
    if consumes and version in _ALPHA["counters"]:
        yield ".consumesCounters", "dropped: DRAPartitionableDevices is alpha", "warning"
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
