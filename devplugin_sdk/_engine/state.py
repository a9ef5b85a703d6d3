"""The live device set of one plugin: discovered devices, reported health, change broadcast.

Every ListAndWatch stream of the plugin reads snapshots from here; a change bumps the version
and wakes the streams, which send the newest full list (changes made while a stream was busy
coalesce into one message). Health has one owner, this module: a device's ``Condition`` (its
health, the effect and reason of the report that made it, since when) is the latest report about
it or its parent, and nothing is sticky (``DeviceState.report_health``). ListAndWatch, the DRA
taints and the DRA health stream all read that one condition.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import anyio

from devplugin_sdk._engine.events import Events
from devplugin_sdk._wire import convert
from devplugin_sdk.errors import BackendError, UnknownDeviceError, summarize_ids
from devplugin_sdk.types import Device, Effect, Health, HealthReport

__all__ = ["Condition", "DeviceState", "Snapshot"]

log = logging.getLogger("devplugin_sdk")

_BORN_KEPT = 1024
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


@dataclass(frozen=True, slots=True)
class Snapshot:
    """One version of the device list, with its ListAndWatch encoding."""

    version: int
    devices: tuple[Device, ...]
    payload: bytes
    healthy_count: int


class DeviceState:
    """Devices and health of one resource; safe to use from one event loop.

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
    * A retired device (``set_devices(retired=...)``: a previous configuration's, listed only
      because a container may still hold it) is Unhealthy whatever any report says.
    * An Unhealthy report carries its effect (``NO_SCHEDULE`` unless it says ``NO_EXECUTE``);
      a report with the same health but another effect is a new report (an escalation).
    * An advisory (``Effect.ADVISORY``: the device works, operators should look) is not a
      health report: polls that say Healthy leave it alone. It shows while the device is Healthy,
      until ``advisory_hold`` seconds after the last advisory about the device or its parent, or
      until a later health report about it (a recovery clears it with the fault).

    Each change of a device's health is logged once, with the reason of the report that made
    it, and handed to the observer (``Observer.health_changed``); an advisory's start and end
    and an escalation are logged too.
    """

    def __init__(
        self,
        resource_name: str,
        clock: Callable[[], float] = time.monotonic,
        *,
        events: Events | None = None,
        advisory_hold: float = 3600.0,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.resource_name = resource_name
        self.clock = clock
        self.wall = wall
        self.advisory_hold = advisory_hold
        self._events = events or Events(None)
        self._devices: dict[str, Device] = {}
        self._children: dict[str, list[str]] = {}
        # Latest report and latest advisory per device or parent ID.
        self._reports: dict[str, _Report] = {}
        self._advice: dict[str, _Advice] = {}
        self._sequence = itertools.count(1)
        self._effective: dict[str, Condition] = {}
        self._healthy = 0
        self._entries: dict[str, bytes] = {}
        self._version = 0
        self._snapshot: Snapshot | None = None
        self._changed = anyio.Event()
        # Bumped whenever a Device object changes (not on health changes): what the Allocate
        # answers of the default ``allocate`` are cached against.
        self._devices_version = 0
        # When each version still of interest appeared (liveness: how long a list waits).
        self._born: dict[int, float] = {0: clock()}
        # Which devices the device-plugin API lists (None: all); DRA serves the others.
        self._listed: Callable[[Device], bool] | None = None
        self._allocatable: Mapping[str, Device] = {}
        self._listeners: list[Callable[[], None]] = []
        self._retired: frozenset[str] = frozenset()
        self._retired_at = 0.0

    # ------------------------------------------------------------------ writers

    def set_devices(self, devices: Sequence[Device], *, retired: Collection[str] = ()) -> bool:
        """Replace the discovered devices; return whether the list the kubelet sees changed.

        A device's discovered health is a report when it differs from what the previous
        discovery said about that ID (Healthy for a new ID).

        Args:
            devices: The devices.
            retired: IDs among them that stay Unhealthy whatever is reported (a previous
                configuration's devices that containers may still hold).

        Raises:
            BackendError: if an entry is not a ``Device`` or two devices share an ID (the
                kubelet would double-count them); nothing changes.
        """
        by_id = self._index(devices)
        if frozenset(retired) != self._retired:
            self._retired = frozenset(retired)
            self._retired_at = self.wall()
        old_devices = self._devices
        old_effective = self._effective
        for device in by_id.values():
            before = old_devices.get(device.id)
            said_before = before.health if before is not None else Health.HEALTHY
            if device.health is not said_before:
                self._record(device.id, device.health, None, "discovered")
        self._devices = by_id
        self._children = {}
        for device in by_id.values():
            if device.parent is not None:
                self._children.setdefault(device.parent, []).append(device.id)
        # Reports about IDs that are neither a device nor a parent any more are forgotten.
        for kept in (self._reports, self._advice):
            for key in [k for k in kept if k not in by_id and k not in self._children]:
                del kept[key]
        self._effective = {
            d.id: _kept(old_effective.get(d.id), self._compute(d)) for d in by_id.values()
        }
        listed = self._listed
        self._healthy = sum(
            1
            for d in by_id.values()
            if self._effective[d.id].health is Health.HEALTHY and (listed is None or listed(d))
        )
        entries, devices_changed = self._encode(by_id, old_devices, old_effective)
        flips = [
            (device_id, condition.health)
            for device_id, condition in self._effective.items()
            if old_effective.get(device_id, HEALTHY).health is not condition.health
        ]
        self._log_flips(flips, "discovered")
        for device_id, health in flips:
            self._events.health_changed(self.resource_name, device_id, health, "discovered")
        for device_id in [i for i in old_devices if i not in by_id]:
            self._events.health_changed(self.resource_name, device_id, None, "removed")
        changed = list(old_devices) != list(by_id) or entries != self._entries
        self._entries = entries
        self._allocatable = by_id if listed is None else {i: by_id[i] for i in entries}
        if devices_changed:
            self._devices_version += 1
        if changed:
            self._bump()
        elif old_effective != self._effective:
            self._touch()  # an advisory or an effect: only DRA shows it
        return changed

    def _encode(
        self,
        by_id: dict[str, Device],
        old_devices: dict[str, Device],
        old_effective: dict[str, Condition],
    ) -> tuple[dict[str, bytes], bool]:
        """The ListAndWatch entry of each listed device (reused where nothing changed), and
        whether any listed ``Device`` changed."""
        listed = self._listed
        entries: dict[str, bytes] = {}
        devices_changed = len(old_devices) != len(by_id)
        for device in by_id.values():
            if listed is not None and not listed(device):
                continue
            cached = self._entries.get(device.id)
            same = old_devices.get(device.id) == device
            devices_changed = devices_changed or not same
            health = self._effective[device.id].health
            before = old_effective.get(device.id)
            unchanged = same and before is not None and before.health is health
            if cached is not None and unchanged:
                entries[device.id] = cached
            else:
                entries[device.id] = convert.list_and_watch_entry(device, health)
        return entries, devices_changed

    def _index(self, devices: Sequence[Device]) -> dict[str, Device]:
        by_id: dict[str, Device] = {}
        for device in devices:
            if not isinstance(device, Device):
                raise BackendError(
                    f"{self.resource_name}: discover() returned {type(device).__name__}, not Device"
                )
            if device.id in by_id:
                raise BackendError(
                    f"{self.resource_name}: discover() returned duplicate ID {device.id!r}"
                )
            by_id[device.id] = device
        return by_id

    def report_health(
        self,
        health: Mapping[str, Health],
        reason: str = "",
        effects: Mapping[str, Effect] | None = None,
    ) -> list[str]:
        """Record pushed or polled health by device ID or parent ID.

        Keys that name neither a device nor a parent of one are ignored.

        Args:
            health: Health by device or parent ID; a ``HealthReport``'s reason and effect for a
                key win over ``reason`` and ``effects``.
            reason: Why, for the log line, the observer of each change, and DRA's taint and
                health stream.
            effects: The effect of each key's report (``Effect``; see the class docstring).

        Returns:
            IDs of devices whose effective health changed.
        """
        reasons: Mapping[str, str] = {}
        if isinstance(health, HealthReport):
            reasons, effects = health.reasons, {**(effects or {}), **health.effects}
        # Device -> reason of the latest report that may change it (later keys are later
        # reports, as their sequence numbers say).
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
            if key in self._devices:
                affected[key] = why
            affected.update(dict.fromkeys(self._children.get(key, ()), why))
        return self._recompute(affected)

    def expire_advice(self) -> float | None:
        """End the advisories whose hold has passed; return when the next one ends (the
        state's monotonic clock), or None if none is held."""
        now = self.clock()
        affected: dict[str, str] = {}
        for key, advice in list(self._advice.items()):
            if advice.until <= now:
                del self._advice[key]
                if key in self._devices:
                    affected[key] = "advisory hold over"
                affected.update(dict.fromkeys(self._children.get(key, ()), "advisory hold over"))
        self._recompute(affected)
        return min((a.until for a in self._advice.values()), default=None)

    def _recompute(self, affected: Mapping[str, str]) -> list[str]:
        """Recompute the conditions of ``affected`` devices (ID -> the reason that may change
        them); log, tell and broadcast the changes; return the IDs whose health flipped."""
        flipped: list[str] = []
        touched = False
        for device_id, why in affected.items():
            device = self._devices[device_id]
            old = self._effective[device_id]
            new = self._compute(device)
            if _kept(old, new) is old:
                continue
            self._effective[device_id] = new
            if new.health is old.health:
                touched = True
                self._log_condition(device_id, old, new)
                continue
            if device_id in self._entries:
                self._healthy += 1 if new.health is Health.HEALTHY else -1
                self._entries[device_id] = convert.list_and_watch_entry(device, new.health)
            flipped.append(device_id)
            self._log_flip(device_id, new.health, why)
            self._events.health_changed(self.resource_name, device_id, new.health, why)
        if flipped:
            self._bump()
        elif touched:
            self._touch()
        return flipped

    def list_only(self, listed: Callable[[Device], bool] | None) -> None:
        """List (and allocate) only the devices ``listed`` accepts through the device-plugin
        API; the others stay in the state, with their health, for DRA. None lists every one."""
        self._listed = listed
        self._entries = {}
        self._devices_version += 1  # what Allocate may hand out changed
        self.set_devices(list(self._devices.values()), retired=self._retired)
        self._bump()

    def subscribe(self, listener: Callable[[], None]) -> Callable[[], None]:
        """Call ``listener`` (which must not block) on every change of devices or health;
        return the function that unsubscribes it."""
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener)

    def wake(self) -> None:
        """Wake every stream waiting in ``wait_changed`` (one of them may have to end)."""
        self._changed.set()
        self._changed = anyio.Event()

    # ------------------------------------------------------------------ readers

    def snapshot(self) -> Snapshot:
        """The current device list (cached per version)."""
        if self._snapshot is None or self._snapshot.version != self._version:
            self._snapshot = Snapshot(
                version=self._version,
                devices=tuple(d for d in self._devices.values() if d.id in self._entries),
                payload=b"".join(self._entries.values()),
                healthy_count=self._healthy,
            )
        return self._snapshot

    @property
    def version(self) -> int:
        return self._version

    @property
    def devices_version(self) -> int:
        """Changes whenever a discovered ``Device`` changes (health changes do not count)."""
        return self._devices_version

    async def wait_changed(self, seen_version: int) -> None:
        """Return once the version differs from ``seen_version``, or on a ``wake``."""
        if self._version == seen_version:
            await self._changed.wait()

    def lookup(self, device_ids: Iterable[str]) -> list[Device]:
        """Devices for IDs, in order.

        Raises:
            UnknownDeviceError: naming every ID the plugin does not have.
        """
        ids = list(device_ids)
        unknown = [i for i in ids if i not in self._entries]
        if unknown:
            raise UnknownDeviceError(self.resource_name, unknown)
        return [self._devices[i] for i in ids]

    def health_of(self, device_id: str) -> Health:
        return self._effective[device_id].health

    def condition_of(self, device_id: str) -> Condition:
        """The device's condition: health, effect, reason and since when."""
        return self._effective[device_id]

    @property
    def advice_held(self) -> bool:
        """Whether some advisory is held (``expire_advice`` has work to do later)."""
        return bool(self._advice)

    @property
    def devices(self) -> list[Device]:
        return list(self._devices.values())

    @property
    def by_id(self) -> Mapping[str, Device]:
        """The devices the device-plugin API lists, by ID (a live view: do not keep it across
        a rescan)."""
        return self._allocatable

    # ------------------------------------------------------------------ internals

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

    def _log_condition(self, device_id: str, old: Condition, new: Condition) -> None:
        """A change that is not a flip: an advisory starts or ends, an effect changes."""
        if new.effect is Effect.ADVISORY:
            what = f"has an advisory ({new.reason})"
        elif old.effect is Effect.ADVISORY:
            what = f"has no advisory any more ({old.reason})"
        else:
            what = f"is {new.health.value} with effect {new.effect} ({new.reason})"
        log.info(
            "%s: device %s %s",
            self.resource_name,
            device_id,
            what,
            extra={"resource": self.resource_name, "device": device_id},
        )

    def _log_flips(self, flips: Sequence[tuple[str, Health]], reason: str) -> None:
        """One line per device, or one summary line when many change at once (a reload)."""
        if len(flips) <= _FLIPS_LOGGED_ONE_BY_ONE:
            for device_id, health in flips:
                self._log_flip(device_id, health, reason)
            return
        by_health: dict[Health, list[str]] = {}
        for device_id, health in flips:
            by_health.setdefault(health, []).append(device_id)
        for health, ids in by_health.items():
            log.info(
                "%s: %d devices are now %s (%s): %s",
                self.resource_name,
                len(ids),
                health.value,
                reason,
                summarize_ids(ids),
                extra={"resource": self.resource_name, "health": health.value},
            )

    def _log_flip(self, device_id: str, health: Health, reason: str) -> None:
        log.info(
            "%s: device %s is now %s%s",
            self.resource_name,
            device_id,
            health.value,
            f" ({reason})" if reason else "",
            extra={"resource": self.resource_name, "device": device_id, "health": health.value},
        )

    def changed_at(self, version: int) -> float:
        """When ``version`` appeared (monotonic clock); forgets every older version."""
        for old in [v for v in self._born if v < version]:
            del self._born[old]
        # A version dropped by the cap below appeared before the oldest one kept.
        return self._born.get(version, min(self._born.values(), default=self.clock()))

    def _bump(self) -> None:
        """A change the device-plugin API sees: a new version for the streams, and the
        listeners."""
        self._version += 1
        self._born[self._version] = self.clock()
        if len(self._born) > _BORN_KEPT:  # nobody is reading (no stream): keep it bounded
            del self._born[next(iter(self._born))]
        self.wake()
        self._touch()

    def _touch(self) -> None:
        """A change of devices or conditions: tell the listeners (DRA)."""
        for listener in list(self._listeners):
            listener()


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
