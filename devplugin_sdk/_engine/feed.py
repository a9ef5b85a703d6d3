"""The device feed of one plugin: discovery, polled health and pushed events into its state.

It runs beside the registration loop for the plugin's whole life, so health keeps flowing into
the state across kubelet restarts. Devices a previous plugin of the same resource had (before a
configuration reload) and this one lacks stay listed as Unhealthy: containers may still hold them.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence

import anyio

from devplugin_sdk._engine.state import DeviceState
from devplugin_sdk.plugin import DevicePlugin
from devplugin_sdk.types import Device, Health, HealthEvent, RescanEvent

log = logging.getLogger("devplugin_sdk")

__all__ = ["DeviceFeed"]

_WATCH_RESTART_FIRST = 0.5  # seconds before restarting a failed watch(); doubles up to 30 s
_WATCH_RESTART_MAX = 30.0


class DeviceFeed:
    """Feeds one plugin's hooks into its ``DeviceState``.

    Args:
        plugin: The plugin.
        state: Its device state.
        health_interval: Seconds between ``check_health`` polls (the plugin's own
            ``health_interval`` wins).
        inherited: Devices of the resource's previous plugin, by ID.
    """

    def __init__(
        self,
        plugin: DevicePlugin,
        state: DeviceState,
        health_interval: float,
        inherited: Mapping[str, Device] | None = None,
    ) -> None:
        self.plugin = plugin
        self.state = state
        self.resource = plugin.resource_name
        self.health_interval = plugin.health_interval or health_interval
        self.inherited = dict(inherited or {})
        self._extra = {"resource": self.resource}

    async def discover(self) -> None:
        """The first discovery. Its errors propagate: a plugin that cannot start stops."""
        devices = await self.plugin.discover()
        self.state.set_devices(self._with_inherited(devices))
        log.info("%s: discovered %d devices", self.resource, len(devices), extra=self._extra)

    async def run(self) -> None:
        """Poll and consume pushed events until cancelled (each only if the plugin has it)."""
        async with anyio.create_task_group() as tg:
            if self.plugin.overrides("check_health"):
                tg.start_soon(self._poll_health)
            if self.plugin.overrides("watch"):
                tg.start_soon(self._consume_events)

    async def rescan(self, reason: str = "") -> None:
        """Call ``discover()`` again; keep the previous list if it fails."""
        try:
            devices = await self.plugin.discover()
            if self.state.set_devices(self._with_inherited(devices)):
                log.info(
                    "%s: device list changed on rescan%s: %d devices",
                    self.resource,
                    f" ({reason})" if reason else "",
                    len(devices),
                    extra=self._extra,
                )
        except Exception:
            log.exception(
                "%s: rediscovery failed; keeping the previous devices",
                self.resource,
                extra=self._extra,
            )

    def _with_inherited(self, devices: Sequence[Device]) -> list[Device]:
        if not self.inherited:
            return list(devices)
        known = {d.id for d in devices}
        kept = [
            dataclasses.replace(d, health=Health.UNHEALTHY)
            for device_id, d in self.inherited.items()
            if device_id not in known
        ]
        return [*devices, *kept]

    async def _poll_health(self) -> None:
        while True:
            try:
                result = await self.plugin.check_health(self.state.devices)
                self.state.report_health(result, "polled")
            except Exception:
                log.exception(
                    "%s: check_health failed; health unchanged", self.resource, extra=self._extra
                )
            await anyio.sleep(self.health_interval)

    async def _consume_events(self) -> None:
        delay = _WATCH_RESTART_FIRST
        while True:
            try:
                events = self.plugin.watch()
                try:
                    async for event in events:
                        if isinstance(event, HealthEvent):
                            self.state.report_health({event.device_id: event.health}, event.reason)
                        elif isinstance(event, RescanEvent):
                            await self.rescan(event.reason)
                        else:  # authors may yield anything at run time
                            log.error(  # type: ignore[unreachable]
                                "%s: watch() yielded %r; expected HealthEvent or RescanEvent",
                                self.resource,
                                event,
                                extra=self._extra,
                            )
                finally:
                    # Finalise the generator here, in this task, not later from the GC.
                    aclose = getattr(events, "aclose", None)
                    if aclose is not None:
                        with anyio.CancelScope(shield=True):
                            await aclose()
            except Exception:
                log.exception(
                    "%s: watch() failed; restarting it in %gs",
                    self.resource,
                    delay,
                    extra=self._extra,
                )
                await anyio.sleep(delay)
                delay = min(delay * 2, _WATCH_RESTART_MAX)
            else:
                log.info("%s: watch() finished", self.resource, extra=self._extra)
                return
