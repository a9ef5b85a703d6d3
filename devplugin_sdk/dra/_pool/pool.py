"""What the pool publishes: every device DRA gets from the attached plugins, as a slice device
with its taints (from the engine's one condition), its health for the kubelet's stream, and its
``Found`` (the plugin that serves it, as the claims side looks it up by its name in the slices);
shares of one physical device as that device, partitions with their whole device and its
counter set (``shares.py``). ``Plugins`` says which plugins are attached; this module decides
what they make.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from devplugin_sdk import _names
from devplugin_sdk._wire.dra_model import HealthStatus
from devplugin_sdk.dra import Dra, device_name
from devplugin_sdk.dra._deviceclass import tag
from devplugin_sdk.dra._pool import shares as _shares
from devplugin_sdk.dra._pool.health import status_of
from devplugin_sdk.dra.resources import CounterSet, DeviceTaint, SliceDevice
from devplugin_sdk.types import Device, Effect, Health

if TYPE_CHECKING:
    from devplugin_sdk._engine.conditions import Condition
    from devplugin_sdk._engine.handle import PluginHandle
    from devplugin_sdk.plugin import DevicePlugin

__all__ = ["Found", "Member", "Pool", "build", "taints"]

log = logging.getLogger("devplugin_sdk")


@dataclass(frozen=True, slots=True)
class Found:
    """A published device: the plugin that serves it, the device and its health now; for a
    shared device its shares, for a whole device the names of its partitions, for a partition
    the name of its whole device (``dra/_pool/shares.py``)."""

    resource: str
    plugin: DevicePlugin
    device: Device
    health: Health
    shares: tuple[Device, ...] = ()
    parts: tuple[str, ...] = ()
    whole: str | None = None


@dataclass(frozen=True, slots=True)
class Member:
    """A device of an attached plugin that DRA gets; ``stopped``: its plugin stopped (within
    the detach grace), so its health is unknown."""

    resource: str
    plugin: PluginHandle
    device: Device
    stopped: bool

    def condition(self) -> Condition:
        return self.plugin.state.condition_of(self.device.id)


def build(options: Dra, members: Iterable[Member], *, several: bool, said: set[str]) -> Pool:
    """The pool ``members`` make (in their order; the first of a duplicate DRA name wins).

    The shares of one physical device (``Device.shareable``) become that one device, which
    also stands for that device when another resource serves it whole; a partition
    (``Device.partition``) is published with its whole device and their counter set
    (``dra/_claims/shares.py`` says what a claim holding one gets). ``several``: the pool holds
    the devices of several resources; ``said``: the duplicate names and refused devices already
    logged, kept by the caller across builds so that each is said once. A device whose
    description cannot be published (a share unit past a Kubernetes quantity) is left out alone.
    """
    pool = Pool(options, several=several, said=said)
    members = list(members)
    shared: dict[str, list[Member]] = {}
    wholes: dict[str, list[Member]] = {}
    for member in members:
        device = member.device
        if device.shareable is not None and device.parent is not None:
            shared.setdefault(device.parent, []).append(member)
    for member in members:
        device = member.device
        if device.shareable is not None and device.parent is not None:
            continue
        if device.partition is None and device.id in shared:
            # The device its own shares divide, served as a resource of its own too (gpushare's
            # GPU count beside its memory units): in DRA they are one device, and a claim that
            # asks no capacity of it takes the whole.
            pool.whole_of_shares(member, shared[device.id][0])
            continue
        name = device_name(device.id)
        partition = device.partition
        if partition is None:
            pool.offer(name, [member], SliceDevice(name, device.attributes, device.capacity))
            continue
        counters = device_name(partition.whole.id)
        wholes.setdefault(partition.whole.id, []).append(member)
        pool.offer(name, [member], _shares.partition_device(name, device, counters), whole=counters)
    for parent, sharing in shared.items():
        name = device_name(parent)
        devices = tuple(m.device for m in sharing)
        shown = replace(devices[0], id=parent, shareable=None, parent=None)
        try:
            published = _shares.shared_device(name, devices)
        except ValueError as exc:
            pool.refuse(sharing[0].resource, parent, exc)
            continue
        pool.offer(name, sharing, published, shown, shares=devices)
    for parts in wholes.values():
        partition = parts[0].device.partition
        assert partition is not None
        name = device_name(partition.whole.id)
        published = _shares.whole_device(name, partition, name)
        names = tuple(device_name(m.device.id) for m in parts)
        if pool.offer(name, parts, published, partition.whole, parts=names):
            pool.counter_sets.append(_shares.counter_set(name, partition))
    return pool


class Pool:
    """The pool being built: the devices offered, their ``Found`` and health, counter sets.

    Args:
        options: The driver's options (its name, whether ``NoExecute`` taints are allowed).
        several: Several resources in one pool: each device names its resource (its
            DeviceClass).
        said: DRA names already logged as duplicates (added to).
    """

    def __init__(self, options: Dra, *, several: bool, said: set[str]) -> None:
        self.options = options
        self.found: dict[str, Found] = {}
        self.offered: list[SliceDevice] = []
        self.counter_sets: list[CounterSet] = []
        self.health: dict[str, tuple[HealthStatus, str]] = {}
        self.several = several
        self._said = said

    def offer(
        self,
        name: str,
        members: Sequence[Member],
        published: SliceDevice,
        device: Device | None = None,
        **found: Any,
    ) -> bool:
        """Publish ``published`` for ``members`` (one device, or the shares or partitions
        behind it; the first unhealthy one speaks for all); False for a duplicate name."""
        first = next((m for m in members if m.stopped), None) or next(
            (m for m in members if m.condition().health is not Health.HEALTHY), members[0]
        )
        if name in self.found:
            self._duplicate(name, first.resource, first.device.id, self.found[name])
            return False
        condition = first.condition()
        shown = device if device is not None else first.device
        self.found[name] = Found(
            first.resource, first.plugin.plugin, shown, condition.health, **found
        )
        attributes = tag(
            published.attributes, published.capacity, first.resource, several=self.several
        )
        self.offered.append(
            replace(published, attributes=attributes, taints=taints(self.options, condition))
        )
        self.health[name] = (
            ("UNKNOWN", f"the plugin of {first.resource} stopped")
            if first.stopped
            else status_of(condition)
        )
        return True

    def refuse(self, resource: str, device_id: str, exc: ValueError) -> None:
        """Leave device ``device_id`` of ``resource`` out: its description cannot be published
        (``exc`` names the field); said once, the other devices published as usual."""
        key = f"{resource}\0{device_id}"
        if key in self._said:
            return
        self._said.add(key)
        log.error(
            "DRA %s: device %s of %s is left out of the pool: %s",
            self.options.driver,
            device_id,
            resource,
            exc,
        )

    def whole_of_shares(self, whole: Member, share: Member) -> None:
        """Leave ``whole`` out: the shared device of ``share`` (one of its shares) stands for it.
        Said once per pair of resources, at info."""
        key = f"{whole.resource}\0whole\0{share.resource}"
        if key in self._said:
            return
        self._said.add(key)
        log.info(
            "DRA %s: the devices of %s are the shared devices of %s (device %s, say): published "
            "once; a claim that asks no capacity takes the whole device",
            self.options.driver,
            whole.resource,
            share.resource,
            device_name(whole.device.id),
        )

    def _duplicate(self, name: str, resource: str, device_id: str, first: Found) -> None:
        if name in self._said:
            return
        self._said.add(name)
        log.error(
            "DRA %s: device %s of %s has the same DRA name %s as device %s of %s; only the "
            "first is published",
            self.options.driver,
            device_id,
            resource,
            name,
            first.device.id,
            first.resource,
        )


def taints(options: Dra, condition: Condition) -> tuple[DeviceTaint, ...]:
    """The taint a device in ``condition`` carries: none when Healthy with nothing to say;
    its key in the driver's domain, the reason's cause as value, ``NoExecute`` only when the
    operator opted in."""
    effect = condition.effect
    if effect is None:
        return ()
    if effect is Effect.NO_EXECUTE and not options.no_execute:
        effect = Effect.NO_SCHEDULE
    cause = condition.reason.split(":", 1)[0]
    default = "advisory" if effect is Effect.ADVISORY else "unhealthy"
    added = datetime.datetime.fromtimestamp(int(condition.since), datetime.timezone.utc)
    key = f"{options.driver}/health"
    return (DeviceTaint(key, _names.label_value(cause, default), effect.value, added),)
