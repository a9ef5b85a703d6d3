"""One plugin while it is served: its state, streams, servicer, feed and registration, wired up.

``ServedPlugin`` only assembles the small pieces (``state``, ``streams``, ``servicer``,
``feed`` with its periodic ``rescan``, ``link``) and runs the registration strategy the runner
chose once for the process with the plugin's ``PluginHandle``; each piece knows only what it is
handed.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import anyio
from anyio.abc import TaskStatus

from devplugin_sdk._engine import hooks
from devplugin_sdk._engine.events import Events
from devplugin_sdk._engine.feed import DeviceFeed
from devplugin_sdk._engine.handle import PluginHandle, Strategy
from devplugin_sdk._engine.kubelet_watch import DirectoryWatcher
from devplugin_sdk._engine.link import Link
from devplugin_sdk._engine.rescan import rescan_every, rescan_interval
from devplugin_sdk._engine.servicer import DevicePluginServicer
from devplugin_sdk._engine.state import DeviceState
from devplugin_sdk._engine.streams import Streams
from devplugin_sdk.api.constants import CHECKPOINT_NAME
from devplugin_sdk.observe import PluginStatus
from devplugin_sdk.plugin import DevicePlugin
from devplugin_sdk.settings import Settings
from devplugin_sdk.types import Device, Health

log = logging.getLogger("devplugin_sdk")

__all__ = ["ServedPlugin", "pending_seconds"]


class ServedPlugin:
    """Serves one plugin until cancelled.

    Args:
        plugin: The plugin.
        settings: Lifecycle settings.
        watcher: The process's directory watcher (wakes the registration loop).
        events: Where events go.
        strategy: How the plugin registers.
        inherited: Devices of the resource's previous plugin (configuration reload), by ID.
    """

    def __init__(
        self,
        plugin: DevicePlugin,
        settings: Settings,
        watcher: DirectoryWatcher,
        events: Events,
        strategy: Strategy,
        *,
        inherited: Mapping[str, Device] | None = None,
    ) -> None:
        self.plugin = plugin
        self.resource = plugin.resource_name
        self.settings = settings
        # Its own view: its streams' events wake this plugin's registration loop, not all of them.
        self.watcher = watcher.view()
        self.strategy = strategy
        self.state = DeviceState(self.resource, events=events, advisory_hold=settings.advisory_hold)
        self.streams = Streams(self.resource, self.watcher.notify)
        self.link = Link(self.resource, events)
        servicer = DevicePluginServicer(
            plugin,
            self.state,
            self.streams,
            events,
            hook_timeout=settings.hook_timeout,
            prestart_timeout=settings.prestart_timeout,
        )
        self.handle = PluginHandle(plugin, self.state, self.streams, self.link, servicer)
        self.rescan_interval = rescan_interval(plugin, settings)
        self.feed = DeviceFeed(
            plugin,
            self.state,
            settings.health_interval,
            inherited,
            # The kubelet's books of which container holds which device (a reload's retired
            # devices leave when they say so).
            checkpoint=settings.device_plugin_dir / CHECKPOINT_NAME,
        )

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Discover (then report started), feed health and keep registered until cancelled.

        ``on_stop`` runs at the end whatever happened, a failed first discovery included (a
        backend may have opened a library in its constructor or in ``discover``).

        Raises:
            Exception: whatever the first ``discover()`` raises, and the strategy's permanent
                errors (``RegistrationRejectedError``, ``SocketInUseError``).
        """
        extra = {"resource": self.resource}
        try:
            try:
                with hooks.still_running(self.resource, "discover", extra):
                    await self.feed.discover()
            except Exception as exc:
                hooks.note_failure(exc, self.resource, "discover")
                raise
            task_status.started()
            async with anyio.create_task_group() as tg:
                tg.start_soon(self.feed.run)
                if self.rescan_interval:
                    tg.start_soon(rescan_every, self.feed, self.rescan_interval)
                await self.strategy(self.handle, self.settings, self.watcher)
        finally:
            await self._stop_plugin(extra)

    async def _stop_plugin(self, extra: dict[str, str]) -> None:
        """Run ``on_stop`` under ``Settings.stop_timeout``, shielded; say when it is slow,
        fails (one line; the traceback at debug) or is left behind at the bound."""
        timeout = self.settings.stop_timeout
        with anyio.CancelScope(shield=True), anyio.move_on_after(timeout) as bound:
            try:
                with hooks.still_running(self.resource, "on_stop", extra):
                    await self.plugin.on_stop()
            except Exception as exc:
                log.error(  # noqa: TRY400 - the traceback only at debug
                    "%s: on_stop() failed: %s",
                    self.resource,
                    hooks.describe(exc),
                    exc_info=exc if log.isEnabledFor(logging.DEBUG) else None,
                    extra=extra,
                )
        if bound.cancelled_caught:
            log.warning(
                "%s: on_stop() did not finish within %gs; left behind",
                self.resource,
                timeout,
                extra=extra,
            )

    def status(self) -> PluginStatus:
        """This plugin's state for liveness checks (see ``observe.PluginStatus``)."""
        snapshot = self.state.snapshot()
        counts = {
            Health.HEALTHY.value: snapshot.healthy_count,
            Health.UNHEALTHY.value: len(snapshot.devices) - snapshot.healthy_count,
        }
        return PluginStatus(
            resource=self.resource,
            # The kubelet's stream, not any stream: another client's stream beside a lost
            # registration would hide it (the kubelet never reopens ListAndWatch by itself).
            registered=self.link.registered
            and (self.streams.kubelet is not None or not self.link.stream_expected),
            streams=len(self.streams),
            pending_seconds=pending_seconds(self.state, self.streams),
            devices={health: n for health, n in counts.items() if n},
        )

    @property
    def devices(self) -> list[Device]:
        """The devices listed now (the previous plugin's that this one lacks included)."""
        return self.state.devices


def pending_seconds(state: DeviceState, streams: Streams) -> float:
    """How long the newest device list has waited to go out on the kubelet's stream.

    Measured from when the oldest version that stream has not sent appeared, so a loop that
    keeps changing still looks stuck; 0 when it is up to date or not open. Other clients'
    streams do not count: one that never reads must not make a healthy plugin look stuck.
    """
    sent = streams.kubelet_sent()
    if sent is None or sent >= state.version:
        return 0.0
    return state.clock() - state.changed_at(sent + 1)
