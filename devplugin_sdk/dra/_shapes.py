"""The shapes of the resource.k8s.io/v1 objects ``dra check`` and ``dra simulate`` read, checked
before any rule reads a field.

An API server decodes an object into typed structs first (a string where an int goes is refused
with the field's path); the offline commands read YAML written by hand, so they check the same
types here, once, from one table per kind: each wrong shape is one problem naming its dotted key
(``spec.devices[0].capacity.memory``), and the rules after it may trust every field they read.
Unknown fields are left alone, as the API server drops them. Field types follow k8s.io/api
``resource/v1/types.go``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from devplugin_sdk.types import Quantity

__all__ = ["claim_problems", "class_problems", "slice_problems"]

#: A wrong shape: the dotted key and what is wrong.
Problem = tuple[str, str]


@dataclass(frozen=True, slots=True)
class _ListOf:
    item: Any


@dataclass(frozen=True, slots=True)
class _MapOf:
    value: Any


@dataclass(frozen=True, slots=True)
class _Fields:
    fields: Mapping[str, Any]
    required: tuple[str, ...] = ()
    one_of: bool = False  # exactly one field set (a union, as an attribute's value)


_STRING, _INT, _BOOL, _QUANTITY, _ANY = "string", "integer", "boolean", "quantity", "any"

_COUNTERS = _MapOf(_Fields({"value": _QUANTITY}, ("value",)))
_SELECTOR = _Fields({"cel": _Fields({"expression": _STRING}, ("expression",))}, ("cel",))
_POLICY = _Fields(
    {
        "default": _QUANTITY,
        "validValues": _ListOf(_QUANTITY),
        "validRange": _Fields({"min": _QUANTITY, "max": _QUANTITY, "step": _QUANTITY}),
    }
)
_DEVICE = _Fields(
    {
        "name": _STRING,
        "attributes": _MapOf(
            _Fields(
                {"int": _INT, "bool": _BOOL, "string": _STRING, "version": _STRING}, one_of=True
            )
        ),
        "capacity": _MapOf(_Fields({"value": _QUANTITY, "requestPolicy": _POLICY}, ("value",))),
        "consumesCounters": _ListOf(
            _Fields({"counterSet": _STRING, "counters": _COUNTERS}, ("counterSet",))
        ),
        "taints": _ListOf(
            _Fields({"key": _STRING, "value": _STRING, "effect": _STRING}, ("key", "effect"))
        ),
        "allowMultipleAllocations": _BOOL,
        "nodeName": _STRING,
        "allNodes": _BOOL,
    },
    ("name",),
)
_SLICE = _Fields(
    {
        "metadata": _Fields({"name": _STRING}),
        "spec": _Fields(
            {
                "driver": _STRING,
                "nodeName": _STRING,
                "allNodes": _BOOL,
                "pool": _Fields(
                    {"name": _STRING, "generation": _INT, "resourceSliceCount": _INT},
                    ("name",),
                ),
                "devices": _ListOf(_DEVICE),
                "sharedCounters": _ListOf(
                    _Fields({"name": _STRING, "counters": _COUNTERS}, ("name",))
                ),
                "perDeviceNodeSelection": _BOOL,
            },
            ("driver", "pool"),
        ),
    },
    ("spec",),
)
_EXACT_FIELDS = {
    "deviceClassName": _STRING,
    "selectors": _ListOf(_SELECTOR),
    "allocationMode": _STRING,
    "count": _INT,
    "adminAccess": _BOOL,
    "capacity": _Fields({"requests": _MapOf(_QUANTITY)}),
}
_CLAIM_SPEC = _Fields(
    {
        "devices": _Fields(
            {
                "requests": _ListOf(
                    _Fields(
                        {
                            "name": _STRING,
                            "exactly": _Fields(_EXACT_FIELDS, ("deviceClassName",)),
                            "firstAvailable": _ListOf(
                                _Fields(
                                    {**_EXACT_FIELDS, "name": _STRING},
                                    ("name", "deviceClassName"),
                                )
                            ),
                        },
                        ("name",),
                    )
                ),
                "constraints": _ListOf(
                    _Fields({"requests": _ListOf(_STRING), "matchAttribute": _STRING})
                ),
            }
        )
    }
)
_CLAIM = _Fields({"metadata": _Fields({"name": _STRING}), "spec": _CLAIM_SPEC}, ("spec",))
_TEMPLATE = _Fields(
    {"metadata": _Fields({"name": _STRING}), "spec": _Fields({"spec": _CLAIM_SPEC}, ("spec",))},
    ("spec",),
)
_CLASS = _Fields(
    {"metadata": _Fields({"name": _STRING}), "spec": _Fields({"selectors": _ListOf(_SELECTOR)})}
)


def slice_problems(obj: object) -> list[Problem]:
    """The wrong shapes of a ResourceSlice (the whole v1 object)."""
    return list(_walk(obj, _SLICE, ""))


def claim_problems(obj: object) -> list[Problem]:
    """The wrong shapes of a ResourceClaim or ResourceClaimTemplate (the whole v1 object)."""
    template = isinstance(obj, Mapping) and obj.get("kind") == "ResourceClaimTemplate"
    return list(_walk(obj, _TEMPLATE if template else _CLAIM, ""))


def class_problems(obj: object) -> list[Problem]:
    """The wrong shapes of a DeviceClass (the whole v1 object)."""
    return list(_walk(obj, _CLASS, ""))


def _walk(value: object, shape: Any, key: str) -> Iterator[Problem]:
    """Each wrong shape under ``key``, one per field: below a wrong one nothing more is said."""
    if value is None or shape == _ANY:
        return  # null is "unset" in the API's JSON
    if isinstance(shape, str):
        problem = _scalar_problem(value, shape)
        if problem is not None:
            yield key, problem
    elif isinstance(shape, _ListOf):
        if not isinstance(value, list):
            yield key, f"must be a list, got {_shown(value)}"
            return
        for i, item in enumerate(value):
            yield from _walk(item, shape.item, f"{key}[{i}]")
    elif not isinstance(value, Mapping):
        yield key or "<document>", f"must be a mapping, got {_shown(value)}"
    else:
        yield from _walk_mapping(value, shape, key)


def _walk_mapping(value: Mapping[Any, Any], shape: _MapOf | _Fields, key: str) -> Iterator[Problem]:
    if isinstance(shape, _MapOf):
        for name, item in value.items():
            if not isinstance(name, str):
                yield key, f"keys must be strings, got {_shown(name)}"
                return
            yield from _walk(item, shape.value, f"{key}.{name}" if key else name)
        return
    for name in shape.required:
        if value.get(name) is None:
            yield (f"{key}.{name}" if key else name), "is required"
    if shape.one_of and sum(value.get(name) is not None for name in shape.fields) != 1:
        yield key, f"must have exactly one of {', '.join(shape.fields)}"
        return
    for name, inner in shape.fields.items():
        yield from _walk(value.get(name), inner, f"{key}.{name}" if key else name)


def _scalar_problem(value: object, kind: str) -> str | None:
    if kind == _STRING:
        ok = isinstance(value, str)
    elif kind == _INT:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif kind == _BOOL:
        ok = isinstance(value, bool)
    else:  # a quantity: a string (or a plain number) Kubernetes' parser takes
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            return f"must be a quantity (1, 500m, 40Gi), got {_shown(value)}"
        try:
            Quantity.parse(str(value))
        except (ValueError, OverflowError):
            return f"is not a quantity (1, 500m, 40Gi): {_shown(value)}"
        return None
    return None if ok else f"must be {'an' if kind == _INT else 'a'} {kind}, got {_shown(value)}"


def _shown(value: object) -> str:
    if isinstance(value, (Mapping, list)):
        return f"a {'mapping' if isinstance(value, Mapping) else 'list'} of {len(value)} items"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
