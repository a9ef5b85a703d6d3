"""The device feed of one plugin: discovery, polled health and pushed events into its state.

It runs beside the registration loop for the plugin's whole life, so health keeps flowing into
the state across kubelet restarts. Devices a previous plugin of the same resource had (before a
configuration reload) and this one lacks stay listed as Unhealthy, whatever is reported about
them, while containers may still hold them: until the kubelet's checkpoint, written after this
plugin's first list, no longer records them as allocated (``held``). Only this plugin's own
devices go to its ``check_health``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import anyio
import anyio.to_thread

from devplugin_sdk._backoff import Backoff
from devplugin_sdk._engine import held
from devplugin_sdk._engine.state import DeviceState
from devplugin_sdk.errors import summarize_ids
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
        checkpoint: The kubelet's checkpoint file, which says which inherited devices
            containers still hold (None: they stay for the plugin's life).
    """

    def __init__(
        self,
        plugin: DevicePlugin,
        state: DeviceState,
        health_interval: float,
        inherited: Mapping[str, Device] | None = None,
        checkpoint: Path | None = None,
    ) -> None:
        self.plugin = plugin
        self.state = state
        self.resource = plugin.resource_name
        self.health_interval = plugin.health_interval or health_interval
        self.inherited = dict(inherited or {})
        self.checkpoint = checkpoint
        self._own: list[Device] = []
        self._before: held.Stamp = None  # the kubelet's checkpoint when this plugin started
        self._extra = {"resource": self.resource}
        self._rescanning = anyio.Lock()

    async def discover(self) -> None:
        """The first discovery. Its errors propagate: a plugin that cannot start stops."""
        if self.inherited and self.checkpoint is not None:
            # Before this plugin registers: the first write after it has seen its list.
            self._before = await anyio.to_thread.run_sync(held.stamp, self.checkpoint)
        devices = await self.plugin.discover()
        self._set(devices)
        log.info("%s: discovered %d devices", self.resource, len(devices), extra=self._extra)

    async def run(self) -> None:
        """Poll and consume pushed events until cancelled (each only if the plugin has it), and
        end advisories when their hold is over."""
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._expire_advice)
            if self.inherited and self.checkpoint is not None:
                tg.start_soon(self._release_inherited, self.checkpoint)
            if self.plugin.overrides("check_health"):
                tg.start_soon(self._poll_health)
            if self.plugin.overrides("watch"):
                tg.start_soon(self._consume_events)

    async def rescan(self, reason: str = "") -> None:
        """Call ``discover()`` again; keep the previous list if it fails. One at a time: a
        periodic rescan and a pushed ``RescanEvent`` never run ``discover()`` at once (the
        later-started one would otherwise be overwritten by an earlier, older list)."""
        async with self._rescanning:
            await self._rescan(reason)

    async def _rescan(self, reason: str) -> None:
        try:
            devices = await self.plugin.discover()
            if self._set(devices):
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

    def _set(self, devices: Sequence[Device]) -> bool:
        """Put this plugin's ``devices`` and the inherited ones still held into the state."""
        self._own = list(devices)
        if not self.inherited:
            return self.state.set_devices(self._own)
        for device in self._own:  # the ID is this plugin's now, for good
            self.inherited.pop(device.id, None)
        kept = [dataclasses.replace(d, health=Health.UNHEALTHY) for d in self.inherited.values()]
        return self.state.set_devices([*self._own, *kept], retired=self.inherited.keys())

    async def _release_inherited(self, checkpoint: Path) -> None:
        """Drop each inherited device once no container holds it, as the kubelet's checkpoint
        says: one written after this plugin started (the kubelet writes it after every device
        list and allocation, so it has seen this plugin's list with the inherited devices), and
        readable (otherwise nothing is proved released and they stay)."""
        seen = self._before
        while self.inherited:
            if await anyio.to_thread.run_sync(held.stamp, checkpoint) == seen:
                await anyio.sleep(self.health_interval)  # not written again: nothing new
                continue
            seen, holding = await anyio.to_thread.run_sync(
                held.held_devices, checkpoint, self.resource
            )
            if holding is not None:
                released = [i for i in self.inherited if i not in holding]
                if released:
                    for device_id in released:
                        del self.inherited[device_id]
                    self._set(self._own)
                    log.info(
                        "%s: %d devices of the previous configuration released (no container"
                        " holds them, says the kubelet's checkpoint), removed from the list: %s",
                        self.resource,
                        len(released),
                        summarize_ids(released),
                        extra=self._extra,
                    )
            await anyio.sleep(self.health_interval)

    async def _expire_advice(self) -> None:
        """Sleep until the next advisory's hold is over, or until something changes."""
        changed = anyio.Event()

        def wake() -> None:
            changed.set()

        unsubscribe = self.state.subscribe(wake)
        try:
            while True:
                changed = anyio.Event()
                ends = self.state.expire_advice()
                with anyio.move_on_after(
                    math.inf if ends is None else max(0.0, ends - self.state.clock())
                ):
                    await changed.wait()
        finally:
            unsubscribe()

    async def _poll_health(self) -> None:
        while True:
            try:
                # Only this plugin's devices: an inherited one is out whatever its old path says.
                result = await self.plugin.check_health(list(self._own))
                self.state.report_health(result, "polled")
            except Exception:
                log.exception(
                    "%s: check_health failed; health unchanged", self.resource, extra=self._extra
                )
            await anyio.sleep(self.health_interval)

    async def _consume_events(self) -> None:
        backoff = Backoff(_WATCH_RESTART_FIRST, _WATCH_RESTART_MAX)
        while True:
            try:
                events = self.plugin.watch()
                try:
                    async for event in events:
                        if isinstance(event, HealthEvent):
                            effects = (
                                {} if event.effect is None else {event.device_id: event.effect}
                            )
                            self.state.report_health(
                                {event.device_id: event.health}, event.reason, effects
                            )
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
                delay = backoff.next()
                log.exception(
                    "%s: watch() failed; restarting it in %.2gs",
                    self.resource,
                    delay,
                    extra=self._extra,
                )
                await anyio.sleep(delay)
            else:
                log.info("%s: watch() finished", self.resource, extra=self._extra)
                return
