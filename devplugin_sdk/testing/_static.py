"""StaticPlugin: a plugin fed a device list by the test, with health and changes pushed."""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncIterator, Iterable, Sequence

import anyio

from devplugin_sdk.plugin import DevicePlugin
from devplugin_sdk.types import Device, Effect, Health, HealthEvent, RescanEvent

__all__ = ["StaticPlugin"]


class StaticPlugin(DevicePlugin):
    """A plugin whose devices are given, for tests and examples.

    ``set_health`` and ``set_devices`` push events through ``watch()``, exactly the path a
    hardware event source takes, so they reach the kubelet at once.

    Args:
        resource_name: The extended resource name.
        devices: The initial devices.
        socket_name: Optional socket file name.
    """

    def __init__(
        self, resource_name: str, devices: Iterable[Device], *, socket_name: str | None = None
    ) -> None:
        super().__init__(resource_name=resource_name, socket_name=socket_name)
        self._devices = list(devices)
        self._events: deque[HealthEvent | RescanEvent] = deque()
        self._wakeup = anyio.Event()

    async def discover(self) -> Sequence[Device]:
        return list(self._devices)

    async def watch(self) -> AsyncIterator[HealthEvent | RescanEvent]:
        while True:
            while self._events:
                yield self._events.popleft()
            self._wakeup = anyio.Event()
            await self._wakeup.wait()

    def push(self, event: HealthEvent | RescanEvent) -> None:
        """Queue an event for ``watch()`` to yield."""
        self._events.append(event)
        self._wakeup.set()

    def set_health(
        self,
        device_id: str,
        health: Health | str,
        reason: str = "",
        effect: Effect | None = None,
    ) -> None:
        """Push a health change for a device (or for every device with this parent), with its
        ``Effect`` (``Effect.ADVISORY`` goes with Healthy)."""
        self.push(HealthEvent(device_id, Health(health), reason, effect))

    def set_devices(self, devices: Iterable[Device]) -> None:
        """Replace the device list and ask the SDK to rediscover."""
        self._devices = list(devices)
        self.push(RescanEvent("set_devices"))
