"""The plain data a plugin author works with: devices, what a container gets, health.

Everything here is a frozen dataclass or an enum; hooks receive and return these and never
see protobuf (only ``_convert`` and the gRPC service and registration modules do; an
import-linter contract checks it). A device's typed attributes and capacities (``Version``,
``Quantity``) are what Dynamic Resource Allocation publishes; the device-plugin API has no field
for them.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal, TypeAlias

from devplugin_sdk import _names

__all__ = [
    "Allocation",
    "AttributeValue",
    "Device",
    "DeviceCondition",
    "DeviceNode",
    "DeviceStatus",
    "Effect",
    "Health",
    "HealthEvent",
    "HealthReport",
    "Mount",
    "NetworkData",
    "Partition",
    "Quantity",
    "RescanEvent",
    "Shareable",
    "Version",
    "replicate",
]

# The limits of resource.k8s.io/v1 (ResourceSliceMaxAttributesAndCapacitiesPerDevice,
# DeviceAttributeMaxValueLength): an API server refuses a slice that breaks them.
MAX_ATTRIBUTES_AND_CAPACITIES = 32
MAX_ATTRIBUTE_VALUE_BYTES = 64
_INT64 = (-(2**63), 2**63 - 1)

# Semantic Versioning 2.0.0, as the API server checks a version attribute.
_NUMBER = r"(0|[1-9]\d*)"
_PRERELEASE = r"(0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*)"
_BUILD = r"[0-9a-zA-Z-]+"
_SEMVER = re.compile(
    rf"^{_NUMBER}\.{_NUMBER}\.{_NUMBER}"
    rf"(-{_PRERELEASE}(\.{_PRERELEASE})*)?"
    rf"(\+{_BUILD}(\.{_BUILD})*)?$"
)
_LOOSE_VERSION = re.compile(r"^v?(\d+)(?:\.(\d+))?(?:\.(\d+))?$")


@dataclass(frozen=True, slots=True)
class Version:
    """A semantic version (semver.org 2.0.0), a device attribute that DRA compares as one.

    CEL selectors compare versions by precedence
    (``device.attributes["gpu.acme.com"].driverVersion.isGreaterThan(semver("550.0.0"))``), which a
    string attribute would compare character by character.

    Args:
        text: The version, e.g. ``"12.4.0"`` (at most 64 characters).

    Raises:
        ValueError: ``text`` is not a semantic version.
    """

    text: str

    def __post_init__(self) -> None:
        if not isinstance(self.text, str) or not _SEMVER.match(self.text):
            raise ValueError(f"{self.text!r} is not a semantic version (MAJOR.MINOR.PATCH)")
        if len(self.text.encode()) > MAX_ATTRIBUTE_VALUE_BYTES:
            raise ValueError(f"version {self.text!r} is longer than 64 bytes")

    @classmethod
    def loose(cls, text: str) -> Version:
        """A version from a tool's dotted numbers: ``"12.4"`` is ``12.4.0``, ``"535.104.05"``
        is ``535.104.5`` (semver forbids leading zeros), a leading ``v`` is dropped.

        Raises:
            ValueError: ``text`` is not one to three dotted numbers (or a semantic version).
        """
        text = text.strip()
        if _SEMVER.match(text):
            return cls(text)
        match = _LOOSE_VERSION.match(text)
        if match is None:
            raise ValueError(f"{text!r} is not a version (one to three dotted numbers)")
        return cls(".".join(str(int(part or 0)) for part in match.groups()))

    def __str__(self) -> str:
        return self.text


_BINARY_SUFFIXES = ("Ki", "Mi", "Gi", "Ti", "Pi", "Ei")
_DECIMAL_SUFFIXES = ("k", "M", "G", "T", "P", "E")
# k8s.io/apimachinery pkg/api/resource (quantity.go, suffix.go): <sign><digits>.<digits><suffix>,
# the suffix binary (Ki..Ei: powers of 2), decimal (n, u, m, "", k..E: powers of 10) or an
# exponent ("e" or "E" and a signed integer; "E" alone is exa).
_QUANTITY = re.compile(r"([+-]?)([0-9]*)(?:\.([0-9]*))?([eEinumkKMGTP]*)([+-]?[0-9]*)")
_POWERS_OF_2 = {s: 10 * (i + 1) for i, s in enumerate(_BINARY_SUFFIXES)}
_POWERS_OF_10 = {"n": -9, "u": -6, "m": -3, "": 0} | {
    s: 3 * (i + 1) for i, s in enumerate(_DECIMAL_SUFFIXES)
}
# Past 10**40 no mantissa we accept keeps a value under 2**63; Go parses exponents as int32.
_BIGGEST_EXPONENT = 40


def _quantity_value(text: str) -> int:
    """The whole amount of a Kubernetes quantity: rounded up, as ``Quantity.Value()`` rounds
    it, and a binary one capped at 2**63-1 as ``ParseQuantity`` caps it.

    Raises:
        ValueError: not a quantity, negative, or a decimal one past 2**63-1.
    """
    match = _QUANTITY.fullmatch(text)
    if match is None or not (match.group(2) or match.group(3)):
        raise ValueError(f"{text[:40]!r} is not a quantity such as 80Gi, 1.5Gi, 500m or 12e9")
    sign, whole, fraction, letters, digits = match.groups()
    fraction = fraction or ""
    suffix = letters + digits
    power2, power10 = 0, -len(fraction)
    if suffix in _POWERS_OF_2:
        power2 = _POWERS_OF_2[suffix]
    elif suffix in _POWERS_OF_10:
        power10 += _POWERS_OF_10[suffix]
    elif letters in ("e", "E") and digits.lstrip("+-").isdigit():
        power10 += max(-2 * _BIGGEST_EXPONENT, min(int(digits), 2 * _BIGGEST_EXPONENT))
    else:
        raise ValueError(f"{text[:40]!r} is not a quantity: unknown suffix {suffix[:20]!r}")
    mantissa = int((whole + fraction).lstrip("0") or "0")
    if mantissa and sign == "-":
        raise ValueError(f"Quantity must be between 0 and 2**63-1, got {text[:40]!r}")
    if power10 > _BIGGEST_EXPONENT and mantissa:
        value = _INT64[1] + 1
    elif power10 >= 0:
        value = mantissa * 10**power10 << power2
    else:
        value = -(-(mantissa << power2) // 10**-power10)  # rounded up
    if power2 and value > _INT64[1]:
        return _INT64[1]  # "8Ei" parses as 2**63-1
    return value


@dataclass(frozen=True, slots=True)
class Quantity:
    """A device capacity: a whole, non-negative amount in base units (bytes, counts).

    Published as a Kubernetes resource quantity (``80Gi``), which CEL selectors compare with
    ``device.capacity["gpu.acme.com"].memory.compareTo(quantity("40Gi")) >= 0``.

    Args:
        value: The amount in base units, e.g. ``80 * 2**30`` for 80 GiB.

    Raises:
        ValueError: a negative amount or one past a signed 64-bit integer.
        TypeError: not an ``int``.
    """

    value: int

    def __post_init__(self) -> None:
        if isinstance(self.value, bool) or not isinstance(self.value, int):
            raise TypeError(f"Quantity needs an int, got {type(self.value).__name__}")
        if not 0 <= self.value <= _INT64[1]:
            raise ValueError(f"Quantity must be between 0 and 2**63-1, got {self.value}")

    @classmethod
    def parse(cls, text: str) -> Quantity:
        """A quantity from its Kubernetes spelling (``"80Gi"``, ``"1.5Gi"``, ``"12e9"``,
        ``"500m"``, ``"+1Gi"``), parsed as the API server parses it: a fraction of the base
        unit is rounded up to a whole one (``"500m"`` is 1), as ``Quantity.Value()`` does.

        Raises:
            ValueError: not a Kubernetes quantity, negative, or past 2**63-1.
        """
        return cls(_quantity_value(text))

    def __str__(self) -> str:
        """The shortest exact Kubernetes spelling: ``80Gi``, ``16k``, ``7``."""
        for base, suffixes in ((1024, _BINARY_SUFFIXES), (1000, _DECIMAL_SUFFIXES)):
            value, power = self.value, 0
            while value and value % base == 0 and power < len(suffixes):
                value //= base
                power += 1
            if power:
                return f"{value}{suffixes[power - 1]}"
        return str(self.value)


#: What a device attribute can hold (``resource.k8s.io/v1`` DeviceAttribute): a string of at
#: most 64 bytes, a signed 64-bit integer, a boolean or a semantic version.
AttributeValue: TypeAlias = str | int | bool | Version

_VALID_NAMES: set[str] = set()
_CHECKED: dict[tuple[int, int], tuple[Mapping[str, AttributeValue], Mapping[str, Quantity]]] = {}


def _check_name(device_id: str, what: str, name: object) -> None:
    if name in _VALID_NAMES:
        return
    if not isinstance(name, str):
        raise TypeError(f"Device {device_id!r}: {what} names must be strings, got {name!r}")
    problem = _names.attribute_name_problem(name)
    if problem is not None:
        raise ValueError(f"Device {device_id!r}: invalid {what} name {name!r}: {problem}")
    if len(_VALID_NAMES) < 4096:  # names repeat across devices; the cache stays small
        _VALID_NAMES.add(name)


def _check_attribute(device_id: str, name: str, value: object) -> None:
    _check_name(device_id, "attribute", name)
    if isinstance(value, (bool, Version)):
        return
    if isinstance(value, int):
        if not _INT64[0] <= value <= _INT64[1]:
            raise ValueError(f"Device {device_id!r}: attribute {name} is not a 64-bit integer")
        return
    if isinstance(value, str):
        if len(value.encode()) > MAX_ATTRIBUTE_VALUE_BYTES:
            raise ValueError(
                f"Device {device_id!r}: attribute {name} is longer than "
                f"{MAX_ATTRIBUTE_VALUE_BYTES} bytes: {value[:40]!r}..."
            )
        return
    raise TypeError(
        f"Device {device_id!r}: attribute {name} must be a str, int, bool or Version, "
        f"got {type(value).__name__}"
    )


class Health(str, enum.Enum):
    """A device's health as the kubelet sees it.

    The kubelet compares with the exact string ``"Healthy"``; every other value is unhealthy.
    """

    HEALTHY = "Healthy"
    UNHEALTHY = "Unhealthy"

    def __str__(self) -> str:
        return self.value


class Effect(str, enum.Enum):
    """What a health signal does to the device's use: the effect of the DRA taint it puts on
    the device, and whether the device-plugin API lists the device Unhealthy.

    A backend classifies each signal; the SDK applies the same effect in every channel.
    """

    #: The device works; operators should look. Device plugin: stays Healthy. DRA: a taint
    #: with effect ``None`` (the scheduler ignores it), HEALTHY on the kubelet's health stream
    #: with the reason as message. It lasts ``Settings.advisory_hold`` seconds after the last
    #: such signal, or until the device's health changes.
    ADVISORY = "None"
    #: No new work. Device plugin: Unhealthy. DRA: a ``NoSchedule`` taint (running pods keep the
    #: device, no new claim gets it), UNHEALTHY on the health stream. The default of every
    #: Unhealthy report.
    NO_SCHEDULE = "NoSchedule"
    #: The device cannot serve what runs on it. Device plugin: Unhealthy. DRA: a ``NoExecute``
    #: taint (pods using it are evicted) only when the operator opts in
    #: (``Dra(no_execute=True)``); ``NoSchedule`` otherwise.
    NO_EXECUTE = "NoExecute"

    def __str__(self) -> str:
        return self.value


def _check_effect(health: Health, effect: Effect | None, what: str) -> None:
    """Refuse an effect that contradicts the health it comes with.

    Raises:
        ValueError: naming ``what``.
    """
    if effect is None:
        return
    effect = Effect(effect)
    if (health is Health.HEALTHY) != (effect is Effect.ADVISORY):
        raise ValueError(
            f"{what}: effect {effect.value} does not go with {health.value} (an advisory is "
            "Healthy; NoSchedule and NoExecute are Unhealthy)"
        )


@dataclass(frozen=True, slots=True)
class DeviceNode:
    """A device node to expose in the container (a cgroup device rule plus the node itself).

    Args:
        host_path: Path of the node on the host, e.g. ``/dev/nvidia0``.
        container_path: Path inside the container; defaults to ``host_path``.
        permissions: cgroup access string made of ``r``, ``w`` and ``m``.
    """

    host_path: str
    container_path: str = ""
    permissions: str = "rw"

    def __post_init__(self) -> None:
        if not self.host_path:
            raise ValueError("DeviceNode.host_path must not be empty")
        if not self.permissions or set(self.permissions) - set("rwm"):
            raise ValueError(
                f"DeviceNode.permissions must be made of 'r', 'w' and 'm', got {self.permissions!r}"
            )
        if not self.container_path:
            object.__setattr__(self, "container_path", self.host_path)


@dataclass(frozen=True, slots=True)
class Mount:
    """A bind mount from the host into the container.

    Args:
        host_path: Source path on the host.
        container_path: Target path in the container; defaults to ``host_path``.
        read_only: Mount read-only.
    """

    host_path: str
    container_path: str = ""
    read_only: bool = False

    def __post_init__(self) -> None:
        if not self.host_path:
            raise ValueError("Mount.host_path must not be empty")
        if not self.container_path:
            object.__setattr__(self, "container_path", self.host_path)


@dataclass(frozen=True, slots=True)
class Shareable:
    """How the shares of one physical device reach DRA: as one device several claims take parts of.

    A backend that advertises a device as several shares (time-slicing replicas, memory units,
    slices, each with ``parent`` set to the physical device's ID) sets this on every share. The
    device-plugin API lists the shares as they are; DRA publishes the physical device once, with
    ``allowMultipleAllocations`` and the capacity ``capacity`` of ``unit`` times its shares,
    whose ``requestPolicy`` lets a claim take whole units (KEP-5075, consumable capacity). A
    claim's consumed capacity is turned back into that many shares, whose ``allocate()`` gives
    the container the same limits a pod of the device-plugin API gets for them.

    Args:
        capacity: The capacity claims consume (``memory`` for memory units and slices,
            ``shares`` for time-slicing replicas), a capacity name.
        unit: What one share is worth, in the capacity's base units (1 GiB in bytes, 1).
        most: The most shares one claim may take of one device (1 for slices); None is all.
        whole_by_default: A claim that asks no capacity takes every share (the whole device,
            its ``requestPolicy.default``), as when the shares and the whole device are two
            resources of the device-plugin API (gpushare's memory units and GPU count);
            otherwise it takes one share.

    Raises:
        ValueError: a ``unit`` or ``most`` below 1, an invalid capacity name, or
            ``whole_by_default`` with ``most`` (a claim could not take the whole).
    """

    capacity: str
    unit: int
    most: int | None = None
    whole_by_default: bool = False

    def __post_init__(self) -> None:
        problem = _names.attribute_name_problem(self.capacity)
        if problem is not None:
            raise ValueError(f"Shareable.capacity {self.capacity!r}: {problem}")
        if isinstance(self.unit, bool) or not isinstance(self.unit, int) or self.unit < 1:
            raise ValueError(f"Shareable.unit must be a whole number >= 1, got {self.unit!r}")
        if self.most is not None and self.most < 1:
            raise ValueError(f"Shareable.most must be >= 1 or None, got {self.most!r}")
        if self.whole_by_default and self.most is not None:
            raise ValueError("Shareable.whole_by_default needs most=None: one claim takes all")


@dataclass(frozen=True, slots=True)
class Partition:
    """A device that is a partition of a physical device (a MIG instance), for DRA's counters.

    DRA publishes the ``whole`` device beside its partitions, the ``counters`` in a counter set
    of the whole's own, each partition consuming ``consumes`` of them and the whole consuming
    all: the scheduler then gives either the whole device or partitions of it, never both
    (KEP-4815, partitionable devices). The device-plugin API sees only the partitions.

    Args:
        whole: The physical device, as its plugin's ``allocate()`` gives it whole.
        counters: What the whole device has (``{"memory": Quantity(80 * 2**30)}``); counter
            names are DNS labels.
        consumes: What this partition takes of them.

    Raises:
        ValueError: a counter this partition consumes that the whole does not have, or more
            of one than it has.
    """

    whole: Device
    counters: Mapping[str, Quantity]
    consumes: Mapping[str, Quantity]

    def __post_init__(self) -> None:
        for name, amount in self.consumes.items():
            have = self.counters.get(name)
            if have is None or amount.value > have.value:
                raise ValueError(
                    f"Partition of {self.whole.id!r}: consumes {amount} of counter {name!r}, "
                    f"which the whole device has {have if have is not None else 'none'} of"
                )


@dataclass(frozen=True, slots=True)
class Device:
    """One schedulable unit of a resource, with everything a container needs to use it.

    Args:
        id: The ID the kubelet schedules; unique within the resource, stable across restarts,
            printable, at most 63 characters by convention.
        health: Health as discovered: the device's first health report. A later report
            (an event, a poll, a rescan that sees otherwise) replaces it (see ``DevicePlugin``).
        numa_nodes: NUMA nodes the device is attached to; empty when unknown. Reporting
            topology for any device opts the resource into Topology Manager alignment.
        device_nodes: Device nodes the container gets when this device is allocated.
        mounts: Bind mounts the container gets.
        env: Environment variables the container gets; merged over all allocated devices.
        annotations: Container annotations (passed to the runtime).
        cdi_devices: Fully qualified CDI device names (``vendor.com/class=name``).
        parent: ID of the physical device this one is a share or partition of. A health
            event for the parent applies to this device too.
        attributes: Typed facts about the device (model, UUID, PCI address, driver version):
            ``str`` (at most 64 bytes), ``int``, ``bool`` or ``Version``, by name. A name is a
            C identifier of at most 32 characters, optionally behind a domain and a slash
            (``resource.kubernetes.io/pcieRoot``). Dynamic Resource Allocation publishes them
            in ResourceSlices for CEL selectors and ``matchAttribute`` constraints; the
            device-plugin kubelet never sees them.
        capacity: Amounts the device has (``{"memory": Quantity(80 * 2**30)}``), under the same
            name rules; published by DRA only. Attributes and capacities count together
            against DRA's limit of 32 per device.
        shareable: This device is one share of ``parent``: DRA publishes the parent once, for
            several claims to take shares of (see ``Shareable``).
        partition: This device is a partition of a physical device: DRA publishes both, with
            counters so that never both are allocated (see ``Partition``).
    """

    id: str
    health: Health = Health.HEALTHY
    numa_nodes: tuple[int, ...] = ()
    device_nodes: tuple[DeviceNode, ...] = ()
    mounts: tuple[Mount, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)
    cdi_devices: tuple[str, ...] = ()
    parent: str | None = None
    attributes: Mapping[str, AttributeValue] = field(default_factory=dict)
    capacity: Mapping[str, Quantity] = field(default_factory=dict)
    shareable: Shareable | None = None
    partition: Partition | None = None

    def __post_init__(self) -> None:
        if not self.id:
            raise ValueError("Device.id must not be empty")
        if not self.id.isprintable():
            raise ValueError(f"Device.id must be printable, got {self.id!r}")
        # Accept "Healthy"/"Unhealthy" strings but nothing the kubelet would misread.
        object.__setattr__(self, "health", Health(self.health))
        for name in ("numa_nodes", "device_nodes", "mounts", "cdi_devices"):
            value = getattr(self, name)
            if not isinstance(value, tuple):
                object.__setattr__(self, name, tuple(value))
        if any(n < 0 for n in self.numa_nodes):
            raise ValueError(
                f"Device {self.id!r}: NUMA node IDs must be >= 0, got {self.numa_nodes}"
            )
        if self.attributes or self.capacity:
            # Shares of one device (dataclasses.replace) carry the same mappings: checked once.
            key = (id(self.attributes), id(self.capacity))
            checked = _CHECKED.get(key)
            if (
                checked is None
                or checked[0] is not self.attributes
                or checked[1] is not self.capacity
            ):
                self._check_typed_facts()
                if len(_CHECKED) >= 256:
                    _CHECKED.pop(next(iter(_CHECKED)))
                # The references keep the ids from being reused while they are in the cache.
                _CHECKED[key] = (self.attributes, self.capacity)

    def _check_typed_facts(self) -> None:
        if len(self.attributes) + len(self.capacity) > MAX_ATTRIBUTES_AND_CAPACITIES:
            raise ValueError(
                f"Device {self.id!r}: {len(self.attributes)} attributes and "
                f"{len(self.capacity)} capacities; DRA allows {MAX_ATTRIBUTES_AND_CAPACITIES} "
                "together"
            )
        for name, value in self.attributes.items():
            _check_attribute(self.id, name, value)
        for name, amount in self.capacity.items():
            _check_name(self.id, "capacity", name)
            if not isinstance(amount, Quantity):
                raise TypeError(
                    f"Device {self.id!r}: capacity {name} must be a Quantity, "
                    f"got {type(amount).__name__}"
                )

    @property
    def healthy(self) -> bool:
        """Whether the device is healthy as discovered."""
        return self.health is Health.HEALTHY

    def text(self, name: str) -> str:
        """The string attribute ``name`` (a backend reading back a fact it stored).

        Raises:
            KeyError: the device has no attribute ``name``.
            TypeError: the attribute is not a string.
        """
        value = self.attributes[name]
        if not isinstance(value, str):
            raise TypeError(f"Device {self.id!r}: attribute {name} is {value!r}, not a string")
        return value

    def number(self, name: str) -> int:
        """The integer attribute ``name``.

        Raises:
            KeyError: the device has no attribute ``name``.
            TypeError: the attribute is not an integer.
        """
        value = self.attributes[name]
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"Device {self.id!r}: attribute {name} is {value!r}, not an integer")
        return value


def replicate(devices: Iterable[Device], replicas: int) -> list[Device]:
    """Share each device between ``replicas`` containers (time-slicing).

    Each device becomes ``replicas`` devices with IDs ``<id>::<n>`` (n from 0) carrying the same
    nodes, mounts and env, with ``parent`` set to the original ID so that one health event marks
    every replica. ``replicas == 1`` returns the devices unchanged.

    Raises:
        ValueError: if ``replicas`` is less than 1.
    """
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    out: list[Device] = []
    for device in devices:
        if replicas == 1:
            out.append(device)
            continue
        out.extend(
            replace(device, id=f"{device.id}::{n}", parent=device.parent or device.id)
            for n in range(replicas)
        )
    return out


@dataclass(frozen=True, slots=True)
class Allocation:
    """What one container gets for the devices allocated to it (one Allocate container response).

    Args:
        device_nodes: Device nodes; deduplicated by container path, first wins.
        mounts: Bind mounts; deduplicated by container path, first wins.
        env: Environment variables.
        annotations: Container annotations.
        cdi_devices: Fully qualified CDI device names; deduplicated.
    """

    device_nodes: tuple[DeviceNode, ...] = ()
    mounts: tuple[Mount, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)
    cdi_devices: tuple[str, ...] = ()

    @classmethod
    def merge(cls, devices: Sequence[Device]) -> Allocation:
        """Merge the declared nodes, mounts, env, annotations and CDI names of ``devices``.

        Order is kept; a container path or CDI name seen twice is kept once (the first), as
        the kubelet would do. Env and annotation values of later devices win.
        """
        nodes: dict[str, DeviceNode] = {}
        mounts: dict[str, Mount] = {}
        env: dict[str, str] = {}
        annotations: dict[str, str] = {}
        cdi: dict[str, None] = {}
        for device in devices:
            for node in device.device_nodes:
                nodes.setdefault(node.container_path, node)
            for mount in device.mounts:
                mounts.setdefault(mount.container_path, mount)
            env.update(device.env)
            annotations.update(device.annotations)
            cdi.update(dict.fromkeys(device.cdi_devices))
        return cls(
            device_nodes=tuple(nodes.values()),
            mounts=tuple(mounts.values()),
            env=env,
            annotations=annotations,
            cdi_devices=tuple(cdi),
        )


@dataclass(frozen=True, slots=True)
class HealthEvent:
    """A pushed health change, yielded by ``DevicePlugin.watch``.

    Args:
        device_id: The device's ID, or the ID of a parent: the event then applies to every
            device whose ``parent`` is this ID as well.
        health: The new health.
        reason: Why (e.g. ``"Xid 79"``): the log line, the DRA taint's value and the health
            stream's message say it.
        effect: What it does (``Effect``); None is ``NO_SCHEDULE`` for Unhealthy and nothing
            for Healthy. ``Effect.ADVISORY`` goes with Healthy: the device works, operators
            should look.

    Raises:
        ValueError: an effect that contradicts the health.
    """

    device_id: str
    health: Health
    reason: str = ""
    effect: Effect | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "health", Health(self.health))
        if self.effect is not None:
            object.__setattr__(self, "effect", Effect(self.effect))
        _check_effect(self.health, self.effect, f"HealthEvent for {self.device_id!r}")


@dataclass(frozen=True, slots=True)
class RescanEvent:
    """Ask the SDK to call ``discover()`` again (devices appeared, disappeared or changed).

    Args:
        reason: Why, for the log.
    """

    reason: str = ""


@dataclass(frozen=True, eq=False)
class HealthReport(Mapping[str, Health]):
    """A ``check_health`` answer that says why: health by device or parent ID, with reasons.

    It is the ``Mapping[str, Health]`` that ``check_health`` returns (a plain ``dict`` works as
    well), so callers read it as one. The SDK takes an ID's reason into the log line and the
    observer's ``health_changed`` call when the report changes that device's health; an ID
    without a reason is reported as ``"polled"``. Put the stable cause first and details after
    a colon (``"row remapping pending: 2 rows"``): metrics label changes by the cause.

    Args:
        health: Health by device ID or parent ID.
        reasons: Why, by the same IDs (``"Xid 79 (GPU has fallen off the bus)"``).
        effects: What each report does (``Effect``), by the same IDs; an ID without one is
            ``NO_SCHEDULE`` when Unhealthy and nothing when Healthy.

    Raises:
        ValueError: an effect that contradicts its ID's health, or names an ID without health.
    """

    health: Mapping[str, Health]
    reasons: Mapping[str, str] = field(default_factory=dict)
    effects: Mapping[str, Effect] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "health", {k: Health(v) for k, v in self.health.items()})
        object.__setattr__(self, "reasons", dict(self.reasons))
        effects = {k: Effect(v) for k, v in self.effects.items()}
        for key, effect in effects.items():
            if key not in self.health:
                raise ValueError(f"HealthReport: effect for {key!r}, which has no health")
            _check_effect(self.health[key], effect, f"HealthReport for {key!r}")
        object.__setattr__(self, "effects", effects)

    def __getitem__(self, device_id: str) -> Health:
        return self.health[device_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self.health)

    def __len__(self) -> int:
        return len(self.health)


@dataclass(frozen=True, slots=True)
class NetworkData:
    """A prepared network device's address, for the claim's status (``networkData``).

    Args:
        interface_name: The interface in the pod (or on the host, before it moves), e.g.
            ``eth1``; at most 256 characters.
        ips: Its addresses in CIDR form (``10.0.0.2/24``); at most 16.
        hardware_address: Its MAC (or InfiniBand GUID), at most 128 characters.
    """

    interface_name: str = ""
    ips: tuple[str, ...] = ()
    hardware_address: str = ""


@dataclass(frozen=True, slots=True)
class DeviceCondition:
    """A condition of a prepared device (``status.devices[].conditions[]``, a metav1.Condition).

    Args:
        type: CamelCase (``Ready``); one condition per type.
        status: ``True``, ``False`` or ``Unknown``.
        reason: CamelCase, why.
        message: For people.
    """

    type: str
    status: Literal["True", "False", "Unknown"]
    reason: str
    message: str = ""


@dataclass(frozen=True, slots=True)
class DeviceStatus:
    """What a DRA driver says about one prepared device in its ResourceClaim's status
    (KEP-4817; ``DevicePlugin.device_status`` returns it).

    Args:
        conditions: At most 8.
        data: Free-form JSON for the device's users, at most 10 KiB encoded.
        network_data: The network device's interface and addresses.
    """

    conditions: tuple[DeviceCondition, ...] = ()
    data: Mapping[str, object] | None = None
    network_data: NetworkData | None = None
