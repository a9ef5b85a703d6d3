"""The device listing: which of a plugin's devices the device-plugin API lists (DRA serves the
others), their ListAndWatch entries and the snapshot each stream sends.

Each listed device's entry is encoded once and reused until the device or its health changes,
so a health flip in a large pool re-encodes one entry, not the list.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from devplugin_sdk._engine.conditions import Condition
from devplugin_sdk._wire import convert
from devplugin_sdk.types import Device, Health

__all__ = ["Listing", "Snapshot"]


@dataclass(frozen=True, slots=True)
class Snapshot:
    """One version of the device list, with its ListAndWatch encoding."""

    version: int
    devices: tuple[Device, ...]
    payload: bytes
    healthy_count: int


class Listing:
    """The listed devices of one plugin, their encoded entries and healthy count."""

    def __init__(self) -> None:
        # Which devices the device-plugin API lists (None: all); DRA serves the others.
        self.listed: Callable[[Device], bool] | None = None
        self._entries: dict[str, bytes] = {}
        self._healthy = 0
        self._allocatable: Mapping[str, Device] = {}
        self._snapshot: Snapshot | None = None

    @property
    def by_id(self) -> Mapping[str, Device]:
        """The listed devices by ID, in discovery's order (a live view: do not keep it across
        a rescan)."""
        return self._allocatable

    def choose(self, listed: Callable[[Device], bool] | None) -> None:
        """List only the devices ``listed`` accepts from the next ``update`` on (None: all)."""
        self.listed = listed
        self._entries = {}

    def update(
        self,
        by_id: dict[str, Device],
        old_devices: Mapping[str, Device],
        old: Mapping[str, Condition],
        new: Mapping[str, Condition],
    ) -> tuple[bool, bool]:
        """List ``by_id`` with their ``new`` conditions (``old_devices`` and ``old``: what was
        before); return whether any entry changed and whether any listed ``Device`` did."""
        listed = self.listed
        entries: dict[str, bytes] = {}
        devices_changed = len(old_devices) != len(by_id)
        for device in by_id.values():
            if listed is not None and not listed(device):
                continue
            cached = self._entries.get(device.id)
            same = old_devices.get(device.id) == device
            devices_changed = devices_changed or not same
            health = new[device.id].health
            before = old.get(device.id)
            if cached is not None and same and before is not None and before.health is health:
                entries[device.id] = cached
            else:
                entries[device.id] = convert.list_and_watch_entry(device, health)
        self._healthy = sum(1 for i in entries if new[i].health is Health.HEALTHY)
        changed = entries != self._entries
        self._entries = entries
        self._allocatable = by_id if listed is None else {i: by_id[i] for i in entries}
        return changed, devices_changed

    def flip(self, device: Device, health: Health) -> None:
        """``device``'s health flipped to ``health``: re-encode its entry if it is listed."""
        if device.id in self._entries:
            self._healthy += 1 if health is Health.HEALTHY else -1
            self._entries[device.id] = convert.list_and_watch_entry(device, health)

    def snapshot(self, version: int) -> Snapshot:
        """The listing as of ``version`` (cached per version)."""
        if self._snapshot is None or self._snapshot.version != version:
            self._snapshot = Snapshot(
                version=version,
                devices=tuple(self._allocatable.values()),
                payload=b"".join(self._entries.values()),
                healthy_count=self._healthy,
            )
        return self._snapshot
