"""Runs a changing set of plugins: starts, stops and replaces them one resource at a time.

The runner hands it the initial plugins and, on every configuration reload, the new set. A
resource whose plugin is unchanged keeps running untouched; a changed one is stopped before its
replacement starts, so one resource never has two registrations; the devices it had and the new
plugin lacks stay listed as Unhealthy, so containers holding them keep a plugin that knows their
IDs, until the kubelet's checkpoint says no container holds them (``feed``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import anyio
import anyio.abc

from devplugin_sdk._engine import hooks
from devplugin_sdk._engine.events import Events
from devplugin_sdk._engine.handle import Strategy
from devplugin_sdk._engine.kubelet_watch import DirectoryWatcher
from devplugin_sdk._engine.served import ServedPlugin
from devplugin_sdk.observe import PluginStatus
from devplugin_sdk.plugin import DevicePlugin
from devplugin_sdk.settings import Settings
from devplugin_sdk.types import Device

log = logging.getLogger("devplugin_sdk")

__all__ = ["Supervisor"]


@dataclass(eq=False)
class _Entry:
    served: ServedPlugin
    fingerprint: str
    scope: anyio.CancelScope
    started: anyio.Event
    done: anyio.Event


class _Started:
    """The ``task_status`` a plugin reports its first discovery through."""

    def __init__(self, event: anyio.Event) -> None:
        self._event = event

    def started(self, value: None = None) -> None:
        self._event.set()


class Supervisor:
    """The plugins one runner serves, by resource name.

    Args:
        tg: The runner's task group; plugins run in it.
        settings: Lifecycle settings.
        watcher: The process's directory watcher.
        events: Where events go.
        strategy: How every plugin registers (chosen once by the runner).
    """

    def __init__(
        self,
        tg: anyio.abc.TaskGroup,
        settings: Settings,
        watcher: DirectoryWatcher,
        events: Events,
        strategy: Strategy,
    ) -> None:
        self._tg = tg
        self._settings = settings
        self._watcher = watcher
        self._events = events
        self._strategy = strategy
        self._running: dict[str, _Entry] = {}
        self._retired: dict[str, dict[str, Device]] = {}

    @property
    def resources(self) -> list[str]:
        """The resources served now."""
        return list(self._running)

    def statuses(self) -> list[PluginStatus]:
        """The status of every plugin served now."""
        return [entry.served.status() for entry in list(self._running.values())]

    async def apply(self, plugins: Sequence[DevicePlugin], *, fatal: bool) -> None:
        """Make the running set match ``plugins``.

        Args:
            plugins: The wanted plugins.
            fatal: True for the initial set: returns once every new plugin has discovered its
                devices, and a plugin's failure stops the runner. False for a reload: returns
                once the new plugins are started, and a failure is logged while the others run.

        Raises:
            ValueError: bad names or two plugins for one resource or socket; nothing changes.
            TypeError: a hook that is not ``async def``; nothing changes.
        """
        for plugin in plugins:
            plugin.validate_names()
            hooks.require_async(plugin)
        _check_unique(plugins)
        wanted = {p.resource_name: p for p in plugins}
        for resource, entry in list(self._running.items()):
            target = wanted.get(resource)
            if target is None or _fingerprint(target) != entry.fingerprint:
                log.info(
                    "%s: %s",
                    resource,
                    "removed by the new configuration"
                    if target is None
                    else "changed by the new configuration; restarting it",
                    extra={"resource": resource},
                )
                await self._stop(resource)
        started = [
            self._start(plugin, fatal)
            for resource, plugin in wanted.items()
            if resource not in self._running
        ]
        if fatal:
            for entry in started:
                await entry.started.wait()

    def _start(self, plugin: DevicePlugin, fatal: bool) -> _Entry:
        served = ServedPlugin(
            plugin,
            self._settings,
            self._watcher,
            self._events,
            self._strategy,
            inherited=self._retired.pop(plugin.resource_name, None),
        )
        entry = _Entry(
            served, _fingerprint(plugin), anyio.CancelScope(), anyio.Event(), anyio.Event()
        )
        self._running[plugin.resource_name] = entry

        async def run() -> None:
            try:
                with entry.scope:
                    await served.run(task_status=_Started(entry.started))
            except anyio.get_cancelled_exc_class():
                if not entry.scope.cancel_called:
                    raise
                # Our own stop, re-raised by a library without anyio's mark: grpc.aio cancels a
                # call in flight (a Register) and raises a CancelledError of its own, which the
                # scope does not recognise. Left to escape, it would cancel the runner's whole
                # task group: every other plugin, the reload loop, the HTTP endpoints.
            except Exception as exc:
                if fatal:
                    raise
                context = hooks.failure_context(exc) or f"{served.resource}: failed to start"
                log.error(  # noqa: TRY400 - one line; the traceback only at debug
                    "%s: %s (starting it from the new configuration)",
                    context,
                    hooks.describe(exc),
                    exc_info=exc if log.isEnabledFor(logging.DEBUG) else None,
                    extra={"resource": served.resource},
                )
            finally:
                if self._running.get(served.resource) is entry:
                    del self._running[served.resource]
                entry.done.set()

        self._tg.start_soon(run)
        return entry

    async def _stop(self, resource: str) -> None:
        entry = self._running.pop(resource)
        entry.scope.cancel()
        await entry.done.wait()
        devices = {d.id: d for d in entry.served.devices}
        self._retired[resource] = {**entry.served.feed.inherited, **devices}


def _check_unique(plugins: Sequence[DevicePlugin]) -> None:
    resources = [p.resource_name for p in plugins]
    sockets = [p.effective_socket_name for p in plugins]
    for what, names in (("resource name", resources), ("socket name", sockets)):
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"several plugins share the {what} {', '.join(duplicates)}")


def _fingerprint(plugin: DevicePlugin) -> str:
    return f"{plugin.effective_socket_name}|{plugin.fingerprint()}"
