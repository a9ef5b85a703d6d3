"""The one way to run plugins: ``serve`` inside an event loop, ``run`` until SIGTERM/SIGINT.

Everything else is an option of these two, as in kopf's ``operator()``/``run()``: the HTTP
endpoints (``Http``), hot reload (``Reload``), an ``Observer`` and the kubelet API the plugins
are served through (``api``: the device-plugin API, Dynamic Resource Allocation with ``dra``, or
both). ``devplugin run`` calls ``run``; ``devplugin_sdk.testing.serving`` runs ``serve`` in the
background of a test. How plugins register (``kubelet.sock``, the plugin watcher, or as a DRA
driver) is decided once, when ``serve`` starts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import signal
import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import anyio
import anyio.abc
from anyio.abc import TaskStatus

from devplugin_sdk import config, fswatch
from devplugin_sdk._engine import kubelet_sock
from devplugin_sdk._engine.events import Events
from devplugin_sdk._engine.kubelet_watch import DirectoryWatcher
from devplugin_sdk._engine.supervisor import Supervisor
from devplugin_sdk._engine.watchdog import watch_loop
from devplugin_sdk._limits import DEFAULT_MAX_CONNECTIONS, DEFAULT_STUCK_AFTER
from devplugin_sdk._logging import configure_logging
from devplugin_sdk.errors import ConfigError, MissingDependencyError
from devplugin_sdk.observe import DraStatus, Observer, PluginStatus
from devplugin_sdk.settings import Settings

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup

if TYPE_CHECKING:
    from devplugin_sdk._engine.handle import Strategy
    from devplugin_sdk.dra import Api, Dra
    from devplugin_sdk.dra._driver import DraDriver
    from devplugin_sdk.plugin import DevicePlugin

log = logging.getLogger("devplugin_sdk")

__all__ = ["DraStatus", "Http", "Reload", "Running", "run", "serve"]


@dataclass(frozen=True, slots=True)
class Http:
    """Serve ``/healthz``, ``/metrics`` and ``/status`` beside the plugins (``healthz``).

    Args:
        port: TCP port; 0 picks a free one (``Running.http_port`` tells which).
        host: Address to bind; None binds every address, which is what the kubelet's httpGet
            probes and Prometheus (both coming to the pod IP) need.
        stuck_after: Seconds a newest device list may wait unsent on an open ListAndWatch
            stream before ``/healthz`` fails.
        registry: The prometheus_client ``CollectorRegistry`` behind ``/metrics`` (the
            library's default registry when None). Without an ``observer``, the runner
            registers a ``metrics.PrometheusObserver`` on it.
        max_connections: HTTP connections served at once; at the cap a new connection closes
            the oldest one, so idle clients can neither use up the process's file descriptors
            nor lock the kubelet's probes out.
    """

    port: int
    host: str | None = None
    stuck_after: float = DEFAULT_STUCK_AFTER
    registry: Any = None
    max_connections: int = DEFAULT_MAX_CONNECTIONS

    def __post_init__(self) -> None:
        if isinstance(self.port, bool) or not isinstance(self.port, int):
            raise TypeError(f"Http.port must be an int, got {type(self.port).__name__}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"Http.port must be a TCP port (0-65535), got {self.port}")
        if self.stuck_after <= 0:
            raise ValueError(f"Http.stuck_after must be > 0, got {self.stuck_after}")
        if isinstance(self.max_connections, bool) or not isinstance(self.max_connections, int):
            raise TypeError(
                f"Http.max_connections must be an int, got {type(self.max_connections).__name__}"
            )
        if self.max_connections < 1:
            raise ValueError(f"Http.max_connections must be >= 1, got {self.max_connections}")


@dataclass(frozen=True, slots=True)
class Reload:
    """Reload the served plugins on SIGHUP and when ``config_path`` changes.

    A resource whose plugin is unchanged (same ``DevicePlugin.fingerprint``) keeps running; a
    changed one is stopped before its replacement registers, and the devices the replacement
    lacks stay listed Unhealthy until the kubelet's checkpoint says no container holds them; a
    removed one stops. An error from
    ``load`` keeps the running plugins and is logged.

    ``load`` runs on the event loop, beside the plugins' gRPC calls: a blocking ``load`` stalls
    every Allocate for as long as it takes. Make it a coroutine function that reads and parses in
    a worker thread, then builds the plugins on the loop (constructors may create anyio
    primitives, which need it)::

        async def load() -> list[DevicePlugin]:
            data = await anyio.to_thread.run_sync(config.load_yaml, path)
            return MyPlugin.from_config(data)

    Args:
        load: Builds the new plugin list (reads and validates the configuration): a function,
            or a coroutine function (awaited).
        config_path: File whose content changes trigger a reload; None for SIGHUP only. Both the
            file (an edit in place) and its directory (a Kubernetes ConfigMap's symlink swap, an
            editor's rename) are watched, and the content is compared, read in a worker thread.
        sighup: Reload on SIGHUP (needs the main thread).
    """

    load: Callable[[], Sequence[DevicePlugin] | Awaitable[Sequence[DevicePlugin]]]
    config_path: Path | None = None
    sighup: bool = True


class Running:
    """A running ``serve()``, as handed to ``task_status.started()``.

    Attributes:
        http_port: The bound HTTP port, or None without ``http``.
    """

    def __init__(
        self, supervisor: Supervisor, driver: DraDriver | None, http_port: int | None
    ) -> None:
        self._supervisor = supervisor
        self._driver = driver
        self.http_port = http_port

    @property
    def resources(self) -> list[str]:
        """The resources served now."""
        return self._supervisor.resources

    def statuses(self) -> list[PluginStatus]:
        """The status of every plugin this runner serves (what ``/healthz`` reads)."""
        return self._supervisor.statuses()

    @property
    def dra(self) -> DraStatus | None:
        """The DRA driver's state, or None when the runner serves no DRA driver."""
        return None if self._driver is None else self._driver.status()


async def serve(
    *plugins: DevicePlugin,
    settings: Settings | None = None,
    observer: Observer | None = None,
    http: Http | None = None,
    reload: Reload | None = None,
    api: Api = "devicePlugin",
    dra: Dra | None = None,
    task_status: TaskStatus[Running] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``plugins`` in the running event loop until cancelled.

    Each plugin gets its own socket, registration and ListAndWatch streams; one directory
    watcher serves them all. ``task_status.started(Running)`` is called once the HTTP port is
    bound, every plugin has discovered its devices and (with ``reload``) the file is watched,
    so ``await tg.start(serve, ...)`` returns a running set or raises why it could not start.
    On cancellation every ListAndWatch stream ends cleanly, in-flight calls get
    ``Settings.stop_grace``, the servers stop, the sockets are removed and each plugin's
    ``on_stop`` runs. Must run on the asyncio backend (grpc.aio).

    Args:
        plugins: The plugins, at least one, with distinct resource and socket names.
        settings: Lifecycle settings (defaults: a production node).
        observer: Receives lifecycle and RPC events (``observe.Observer``); with ``http`` and no
            observer, a ``metrics.PrometheusObserver`` on ``http.registry`` (when the
            ``metrics`` extra is installed).
        http: Serve the HTTP endpoints.
        reload: Reload the plugin set on SIGHUP and configuration changes.
        api: ``"devicePlugin"`` registers each plugin with the device-plugin API;
            ``"dra"`` serves them all as the kubelet plugin of the DRA driver ``dra``,
            publishing their devices in ResourceSlices; ``"both"`` does both, each device going
            one way only (``Dra.devices``).
        dra: The DRA driver, with ``api`` ``"dra"`` or ``"both"``.
        task_status: Reports the ``Running`` set (``TaskGroup.start``).

    Raises:
        ValueError: no plugins, bad names, two plugins for one resource or socket, or an
            ``api``/``dra`` mismatch.
        MissingDependencyError: DRA without a Kubernetes client (the ``dra`` extra).
        OSError: the HTTP address cannot be bound (before any plugin starts).
        RegistrationRejectedError: the kubelet rejected a plugin for good.
        SocketInUseError: another live server answers on a plugin's socket.
        ExceptionGroup: several of the above at once (none is dropped).
    """
    settings = settings or Settings()
    watcher, strategy, driver = _registration(plugins, settings, api, dra)
    _log_startup(plugins, settings, api, dra=dra, http=http, reload=reload)
    if http is not None and observer is None:
        observer = _prometheus_observer(http.registry)
    events = Events(observer)
    if driver is not None:
        driver.events = events
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(watch_loop)  # says when a hook blocks the loop
            supervisor = Supervisor(tg, settings, watcher, events, strategy)
            running = Running(supervisor, driver, await _serve_http(tg, http, supervisor.statuses))
            events.serving(running.statuses)
            await _start(tg, supervisor, plugins, watcher=watcher, driver=driver, reload=reload)
            task_status.started(running)
    except BaseExceptionGroup as group:
        raise_errors(group)


def run(
    *plugins: DevicePlugin,
    settings: Settings | None = None,
    observer: Observer | None = None,
    http: Http | None = None,
    reload: Reload | None = None,
    api: Api = "devicePlugin",
    dra: Dra | None = None,
) -> None:
    """Serve ``plugins`` in a new event loop until SIGTERM or SIGINT, then clean up.

    The blocking twin of ``serve`` (same arguments, same errors), for a plugin's ``__main__``
    and for ``devplugin run``. A program that set up no logging (no handler on the root logger)
    gets the ``devplugin`` command's: INFO and up, as text on stderr; one that did keeps its own.
    """
    if not log.hasHandlers():
        configure_logging("info", "text")

    async def main() -> None:
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(_cancel_on_signal, tg.cancel_scope)
                await serve(
                    *plugins,
                    settings=settings,
                    observer=observer,
                    http=http,
                    reload=reload,
                    api=api,
                    dra=dra,
                )
                tg.cancel_scope.cancel()
        except BaseExceptionGroup as group:
            raise_errors(group)

    anyio.run(main, backend="asyncio")


async def _cancel_on_signal(scope: anyio.CancelScope) -> None:
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for signum in signals:
            log.info("received %s; shutting down", signal.Signals(signum).name)
            scope.cancel()
            return


def raise_errors(group: BaseExceptionGroup[BaseException]) -> NoReturn:
    """Raise what a task group failed with: its one error as itself, several as one group.

    Cancellations are dropped (they only say that the others were stopped); no real error is.
    Call it in the event loop, in the ``except`` of the task group.
    """
    errors: list[BaseException] = []

    def collect(exc: BaseException) -> None:
        if isinstance(exc, BaseExceptionGroup):
            for inner in exc.exceptions:
                collect(inner)
        elif not isinstance(exc, anyio.get_cancelled_exc_class()):
            errors.append(exc)

    collect(group)
    if len(errors) == 1:
        # Raised from inside the group's handling: the group is no context worth a second
        # traceback (its one real error is this one).
        errors[0].__suppress_context__ = True
        raise errors[0]
    if not errors:
        raise group
    raise BaseExceptionGroup(f"{len(errors)} errors while serving", errors)


def _registration(
    plugins: Sequence[DevicePlugin], settings: Settings, api: str, dra: Dra | None
) -> tuple[DirectoryWatcher, Strategy, DraDriver | None]:
    """How every plugin registers, the directory watcher that wakes the registration loops, and
    the DRA driver (with ``api`` ``"dra"`` or ``"both"``).

    Decided once: the registration path does not change while the process runs.
    """
    if not plugins:
        raise ValueError("serve() needs at least one plugin")
    if api not in ("devicePlugin", "dra", "both"):
        raise ValueError(f"api must be devicePlugin, dra or both, got {api!r}")
    if api == "devicePlugin" and dra is not None:
        raise ValueError("dra= is given but api is devicePlugin; say api='dra' or 'both'")
    if api != "devicePlugin" and dra is None:
        raise ValueError(f"api={api!r} needs dra=Dra(driver=...): the DRA driver to serve")
    strategy: Strategy
    if settings.uses_plugin_watcher():
        # Its protocol is imported only for the kubelets that need it (cold start).
        from devplugin_sdk._engine import plugin_watcher  # noqa: PLC0415

        strategy, watched = plugin_watcher.keep_registered, settings.plugins_registry_dir
    else:
        strategy, watched = kubelet_sock.keep_registered, settings.device_plugin_dir
    if api == "dra":  # no device-plugin directory to watch (a DRA pod may not mount it)
        watched = settings.plugins_registry_dir
    watcher = DirectoryWatcher([watched], settings.restart_poll_interval)
    if dra is None:
        return watcher, strategy, None
    from devplugin_sdk.dra._driver import DraDriver  # noqa: PLC0415 - only for DRA

    expected = [p.resource_name for p in plugins]
    driver = DraDriver(dra, settings, watcher, both=api == "both", expected=expected)
    return watcher, driver.strategy(strategy), driver


def _log_startup(
    plugins: Sequence[DevicePlugin],
    settings: Settings,
    api: str,
    *,
    dra: Dra | None,
    http: Http | None,
    reload: Reload | None,
) -> None:
    """One line that says what starts and how: the SDK's version, the resources, the
    registration path and why it was chosen, and every setting that differs from its default."""
    from devplugin_sdk import __version__  # noqa: PLC0415 - the package imports this module

    parts = [", ".join(p.resource_name for p in plugins), f"api {api}"]
    if api != "dra":
        mode, why = settings.registration_choice()
        if mode == "watcher":
            where = f"the plugin watcher in {settings.plugins_registry_dir}"
        else:
            where = f"kubelet.sock at {settings.kubelet_socket}"
        parts.append(f"registering through {where} ({why})")
    if dra is not None:
        parts.append(
            f"DRA driver {dra.driver} registering through the plugin watcher in "
            f"{settings.plugins_registry_dir}"
        )
    if reload is not None and reload.config_path is not None:
        parts.append(f"config {reload.config_path}")
    if http is not None:
        parts.append(f"http {http.host or '*'}:{http.port}")
    changed = [
        f"{field.name}={getattr(settings, field.name)}"
        for field in dataclasses.fields(settings)
        if field.name not in ("device_plugin_dir", "plugins_registry_dir", "registration")
        and getattr(settings, field.name) != field.default
    ]
    if changed:
        parts.append(f"settings {' '.join(changed)}")
    log.info("devplugin-sdk %s starting: %s", __version__, "; ".join(parts))


async def _start(
    tg: anyio.abc.TaskGroup,
    supervisor: Supervisor,
    plugins: Sequence[DevicePlugin],
    *,
    watcher: DirectoryWatcher,
    driver: DraDriver | None,
    reload: Reload | None,
) -> None:
    """Start the DRA driver, the directory watcher, the plugins and the reload loop in ``tg``;
    return once every plugin has discovered its devices (and the file is watched)."""
    if driver is not None:
        await tg.start(driver.run)  # its directories exist before they are watched
    tg.start_soon(watcher.run)
    await supervisor.apply(plugins, fatal=True)
    if reload is not None:
        await tg.start(_reload_loop, supervisor, reload)  # watching when it returns


async def _serve_http(
    tg: anyio.abc.TaskGroup, http: Http | None, statuses: Callable[[], list[PluginStatus]]
) -> int | None:
    """Serve the HTTP endpoints in ``tg`` (with ``http``); the bound port."""
    if http is None:
        return None
    # Loaded only when a port is served (cold start without HTTP).
    from devplugin_sdk import healthz  # noqa: PLC0415

    port: int = await tg.start(
        partial(
            healthz.serve_http,
            http.host,
            http.port,
            statuses=statuses,
            stuck_after=http.stuck_after,
            registry=http.registry,
            max_connections=http.max_connections,
        )
    )
    return port


def _prometheus_observer(registry: Any) -> Observer | None:
    from devplugin_sdk.metrics import PrometheusObserver  # noqa: PLC0415 - an optional extra

    try:
        return PrometheusObserver(registry)
    except MissingDependencyError as exc:
        log.warning("%s; /metrics is off (it answers 404)", exc)
        return None


async def _reload_loop(
    supervisor: Supervisor,
    reload: Reload,
    *,
    task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Reload on SIGHUP and on changes of the configuration file's content.

    Reports started once SIGHUP is handled and the file is watched, so that no change made
    after ``serve`` has started is missed.
    """
    wakeup = anyio.Event()
    reasons: list[str] = []

    def trigger(reason: str) -> None:
        reasons.append(reason)
        wakeup.set()

    async def on_sighup(*, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        with anyio.open_signal_receiver(signal.SIGHUP) as signals:
            task_status.started()
            async for _ in signals:
                trigger("SIGHUP")

    async with anyio.create_task_group() as tg:
        if reload.sighup:
            await tg.start(on_sighup)
        if reload.config_path is not None:
            await tg.start(_on_file_change, reload.config_path, trigger)
        task_status.started()
        while True:
            await wakeup.wait()
            wakeup = anyio.Event()
            why = ", ".join(dict.fromkeys(reasons))
            reasons.clear()
            try:
                loaded = reload.load()
                plugins = await loaded if inspect.isawaitable(loaded) else loaded
                await supervisor.apply(plugins, fatal=False)
            except Exception as exc:
                # A bad configuration is expected input: its message, not a traceback.
                log.error("reload (%s) failed; keeping the running plugins: %s", why, exc)  # noqa: TRY400
            else:
                log.info("reloaded (%s): serving %s", why, ", ".join(supervisor.resources))


async def _on_file_change(
    path: Path,
    trigger: Callable[[str], None],
    *,
    task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Call ``trigger`` whenever the content of ``path`` changes.

    The directory is watched for entries coming and going (a ConfigMap update swaps symlinks,
    editors rename a new file over the old one) and the file itself for writes in place; either
    one makes the content be compared, read in a worker thread. Reports started once both
    watches are armed, after comparing once more (a change while they were being armed counts).
    """
    digest = await anyio.to_thread.run_sync(_digest, path)
    poked = anyio.Event()

    def poke() -> None:
        poked.set()

    async def directory_changes(*, task_status: TaskStatus[None]) -> None:
        # Started before the first step of the iteration, which arms the watch before this
        # task yields: the parent resumes with the directory watched.
        task_status.started()
        async for _ in fswatch.watch([path.parent], poll_interval=5.0):
            poke()

    async with anyio.create_task_group() as tg:
        await tg.start(directory_changes)
        await tg.start(_file_writes, path, poke)
        poke()  # what changed between the first read and the watches
        task_status.started()
        while True:
            await poked.wait()
            poked = anyio.Event()
            new = await anyio.to_thread.run_sync(_digest, path)
            if new != digest:
                digest = new
                trigger(f"{path} changed")


# What an edit in place does to the file (fswatch watches directories, not writes): written
# and closed, truncated or chmodded, removed or moved (<sys/inotify.h>: IN_CLOSE_WRITE is 0x8).
_FILE_MASK = 0x008 | fswatch.IN_ATTRIB | fswatch.IN_DELETE_SELF | fswatch.IN_MOVE_SELF


async def _file_writes(
    path: Path,
    poke: Callable[[], None],
    rearm_after: float = 5.0,
    *,
    task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Call ``poke`` when the file ``path`` (symlinks followed) is written and closed.

    The watch follows the file that ``path`` names now: it is armed again after every event
    and every ``rearm_after`` seconds, since a replaced file is a new inode. Without inotify
    it returns at once (the directory's polling still sees changes). Reports started before
    the first arming, which happens before this task first yields.
    """
    task_status.started()
    try:
        inotify = fswatch._Inotify()  # the directory watcher's inotify, here on one file
    except OSError:
        return
    try:
        while True:
            with contextlib.suppress(OSError):  # missing for now: the directory tells
                # inotify_add_watch follows symlinks and opens nothing (a FIFO cannot block it).
                inotify.add_watch(path, _FILE_MASK)
            with anyio.move_on_after(rearm_after):
                await anyio.wait_readable(inotify.fd)
                if inotify.read():
                    poke()
    finally:
        inotify.close()


def _digest(path: Path) -> bytes:
    """What ``path`` holds now, for change detection; blocking (run it in a worker thread).

    Read with the configuration reader's rules (a regular file up to its size cap, never a
    FIFO or a device); otherwise the reason stands for the content, so that a change into an
    unreadable state still triggers the reload that reports it.
    """
    try:
        import hashlib  # noqa: PLC0415 - only with a watched config file (cold start)

        return hashlib.sha256(config.read_file(path)).digest()
    except ConfigError as exc:
        return exc.reason.encode()
