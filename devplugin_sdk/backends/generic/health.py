"""A generic device's health, decided from its paths: Healthy while every non-optional path is
present (and nothing else is wrong with it), with the reason in words, at a full scan or pushed the
moment one path comes or goes; and the SDK ``Device`` a unit becomes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from devplugin_sdk.backends import _generic_host as host
from devplugin_sdk.types import AttributeValue, Device, DeviceNode, Health, Mount

__all__: list[str] = []  # nothing public: the scanner and the plugin use these


@dataclass(frozen=True, slots=True)
class _Member:
    """A path of a device: where the plugin reads it and what the container gets."""

    read: str
    host: str
    container: str
    name: str
    mount: bool = False
    permissions: str = "rw"
    read_only: bool = False
    optional: bool = False

    def usable(self) -> bool:
        return host.usable(self.read, directory_ok=self.mount)


@dataclass(frozen=True, slots=True)
class _Unit:
    """One device before sharing (``count``): its paths and what else decides its health."""

    id: str
    members: tuple[_Member, ...]
    problems: tuple[str, ...]
    count: int
    numa_nodes: tuple[int, ...] = ()
    attributes: Mapping[str, AttributeValue] = field(default_factory=dict)


def _state(unit: _Unit) -> tuple[Health, str, frozenset[str]]:
    """A device's health and why, and its optional paths that are gone (one stat per path)."""
    missing: list[str] = []
    absent: set[str] = set()
    for member in unit.members:
        if member.usable():
            continue
        if member.optional:
            absent.add(member.read)
        else:
            missing.append(member.read)
    reasons = list(unit.problems)
    if missing:
        reasons.append(f"{host.first_of(missing)} {_is_are(missing)} missing")
    if reasons:
        return Health.UNHEALTHY, "; ".join(reasons), frozenset(absent)
    required = [m.read for m in unit.members if not m.optional] or [m.read for m in unit.members]
    return (
        Health.HEALTHY,
        f"{host.first_of(required)} {_is_are(required)} present",
        frozenset(absent),
    )


def _pushed(unit: _Unit, changed: str) -> tuple[Health, str]:
    """A device's health after ``changed`` (one of its paths) came or went."""
    missing: list[str] = []
    what = f"{changed} is back"
    for member in unit.members:
        if member.usable():
            continue
        if member.read == changed:
            what = f"{changed} disappeared" + (" (optional)" if member.optional else "")
        if not member.optional:
            missing.append(member.read)
    if changed in missing:
        return Health.UNHEALTHY, what
    problems = list(unit.problems)
    if missing:
        problems.append(f"{host.first_of(missing)} {_is_are(missing)} missing")
    if not problems:
        return Health.HEALTHY, what
    return Health.UNHEALTHY, f"{what}; {'; '.join(problems)}"


def _device(unit: _Unit, health: Health, absent: frozenset[str]) -> Device:
    """The SDK device of a unit; optional paths that are gone are left out."""
    kept = [member for member in unit.members if member.read not in absent]
    return Device(
        id=unit.id,
        health=health,
        numa_nodes=unit.numa_nodes,
        device_nodes=tuple(
            DeviceNode(m.host, m.container, m.permissions) for m in kept if not m.mount
        ),
        mounts=tuple(Mount(m.host, m.container, m.read_only) for m in kept if m.mount),
        attributes=unit.attributes,
    )


def _is_are(items: Sequence[str]) -> str:
    return "is" if len(items) == 1 else "are"
