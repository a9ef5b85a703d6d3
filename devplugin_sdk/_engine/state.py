"""The live device set of one plugin: discovered devices, their conditions, change broadcast.

Every ListAndWatch stream of the plugin reads snapshots from here; a change bumps the version
and wakes the streams, which send the newest full list (changes made while a stream was busy
coalesce into one message). The conditions come from the health model (``conditions``), what
the device-plugin API lists from the listing (``listing``); DRA subscribes to every change.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence

import anyio

from devplugin_sdk._engine import conditions
from devplugin_sdk._engine.conditions import HEALTHY, Condition, HealthModel
from devplugin_sdk._engine.events import Events
from devplugin_sdk._engine.listing import Listing, Snapshot
from devplugin_sdk.errors import BackendError, UnknownDeviceError
from devplugin_sdk.types import Device, Effect, Health

__all__ = ["DeviceState"]

_BORN_KEPT = 1024


class DeviceState:
    """Devices and health of one resource; safe to use from one event loop.

    Health follows ``conditions.HealthModel`` (the latest report about a device or its parent
    wins, nothing is sticky). Each change of a device's health is logged once, with the reason
    of the report that made it, and handed to the observer (``Observer.health_changed``); an
    advisory's start and end and an escalation are logged too.
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
        self._events = events or Events(None)
        self._health = HealthModel(clock, wall, advisory_hold)
        self._listing = Listing()
        self._devices: dict[str, Device] = {}
        self._version = 0
        self._changed = anyio.Event()
        # Bumped whenever a Device object changes (not on health changes): what the Allocate
        # answers of the default ``allocate`` are cached against.
        self._devices_version = 0
        # When each version still of interest appeared (liveness: how long a list waits).
        self._born: dict[int, float] = {0: clock()}
        self._listeners: list[Callable[[], None]] = []

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
        old_devices, self._devices = self._devices, by_id
        old = self._health.discovered(by_id, retired)
        new = {i: self._health.of(i) for i in by_id}
        entries_changed, devices_changed = self._listing.update(by_id, old_devices, old, new)
        flips = [
            (i, c.health) for i, c in new.items() if old.get(i, HEALTHY).health is not c.health
        ]
        conditions.log_flips(self.resource_name, flips, "discovered")
        for device_id, health in flips:
            self._events.health_changed(self.resource_name, device_id, health, "discovered")
        for device_id in [i for i in old_devices if i not in by_id]:
            self._events.health_changed(self.resource_name, device_id, None, "removed")
        changed = list(old_devices) != list(by_id) or entries_changed
        if devices_changed:
            self._devices_version += 1
        if changed:
            self._bump()
        elif old != new:
            self._touch()  # an advisory or an effect: only DRA shows it
        return changed

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
            effects: The effect of each key's report (``Effect``; see ``HealthModel``).

        Returns:
            IDs of devices whose effective health changed.
        """
        return self._recompute(self._health.report(health, reason, effects))

    def expire_advice(self) -> float | None:
        """End the advisories whose hold has passed; return when the next one ends (the
        state's monotonic clock), or None if none is held."""
        self._recompute(self._health.expire())
        return self._health.next_end()

    def _recompute(self, affected: Mapping[str, str]) -> list[str]:
        """Recompute the conditions of ``affected`` devices (ID -> the reason that may change
        them); log, tell and broadcast the changes; return the IDs whose health flipped."""
        flipped: list[str] = []
        touched = False
        for device_id, why in affected.items():
            old = self._health.reassess(device_id)
            if old is None:
                continue
            new = self._health.of(device_id)
            if new.health is old.health:
                touched = True
                conditions.log_condition(self.resource_name, device_id, old, new)
                continue
            self._listing.flip(self._devices[device_id], new.health)
            flipped.append(device_id)
            conditions.log_flip(self.resource_name, device_id, new.health, why)
            self._events.health_changed(self.resource_name, device_id, new.health, why)
        if flipped:
            self._bump()
        elif touched:
            self._touch()
        return flipped

    def list_only(self, listed: Callable[[Device], bool] | None) -> None:
        """List (and allocate) only the devices ``listed`` accepts through the device-plugin
        API; the others stay in the state, with their health, for DRA. None lists every one."""
        self._listing.choose(listed)
        self._devices_version += 1  # what Allocate may hand out changed
        self.set_devices(list(self._devices.values()), retired=self._health.retired)
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
        return self._listing.snapshot(self._version)

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
        listed = self._listing.by_id
        unknown = [i for i in ids if i not in listed]
        if unknown:
            raise UnknownDeviceError(self.resource_name, unknown)
        return [listed[i] for i in ids]

    def health_of(self, device_id: str) -> Health:
        return self._health.of(device_id).health

    def condition_of(self, device_id: str) -> Condition:
        """The device's condition: health, effect, reason and since when."""
        return self._health.of(device_id)

    @property
    def advice_held(self) -> bool:
        """Whether some advisory is held (``expire_advice`` has work to do later)."""
        return self._health.held

    @property
    def devices(self) -> list[Device]:
        return list(self._devices.values())

    @property
    def by_id(self) -> Mapping[str, Device]:
        """The devices the device-plugin API lists, by ID (a live view: do not keep it across
        a rescan)."""
        return self._listing.by_id

    # ------------------------------------------------------------------ broadcast

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
