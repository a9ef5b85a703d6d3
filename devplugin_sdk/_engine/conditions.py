"""The health model: each device's ``Condition`` (health, effect, reason, since), derived from the
reports, advisories and retired IDs of one plugin, and how its changes are logged.

Health has one owner, this module: ListAndWatch, the DRA taints and the DRA health stream all
read the one condition ``HealthModel`` keeps per device. ``DeviceState`` feeds it discovery's
devices and the pushed and polled reports, and broadcasts what changed.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from devplugin_sdk.errors import summarize_ids
from devplugin_sdk.types import Device, Effect, Health, HealthReport

__all__ = ["HEALTHY", "Condition", "HealthModel", "log_condition", "log_flip", "log_flips"]

log = logging.getLogger("devplugin_sdk")

_FLIPS_LOGGED_ONE_BY_ONE = 10


@dataclass(frozen=True, slots=True)
class Condition:
    """A device's health as every channel shows it.

    Args:
        health: What ListAndWatch says.
        effect: ``Effect.ADVISORY`` (Healthy, operators should look), ``NO_SCHEDULE`` or
            ``NO_EXECUTE`` (Unhealthy); None: Healthy with nothing to say.
        reason: The reason of the report that made it ("" when there is nothing to say).
        since: When it began, as wall-clock seconds (a DRA taint's ``timeAdded``); 0.0 for a
            plain Healthy device.
    """

    health: Health
    effect: Effect | None = None
    reason: str = ""
    since: float = 0.0


#: The condition of a device nothing was reported about.
HEALTHY = Condition(Health.HEALTHY)


@dataclass(frozen=True, slots=True)
class _Report:
    """The latest health report about one device or parent ID."""

    sequence: int
    health: Health
    effect: Effect | None  # NO_SCHEDULE or NO_EXECUTE when Unhealthy, None when Healthy
    reason: str
    at: float  # wall clock


@dataclass(frozen=True, slots=True)
class _Advice:
    """The latest advisory about one device or parent ID."""

    sequence: int
    reason: str
    at: float  # wall clock: when this advisory (this reason) began
    until: float  # monotonic clock


class HealthModel:
    """Reports, advisories and retired IDs in; each device's ``Condition`` out.

    The health model, in full:

    * Reports come from discovery, from ``check_health`` and from pushed ``HealthEvent``s. A
      report names a device ID or a parent ID (``Device.parent``); a parent's report speaks for
      every device whose parent it is.
    * A device's health is the latest report about its own ID or its parent's, Healthy when
      there is none. A later Healthy report clears an earlier Unhealthy one, whoever made it.
    * Only changes count: a report equal to the latest one for its key is not a new report (a
      poll that says Healthy every interval does not override a newer pushed fault); the first
      report for a key always counts.
    * Discovery reports a device's health when what discovery says about it changes (for a
      new device: when discovery says Unhealthy), so a rescan that still sees a device as
      Healthy leaves a pushed fault in place.
    * A retired device (``DeviceState.set_devices(retired=...)``: a previous configuration's,
      listed only because a container may still hold it) is Unhealthy whatever any report says.
    * An Unhealthy report carries its effect (``NO_SCHEDULE`` unless it says ``NO_EXECUTE``);
      a report with the same health but another effect is a new report (an escalation).
    * An advisory (``Effect.ADVISORY``: the device works, operators should look) is not a
      health report: polls that say Healthy leave it alone. It shows while the device is Healthy,
      until ``advisory_hold`` seconds after the last advisory about the device or its parent, or
      until a later health report about it (a recovery clears it with the fault).
    * A condition keeps its first reason and start while its health and effect last (a DRA
      taint's ``timeAdded``), whichever report holds it.

    Args:
        clock: The monotonic clock advisories are held by.
        wall: The wall clock conditions start at.
        advisory_hold: Seconds an advisory shows after the last one about a device.
    """

    def __init__(
        self, clock: Callable[[], float], wall: Callable[[], float], advisory_hold: float
    ) -> None:
        self.clock = clock
        self.wall = wall
        self.advisory_hold = advisory_hold
        self._devices: Mapping[str, Device] = {}
        self._children: dict[str, list[str]] = {}
        # Latest report and latest advisory per device or parent ID.
        self._reports: dict[str, _Report] = {}
        self._advice: dict[str, _Advice] = {}
        self._sequence = itertools.count(1)
        self._conditions: dict[str, Condition] = {}
        self._retired: frozenset[str] = frozenset()
        self._retired_at = 0.0

    @property
    def retired(self) -> frozenset[str]:
        return self._retired

    @property
    def held(self) -> bool:
        """Whether some advisory is held (``expire`` has work to do later)."""
        return bool(self._advice)

    def of(self, device_id: str) -> Condition:
        return self._conditions[device_id]

    def discovered(
        self, devices: Mapping[str, Device], retired: Collection[str]
    ) -> dict[str, Condition]:
        """Take discovery's ``devices`` (by ID) and ``retired`` IDs; return the conditions
        before (the new ones are ``of`` each device)."""
        if frozenset(retired) != self._retired:
            self._retired = frozenset(retired)
            self._retired_at = self.wall()
        for device in devices.values():
            before = self._devices.get(device.id)
            said_before = before.health if before is not None else Health.HEALTHY
            if device.health is not said_before:
                self._record(device.id, device.health, None, "discovered")
        self._devices = devices
        self._children = {}
        for device in devices.values():
            if device.parent is not None:
                self._children.setdefault(device.parent, []).append(device.id)
        # Reports about IDs that are neither a device nor a parent any more are forgotten.
        for kept in (self._reports, self._advice):
            for key in [k for k in kept if k not in devices and k not in self._children]:
                del kept[key]
        old = self._conditions
        self._conditions = {d.id: _kept(old.get(d.id), self._compute(d)) for d in devices.values()}
        return old

    def report(
        self,
        health: Mapping[str, Health],
        reason: str = "",
        effects: Mapping[str, Effect] | None = None,
    ) -> dict[str, str]:
        """Record reports by device or parent ID (``DeviceState.report_health``); return the
        devices they may change, each with the reason of the latest report about it (later keys
        are later reports, as their sequence numbers say)."""
        reasons: Mapping[str, str] = {}
        if isinstance(health, HealthReport):
            reasons, effects = health.reasons, {**(effects or {}), **health.effects}
        affected: dict[str, str] = {}
        for key, reported in health.items():
            if key in self._retired or (key not in self._devices and key not in self._children):
                continue
            why = reasons.get(key) or reason
            effect = (effects or {}).get(key)
            if effect is Effect.ADVISORY:
                if not self._advise(key, why):
                    continue
            elif not self._record(key, Health(reported), effect, why):
                continue
            self._affect(affected, key, why)
        return affected

    def expire(self) -> dict[str, str]:
        """End the advisories whose hold has passed; return the devices that may change."""
        now = self.clock()
        affected: dict[str, str] = {}
        for key, advice in list(self._advice.items()):
            if advice.until <= now:
                del self._advice[key]
                self._affect(affected, key, "advisory hold over")
        return affected

    def next_end(self) -> float | None:
        """When the next advisory ends (monotonic clock), or None if none is held."""
        return min((a.until for a in self._advice.values()), default=None)

    def reassess(self, device_id: str) -> Condition | None:
        """Recompute a device's condition; return the old one if it changed."""
        old = self._conditions[device_id]
        new = self._compute(self._devices[device_id])
        if _kept(old, new) is old:
            return None
        self._conditions[device_id] = new
        return old

    def _affect(self, affected: dict[str, str], key: str, why: str) -> None:
        """``key``'s device, or its parent's devices, may change for ``why``."""
        if key in self._devices:
            affected[key] = why
        affected.update(dict.fromkeys(self._children.get(key, ()), why))

    def _record(self, key: str, health: Health, effect: Effect | None, reason: str) -> bool:
        """Make ``health`` (with ``effect``) the latest report for ``key``; False if it already
        was."""
        if health is Health.UNHEALTHY:
            effect = effect or Effect.NO_SCHEDULE
        latest = self._reports.get(key)
        if latest is not None and latest.health is health and latest.effect is effect:
            return False
        self._reports[key] = _Report(next(self._sequence), health, effect, reason, self.wall())
        return True

    def _advise(self, key: str, reason: str) -> bool:
        """Hold an advisory about ``key``; False if the same one was already held (its hold is
        extended)."""
        latest = self._advice.get(key)
        until = self.clock() + self.advisory_hold
        report = self._reports.get(key)
        if (
            latest is not None
            and latest.reason == reason
            and (report is None or latest.sequence > report.sequence)
        ):
            self._advice[key] = _Advice(latest.sequence, reason, latest.at, until)
            return False
        self._advice[key] = _Advice(next(self._sequence), reason, self.wall(), until)
        return True

    def _compute(self, device: Device) -> Condition:
        if device.id in self._retired:
            return Condition(
                Health.UNHEALTHY,
                Effect.NO_SCHEDULE,
                "retired: a previous configuration's device",
                self._retired_at,
            )
        report = _latest(self._reports, device)
        if report is not None and report.health is Health.UNHEALTHY:
            return Condition(Health.UNHEALTHY, report.effect, report.reason, report.at)
        advice = _latest(self._advice, device)
        # Advice older than the latest health report is over: that report superseded it.
        if advice is not None and (report is None or advice.sequence > report.sequence):
            return Condition(Health.HEALTHY, Effect.ADVISORY, advice.reason, advice.at)
        return HEALTHY


def _kept(old: Condition | None, new: Condition) -> Condition:
    """``old`` if ``new`` is the same condition (health and effect) held by another report: a
    condition keeps its first reason and start while it lasts (a DRA taint's ``timeAdded``)."""
    if old is not None and old.health is new.health and old.effect is new.effect:
        return old
    return new


_R = TypeVar("_R", _Report, _Advice)


def _latest(records: Mapping[str, _R], device: Device) -> _R | None:
    """The later of the records about ``device``'s ID and its parent's."""
    own = records.get(device.id)
    parent = records.get(device.parent) if device.parent is not None else None
    if own is None or (parent is not None and parent.sequence > own.sequence):
        return parent
    return own


# ---------------------------------------------------------------------- the log of changes


def log_condition(resource: str, device_id: str, old: Condition, new: Condition) -> None:
    """A change that is not a flip: an advisory starts or ends, an effect changes."""
    if new.effect is Effect.ADVISORY:
        what = f"has an advisory ({new.reason})"
    elif old.effect is Effect.ADVISORY:
        what = f"has no advisory any more ({old.reason})"
    else:
        what = f"is {new.health.value} with effect {new.effect} ({new.reason})"
    log.info(
        "%s: device %s %s",
        resource,
        device_id,
        what,
        extra={"resource": resource, "device": device_id},
    )


def log_flips(resource: str, flips: Sequence[tuple[str, Health]], reason: str) -> None:
    """One line per device, or one summary line when many change at once (a reload)."""
    if len(flips) <= _FLIPS_LOGGED_ONE_BY_ONE:
        for device_id, health in flips:
            log_flip(resource, device_id, health, reason)
        return
    by_health: dict[Health, list[str]] = {}
    for device_id, health in flips:
        by_health.setdefault(health, []).append(device_id)
    for health, ids in by_health.items():
        log.info(
            "%s: %d devices are now %s (%s): %s",
            resource,
            len(ids),
            health.value,
            reason,
            summarize_ids(ids),
            extra={"resource": resource, "health": health.value},
        )


def log_flip(resource: str, device_id: str, health: Health, reason: str) -> None:
    log.info(
        "%s: device %s is now %s%s",
        resource,
        device_id,
        health.value,
        f" ({reason})" if reason else "",
        extra={"resource": resource, "device": device_id, "health": health.value},
    )
