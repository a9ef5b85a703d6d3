"""The lifecycle the SDK owns: serve -> register -> wait for a loss -> stop -> repeat.

One ``PluginRuntime`` per plugin holds its device state and runs its loop; one
``DirectoryWatcher`` per process wakes every loop when the device-plugin directory changes.
Discovery, polled health and pushed events run beside the loop for the plugin's whole life,
so health keeps flowing into the state across kubelet restarts.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import anyio
import grpc

from devplugin_sdk import _convert, _registration, _watcher_registration, fswatch
from devplugin_sdk._kubelet_watch import DirectoryWatcher, FileId, file_id
from devplugin_sdk._server import SocketVanishedError, start_server
from devplugin_sdk._servicer import DevicePluginServicer
from devplugin_sdk._state import DeviceState, Snapshot
from devplugin_sdk.errors import DevicePluginError
from devplugin_sdk.observe import Observer, PluginStatus
from devplugin_sdk.settings import Settings
from devplugin_sdk.types import Device, Health, HealthEvent, RescanEvent

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup  # type: ignore[import-not-found,unused-ignore]

if TYPE_CHECKING:
    from devplugin_sdk.api.deviceplugin.v1beta1 import deviceplugin_pb2 as pb
    from devplugin_sdk.plugin import DevicePlugin

log = logging.getLogger("devplugin_sdk")

__all__ = ["PluginRuntime", "Reload", "Supervisor", "run", "serve"]


class PluginRuntime:
    """Everything the SDK keeps for one plugin while it is served."""

    def __init__(
        self,
        plugin: DevicePlugin,
        settings: Settings,
        watcher: DirectoryWatcher,
        observer: Observer | None = None,
    ) -> None:
        self.plugin = plugin
        self.settings = settings
        self.watcher = watcher
        self.resource = plugin.resource_name
        self.state = DeviceState(self.resource)
        self.watcher_mode = settings.uses_plugin_watcher()
        directory = (
            settings.plugins_registry_dir if self.watcher_mode else settings.device_plugin_dir
        )
        self.socket_path = directory / plugin.effective_socket_name
        self._renew = False  # the plugin watcher reported a failed registration
        # Devices of this resource's previous plugin (before a reload), kept listed Unhealthy
        # when the new plugin lacks them: containers may still hold them.
        self.inherited: dict[str, Device] = {}
        self.servicer = DevicePluginServicer(self)
        self.streams: set[int] = set()
        self._next_stream = 0
        self.no_stream_since: float | None = None
        self.registered = False
        self.observer = observer
        self._stream_versions: dict[int, int] = {}
        self._options = _convert.options(
            pre_start_required=plugin.overrides("pre_start_container"),
            preferred_allocation=plugin.overrides("preferred_allocation"),
        )

    @property
    def extra(self) -> dict[str, str]:
        return {"resource": self.resource}

    # ------------------------------------------------------------------ servicer callbacks

    def options_message(self) -> pb.DevicePluginOptions:
        return self._options

    def stream_started(self) -> int:
        self._next_stream += 1
        self.streams.add(self._next_stream)
        self._stream_versions[self._next_stream] = -1
        self.no_stream_since = None
        log.info(
            "%s: ListAndWatch stream opened (%d open)",
            self.resource,
            len(self.streams),
            extra=self.extra,
        )
        self.watcher.notify()
        return self._next_stream

    def stream_ended(self, stream_id: int) -> None:
        self.streams.discard(stream_id)
        self._stream_versions.pop(stream_id, None)
        if not self.streams:
            self.no_stream_since = time.monotonic()
        log.info(
            "%s: ListAndWatch stream ended (%d open)",
            self.resource,
            len(self.streams),
            extra=self.extra,
        )
        self.watcher.notify()

    def list_sent(self, snapshot: Snapshot, stream_id: int) -> None:
        self._stream_versions[stream_id] = snapshot.version
        healthy = snapshot.healthy_count
        self._notify("list_sent", self.resource, healthy, len(snapshot.devices) - healthy)
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "%s: sent %d devices (%d healthy)",
                self.resource,
                len(snapshot.devices),
                healthy,
                extra=self.extra,
            )

    def allocation_done(self, seconds: float, error: grpc.StatusCode | None) -> None:
        self._notify("allocation", self.resource, seconds, error.name if error else None)

    def rpc_failed(self, rpc: str, code: grpc.StatusCode) -> None:
        if rpc != "Allocate":
            self._notify("rpc_error", self.resource, rpc, code.name)

    def status(self) -> PluginStatus:
        """This plugin's state for liveness checks (see ``observe.PluginStatus``)."""
        # A list is pending while some open stream has not sent the newest version; measured
        # from when the oldest unsent version appeared, so a loop that keeps changing still
        # looks stuck.
        pending = 0.0
        if self.streams:
            oldest_sent = min(self._stream_versions.values(), default=-1)
            if oldest_sent < self.state.version:
                pending = time.monotonic() - self.state.changed_at(oldest_sent + 1)
        snapshot = self.state.snapshot()
        counts = {
            Health.HEALTHY.value: snapshot.healthy_count,
            Health.UNHEALTHY.value: len(snapshot.devices) - snapshot.healthy_count,
        }
        counts = {health: n for health, n in counts.items() if n}
        return PluginStatus(
            resource=self.resource,
            registered=self.registered and bool(self.streams),
            streams=len(self.streams),
            pending_seconds=pending,
            devices=counts,
        )

    def _notify(self, event: str, *args: object) -> None:
        method = getattr(self.observer, event, None)
        if method is None:
            return
        try:
            method(*args)
        except Exception:
            log.exception("observer %s.%s failed", type(self.observer).__name__, event)

    # ------------------------------------------------------------------ the plugin's life

    async def run(self) -> None:
        """Discover, then keep the plugin registered until cancelled."""
        devices = await self.plugin.discover()
        self.state.set_devices(self._with_inherited(devices))
        log.info("%s: discovered %d devices", self.resource, len(devices), extra=self.extra)
        try:
            async with anyio.create_task_group() as tg:
                if self.plugin.overrides("check_health"):
                    tg.start_soon(self._poll_health)
                if self.plugin.overrides("watch"):
                    tg.start_soon(self._consume_events)
                if self.watcher_mode:
                    await self._serve_for_plugin_watcher()
                else:
                    await self._serve_registrations()
        finally:
            with anyio.CancelScope(shield=True), anyio.move_on_after(self.settings.stop_timeout):
                try:
                    await self.plugin.on_stop()
                except Exception:
                    log.exception("%s: on_stop failed", self.resource, extra=self.extra)

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
                    extra=self.extra,
                )
        except Exception:
            log.exception(
                "%s: rediscovery failed; keeping the previous devices",
                self.resource,
                extra=self.extra,
            )

    def _with_inherited(self, devices: Sequence[Device]) -> list[Device]:
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
                    "%s: check_health failed; health unchanged", self.resource, extra=self.extra
                )
            await anyio.sleep(self.plugin.health_interval or self.settings.health_interval)

    async def _consume_events(self) -> None:
        delay = 0.5
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
                                extra=self.extra,
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
                    extra=self.extra,
                )
                await anyio.sleep(delay)
                delay = min(delay * 2, 30.0)
            else:
                log.info("%s: watch() finished", self.resource, extra=self.extra)
                return

    async def _serve_registrations(self) -> None:
        settings = self.settings
        kubelet_socket = settings.kubelet_socket
        server: grpc.aio.Server | None = None
        own_id: FileId | None = None
        registered_with: FileId | None = None  # the kubelet.sock we last registered with
        stopped_at: float | None = None
        backoff = settings.register_backoff_initial
        waiting_logged = False
        try:
            while True:
                generation = self.watcher.generation
                kubelet_id = file_id(kubelet_socket)
                if kubelet_id is None:
                    if not waiting_logged:
                        log.info(
                            "%s: waiting for %s", self.resource, kubelet_socket, extra=self.extra
                        )
                        waiting_logged = True
                    await self.watcher.wait(generation)
                    continue
                waiting_logged = False
                if server is None or file_id(self.socket_path) != own_id:
                    if server is not None:
                        stopping, server = server, None  # never stopped twice, even if cancelled
                        await self._stop(stopping)
                        stopped_at = time.monotonic()
                    try:
                        server, own_id = await start_server(
                            self.socket_path, [self.servicer.handler()]
                        )
                    except SocketVanishedError:
                        log.info(
                            "%s: socket removed as it was created (kubelet starting); again",
                            self.resource,
                            extra=self.extra,
                        )
                        server = None
                        with anyio.move_on_after(settings.register_backoff_initial):
                            await self.watcher.wait(generation)
                        continue
                if registered_with == kubelet_id and stopped_at is not None:
                    # Same kubelet as before: let it process the old stream's end first, or it
                    # may tear down the new registration (kubelet issue #121994).
                    remaining = settings.reregister_delay - (time.monotonic() - stopped_at)
                    if remaining > 0:
                        await anyio.sleep(remaining)
                started = time.perf_counter()
                # Changes during the attempt (a new kubelet.sock) must wake the retry too.
                attempt = self.watcher.generation
                outcome, why = await _registration.register_once(
                    kubelet_socket,
                    _registration.register_request(
                        self.resource, self.socket_path.name, self._options
                    ),
                    settings.register_timeout,
                )
                if outcome is _registration.Outcome.TIMED_OUT:
                    # Outcome unknown: kubelets up to v1.34 finish a registration the client
                    # gave up on. A ListAndWatch stream arriving means it succeeded; retrying
                    # at once would register twice.
                    with anyio.move_on_after(settings.register_timeout):
                        while not self.streams:
                            await self.watcher.wait(self.watcher.generation)
                    if self.streams:
                        outcome = _registration.Outcome.REGISTERED
                if outcome is not _registration.Outcome.REGISTERED:
                    log.warning(
                        "%s: Register failed (%s); retrying in %.2gs",
                        self.resource,
                        why,
                        backoff,
                        extra=self.extra,
                    )
                    with anyio.move_on_after(backoff):
                        # A change in the directory (a new kubelet.sock) retries at once.
                        await self.watcher.wait(attempt)
                    backoff = min(backoff * 2, settings.register_backoff_max)
                    continue
                backoff = settings.register_backoff_initial
                self.registered = True
                self._notify("registered", self.resource, time.perf_counter() - started)
                registered_with = kubelet_id
                if not self.streams:
                    self.no_stream_since = time.monotonic()
                log.info(
                    "%s: registered with the kubelet as %s in %.1f ms",
                    self.resource,
                    self.socket_path.name,
                    (time.perf_counter() - started) * 1000,
                    extra=self.extra,
                )
                reason = await self._wait_for_loss(own_id, kubelet_id)
                self.registered = False
                self._notify("reregistering", self.resource, reason)
                log.info(
                    "%s: %s; serving and registering again", self.resource, reason, extra=self.extra
                )
                stopping, server = server, None
                await self._stop(stopping)
                stopped_at = time.monotonic()
        finally:
            self.registered = False
            if server is not None:
                with anyio.CancelScope(shield=True):
                    await self._stop(server)

    def registration_status(self, registered: bool, error: str) -> None:
        """NotifyRegistrationStatus from the kubelet's plugin watcher."""
        if registered:
            self.registered = True
            self._notify("registered", self.resource, 0.0)
            log.info("%s: registered through the plugin watcher", self.resource, extra=self.extra)
            return
        self.registered = False
        log.error(
            "%s: the kubelet's plugin watcher failed to register us: %s; recreating the socket",
            self.resource,
            error,
            extra=self.extra,
        )
        # The kubelet does not retry once it has recorded the plugin: a new socket starts over.
        self._renew = True
        self.watcher.notify()

    async def _serve_for_plugin_watcher(self) -> None:
        """Serve both APIs on one socket in plugins_registry; the kubelet finds it by itself.

        The kubelet re-discovers the socket after its own restarts, so only a removed socket or
        a failed registration makes us serve again on a fresh one.
        """
        handlers = [
            self.servicer.handler(),
            _watcher_registration.handler(self.resource, self.registration_status),
        ]
        server: grpc.aio.Server | None = None
        try:
            while True:
                self._renew = False
                self.socket_path.parent.mkdir(parents=True, exist_ok=True)
                try:
                    server, own_id = await start_server(self.socket_path, handlers)
                except SocketVanishedError:
                    server = None
                    await anyio.sleep(self.settings.register_backoff_initial)
                    continue
                log.info(
                    "%s: serving for the plugin watcher on %s",
                    self.resource,
                    self.socket_path,
                    extra=self.extra,
                )
                while not self._renew and file_id(self.socket_path) == own_id:
                    await self.watcher.wait(self.watcher.generation)
                reason = "registration failed" if self._renew else "our socket was removed"
                self._notify("reregistering", self.resource, reason)
                stopping, server = server, None
                await self._stop(stopping)
        finally:
            self.registered = False
            if server is not None:
                with anyio.CancelScope(shield=True):
                    await self._stop(server)

    async def _wait_for_loss(self, own_id: FileId | None, kubelet_id: FileId) -> str:
        """Wait until the registration is lost; return why."""
        grace = self.settings.stream_lost_grace
        while True:
            generation = self.watcher.generation
            if file_id(self.socket_path) != own_id:
                # The kubelet deletes every socket in its directory when it starts.
                return "our socket was removed (kubelet restart)"
            current = file_id(self.settings.kubelet_socket)
            if current is not None and current != kubelet_id:
                return "kubelet.sock was recreated (kubelet restart)"
            timeout = math.inf
            if not self.streams and self.no_stream_since is not None and current is not None:
                # The kubelet never retries a closed ListAndWatch: only a new registration helps.
                lost_for = time.monotonic() - self.no_stream_since
                if lost_for >= grace:
                    return f"no ListAndWatch stream for {lost_for:.1f}s while the kubelet is up"
                timeout = grace - lost_for
            with anyio.move_on_after(timeout):
                await self.watcher.wait(generation)

    async def _stop(self, server: grpc.aio.Server) -> None:
        """Let in-flight calls finish, end every ListAndWatch stream cleanly, stop the server.

        The kubelet closes its connection when the stream ends, which would cancel an Allocate
        still running on it: calls get up to ``stop_grace`` first.
        """
        with anyio.CancelScope(shield=True):
            with anyio.move_on_after(self.settings.stop_grace):
                await self.servicer.idle()
            self.state.close()
            await server.stop(self.settings.stop_grace)
            self.state.reopen()


def _check_unique(plugins: Sequence[DevicePlugin]) -> None:
    resources = [p.resource_name for p in plugins]
    sockets = [p.effective_socket_name for p in plugins]
    for what, names in (("resource name", resources), ("socket name", sockets)):
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"several plugins share the {what} {', '.join(duplicates)}")


def _reraise_single(group: BaseExceptionGroup[BaseException]) -> NoReturn:
    """Raise the one meaningful error of a task group failure, not the group."""
    errors: list[BaseException] = []

    def collect(exc: BaseException) -> None:
        if isinstance(exc, BaseExceptionGroup):
            for inner in exc.exceptions:
                collect(inner)
        elif not isinstance(exc, anyio.get_cancelled_exc_class()):
            errors.append(exc)

    collect(group)
    preferred = [e for e in errors if isinstance(e, (DevicePluginError, ValueError, OSError))]
    if len(errors) == 1 or preferred:
        raise (preferred or errors)[0]
    raise group


#: Runtimes of the plugins this process serves, for status endpoints.
RUNTIMES: list[PluginRuntime] = []


def statuses() -> list[PluginStatus]:
    """The status of every plugin this process serves."""
    return [runtime.status() for runtime in list(RUNTIMES)]


@dataclass(frozen=True, slots=True)
class Reload:
    """How a served plugin set is reloaded: on SIGHUP and when ``config_path`` changes.

    Attributes:
        load: Builds the new plugin list (reads and validates the configuration); an exception
            keeps the running plugins and is logged.
        config_path: File whose changes trigger a reload (its directory is watched, so a
            Kubernetes ConfigMap's symlink swap counts); None for SIGHUP only.
        sighup: Reload on SIGHUP (needs the main thread).
    """

    load: Callable[[], Sequence[DevicePlugin]]
    config_path: Path | None = None
    sighup: bool = True


@dataclass(eq=False)
class _Entry:
    runtime: PluginRuntime
    scope: anyio.CancelScope
    done: anyio.Event
    fingerprint: str


class Supervisor:
    """Runs a changing set of plugins: starts, stops and replaces them one resource at a time.

    A resource whose plugin is unchanged keeps running untouched. A changed one is stopped
    before its replacement starts, so one resource never has two registrations; the devices
    it had and the new one lacks stay listed as Unhealthy, so containers holding them keep a
    plugin that knows their IDs.
    """

    def __init__(
        self,
        tg: anyio.abc.TaskGroup,
        settings: Settings,
        watcher: DirectoryWatcher,
        observer: Observer | None,
    ) -> None:
        self._tg = tg
        self._settings = settings
        self._watcher = watcher
        self._observer = observer
        self._running: dict[str, _Entry] = {}
        self._retired: dict[str, dict[str, Device]] = {}

    @property
    def resources(self) -> list[str]:
        return list(self._running)

    async def apply(self, plugins: Sequence[DevicePlugin], *, fatal: bool) -> None:
        """Make the running set match ``plugins``.

        Args:
            plugins: The wanted plugins.
            fatal: Whether a started plugin's failure stops everything (the initial set) or
                is logged and leaves the others running (a reload).

        Raises:
            ValueError: bad names or two plugins for one resource or socket; nothing changes.
        """
        for plugin in plugins:
            plugin.validate_names()
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
        for resource, plugin in wanted.items():
            if resource not in self._running:
                self._start(plugin, fatal)

    def _start(self, plugin: DevicePlugin, fatal: bool) -> None:
        runtime = PluginRuntime(plugin, self._settings, self._watcher, self._observer)
        runtime.inherited = self._retired.pop(plugin.resource_name, {})
        entry = _Entry(runtime, anyio.CancelScope(), anyio.Event(), _fingerprint(plugin))
        self._running[plugin.resource_name] = entry
        RUNTIMES.append(runtime)

        async def run() -> None:
            try:
                with entry.scope:
                    await runtime.run()
            except Exception:
                if fatal:
                    raise
                log.exception(
                    "%s: failed to start from the new configuration",
                    runtime.resource,
                    extra=runtime.extra,
                )
            finally:
                RUNTIMES.remove(runtime)
                if self._running.get(runtime.resource) is entry:
                    del self._running[runtime.resource]
                entry.done.set()

        self._tg.start_soon(run)

    async def _stop(self, resource: str) -> None:
        entry = self._running.pop(resource)
        entry.scope.cancel()
        await entry.done.wait()
        devices = {d.id: d for d in entry.runtime.state.devices}
        self._retired[resource] = {**entry.runtime.inherited, **devices}


def _fingerprint(plugin: DevicePlugin) -> str:
    return f"{plugin.effective_socket_name}|{plugin.fingerprint()}"


async def serve(
    plugins: Sequence[DevicePlugin],
    settings: Settings | None = None,
    observer: Observer | None = None,
    reload: Reload | None = None,
) -> None:
    """Serve ``plugins`` until cancelled (see ``devplugin_sdk.serve``)."""
    if not plugins:
        raise ValueError("serve() needs at least one plugin")
    settings = settings or Settings()
    watched = [settings.device_plugin_dir]
    if settings.uses_plugin_watcher():
        watched = [settings.plugins_registry_dir]
    watcher = DirectoryWatcher(watched, settings.restart_poll_interval)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(watcher.run)
            supervisor = Supervisor(tg, settings, watcher, observer)
            await supervisor.apply(plugins, fatal=True)
            if reload is not None:
                tg.start_soon(_reload_loop, supervisor, reload)
    except BaseExceptionGroup as group:
        _reraise_single(group)


async def _reload_loop(supervisor: Supervisor, reload: Reload) -> None:
    """Reload on SIGHUP and on changes of the configuration file."""
    wakeup = anyio.Event()
    reasons: list[str] = []

    def trigger(reason: str) -> None:
        reasons.append(reason)
        wakeup.set()

    async def on_sighup() -> None:
        with anyio.open_signal_receiver(signal.SIGHUP) as signals:
            async for _ in signals:
                trigger("SIGHUP")

    async def on_file_change(path: Path) -> None:
        digest = _digest(path)
        async for _ in fswatch.watch([path.parent], poll_interval=5.0):
            # ConfigMaps change by swapping symlinks in the directory: compare the content.
            new = _digest(path)
            if new != digest:
                digest = new
                trigger(f"{path} changed")

    async with anyio.create_task_group() as tg:
        if reload.sighup:
            tg.start_soon(on_sighup)
        if reload.config_path is not None:
            tg.start_soon(on_file_change, reload.config_path)
        while True:
            await wakeup.wait()
            wakeup = anyio.Event()
            why = ", ".join(dict.fromkeys(reasons))
            reasons.clear()
            try:
                plugins = reload.load()
                await supervisor.apply(plugins, fatal=False)
            except Exception as exc:
                # A bad configuration is expected input: its message, not a traceback.
                log.error("reload (%s) failed; keeping the running plugins: %s", why, exc)  # noqa: TRY400
            else:
                log.info("reloaded (%s): serving %s", why, ", ".join(supervisor.resources))


def _digest(path: Path) -> bytes | None:
    try:
        return hashlib.sha256(path.read_bytes()).digest()
    except OSError:
        return None


def run(
    plugins: Sequence[DevicePlugin],
    settings: Settings | None = None,
    observer: Observer | None = None,
    reload: Reload | None = None,
) -> None:
    """Serve ``plugins`` in a new event loop until SIGTERM/SIGINT (see ``devplugin_sdk.run``)."""
    run_until_signal(lambda: serve(plugins, settings, observer, reload))


def run_until_signal(work: Callable[[], Awaitable[None]]) -> None:
    """Run ``work()`` in a new asyncio event loop until it returns or SIGTERM/SIGINT arrives.

    A signal cancels ``work`` (which cleans up in its ``finally``s); an error it raises comes
    out as itself, not as an exception group.
    """

    async def main() -> None:
        try:
            async with anyio.create_task_group() as tg:

                async def stop_on_signal() -> None:
                    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                        async for signum in signals:
                            log.info("received %s; shutting down", signal.Signals(signum).name)
                            tg.cancel_scope.cancel()
                            return

                tg.start_soon(stop_on_signal)
                await work()
                tg.cancel_scope.cancel()
        except BaseExceptionGroup as group:
            _reraise_single(group)

    anyio.run(main, backend="asyncio")
