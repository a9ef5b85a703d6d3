"""The live device set of one plugin: discovered devices, reported health, change broadcast.

Every ListAndWatch stream of the plugin reads snapshots from here; a change bumps the version
and wakes the streams, which send the newest full list (changes made while a stream was busy
coalesce into one message). Effective health is the worst of discovered, reported-by-ID and
reported-by-parent health.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import anyio

from devplugin_sdk import _convert
from devplugin_sdk.errors import BackendError, UnknownDeviceError
from devplugin_sdk.types import Device, Health

log = logging.getLogger("devplugin_sdk")

_BORN_KEPT = 1024


@dataclass(frozen=True, slots=True)
class Snapshot:
    """One version of the device list, with its ListAndWatch encoding."""

    version: int
    devices: tuple[Device, ...]
    health: Mapping[str, Health]
    payload: bytes
    healthy_count: int


class DeviceState:
    """Devices and health of one resource; safe to use from one event loop."""

    def __init__(self, resource_name: str) -> None:
        self.resource_name = resource_name
        self._devices: dict[str, Device] = {}
        self._children: dict[str, list[str]] = {}
        self._reported: dict[str, Health] = {}
        self._effective: dict[str, Health] = {}
        self._healthy = 0
        self._entries: dict[str, bytes] = {}
        self._version = 0
        self._snapshot: Snapshot | None = None
        self._changed = anyio.Event()
        self.closed = False
        # When each version still of interest appeared (liveness: how long a list waits).
        self._born: dict[int, float] = {0: time.monotonic()}

    # ------------------------------------------------------------------ writers

    def set_devices(self, devices: Sequence[Device]) -> bool:
        """Replace the discovered devices; return whether the list the kubelet sees changed.

        Raises:
            BackendError: if two devices share an ID (the kubelet would double-count them).
        """
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
        old_devices = self._devices
        old_effective = self._effective
        self._devices = by_id
        self._children = {}
        for device in by_id.values():
            if device.parent is not None:
                self._children.setdefault(device.parent, []).append(device.id)
        self._effective = {d.id: self._compute(d) for d in by_id.values()}
        self._healthy = sum(1 for h in self._effective.values() if h is Health.HEALTHY)
        entries: dict[str, bytes] = {}
        for device in by_id.values():
            cached = self._entries.get(device.id)
            unchanged = (
                old_devices.get(device.id) == device
                and old_effective.get(device.id) is self._effective[device.id]
            )
            if cached is not None and unchanged:
                entries[device.id] = cached
            else:
                entries[device.id] = _convert.list_and_watch_entry(
                    device, self._effective[device.id]
                )
        changed = list(old_devices) != list(by_id) or entries != self._entries
        self._entries = entries
        if changed:
            self._bump()
        return changed

    def report_health(self, health: Mapping[str, Health], reason: str = "") -> list[str]:
        """Record pushed or polled health by device ID or parent ID.

        Returns:
            IDs of devices whose effective health changed.
        """
        affected: set[str] = set()
        for key, reported in health.items():
            value = Health(reported)
            if self._reported.get(key, Health.HEALTHY) is value:
                continue
            if value is Health.HEALTHY:
                self._reported.pop(key, None)
            else:
                self._reported[key] = value
            if key in self._devices:
                affected.add(key)
            affected.update(self._children.get(key, ()))
        flipped: list[str] = []
        for device_id in affected:
            device = self._devices[device_id]
            new = self._compute(device)
            if new is not self._effective[device_id]:
                self._healthy += 1 if new is Health.HEALTHY else -1
                self._effective[device_id] = new
                self._entries[device_id] = _convert.list_and_watch_entry(device, new)
                flipped.append(device_id)
                log.info(
                    "%s: device %s is now %s%s",
                    self.resource_name,
                    device_id,
                    new.value,
                    f" ({reason})" if reason else "",
                    extra={
                        "resource": self.resource_name,
                        "device": device_id,
                        "health": new.value,
                    },
                )
        if flipped:
            self._bump()
        return flipped

    def close(self) -> None:
        """Wake every stream for the last time; they end cleanly."""
        self.closed = True
        self._changed.set()

    def reopen(self) -> None:
        """Allow streams again (a new server after a kubelet restart)."""
        self.closed = False
        self._changed = anyio.Event()

    # ------------------------------------------------------------------ readers

    def snapshot(self) -> Snapshot:
        """The current device list (cached per version)."""
        if self._snapshot is None or self._snapshot.version != self._version:
            self._snapshot = Snapshot(
                version=self._version,
                devices=tuple(self._devices.values()),
                health=dict(self._effective),
                payload=b"".join(self._entries.values()),
                healthy_count=self._healthy,
            )
        return self._snapshot

    @property
    def version(self) -> int:
        return self._version

    async def wait_changed(self, seen_version: int) -> None:
        """Return once the version differs from ``seen_version`` or the state is closed."""
        while self._version == seen_version and not self.closed:
            await self._changed.wait()

    def lookup(self, device_ids: Iterable[str]) -> list[Device]:
        """Devices for IDs, in order.

        Raises:
            UnknownDeviceError: naming every ID the plugin does not have.
        """
        ids = list(device_ids)
        unknown = [i for i in ids if i not in self._devices]
        if unknown:
            raise UnknownDeviceError(self.resource_name, unknown)
        return [self._devices[i] for i in ids]

    def health_of(self, device_id: str) -> Health:
        return self._effective[device_id]

    @property
    def devices(self) -> list[Device]:
        return list(self._devices.values())

    # ------------------------------------------------------------------ internals

    def _compute(self, device: Device) -> Health:
        if device.health is not Health.HEALTHY:
            return device.health
        reported = self._reported.get(device.id, Health.HEALTHY)
        if reported is not Health.HEALTHY:
            return reported
        if device.parent is not None:
            return self._reported.get(device.parent, Health.HEALTHY)
        return Health.HEALTHY

    def changed_at(self, version: int) -> float:
        """When ``version`` appeared (monotonic clock); forgets every older version."""
        for old in [v for v in self._born if v < version]:
            del self._born[old]
        # A version dropped by the cap below appeared before the oldest one kept.
        return self._born.get(version, min(self._born.values(), default=time.monotonic()))

    def _bump(self) -> None:
        self._version += 1
        self._born[self._version] = time.monotonic()
        if len(self._born) > _BORN_KEPT:  # nobody is reading (no stream): keep it bounded
            del self._born[next(iter(self._born))]
        self._changed.set()
        self._changed = anyio.Event()
