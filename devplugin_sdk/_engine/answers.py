"""The default ``allocate``'s Allocate answers, encoded once per set of device IDs.

The default ``allocate`` is ``Allocation.merge`` of the devices, a pure function of them: its
encoded answer for a set of IDs holds until the devices change (health changes do not count).
The servicer asks here first on every Allocate, the plugin's hot path.
"""

from __future__ import annotations

from devplugin_sdk._engine.state import DeviceState

#: Answers kept per device version (one per distinct set of IDs asked for); past it the cache
#: starts again, so any request pattern stays bounded.
ALLOCATIONS_CACHED = 1024


class MergedAnswers:
    """Encoded container answers by the tuple of device IDs asked for, for one device state."""

    def __init__(self, state: DeviceState) -> None:
        self._state = state
        self._entries: dict[tuple[str, ...], bytes] = {}
        self._version = -1

    def get(self, key: tuple[str, ...]) -> bytes | None:
        """The answer kept for ``key``, if the devices did not change since it was kept."""
        if self._version != self._state.devices_version:
            self._entries.clear()
            self._version = self._state.devices_version
        return self._entries.get(key)

    def put(self, key: tuple[str, ...], entry: bytes) -> bytes:
        """Keep ``entry`` for ``key`` (only valid requests: known, distinct devices)."""
        if len(self._entries) >= ALLOCATIONS_CACHED:
            self._entries.clear()
        self._entries[key] = entry
        return entry
