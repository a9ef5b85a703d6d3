"""A DRA driver's kubelet plugin built from the runner's plugins: its roles, wired up.

The runner starts one ``DraDriver`` and runs each served plugin with its ``strategy``. The
driver only assembles its roles, each knowing what it is handed: ``Plugins`` (each plugin's
strategy, and the pool their devices make), ``Publisher`` (the pool in ResourceSlices),
``Preparer`` (the kubelet's ``DRAPlugin`` service, both versions, on ``dra.sock``),
``HealthBoard`` (the kubelet's ``DRAResourceHealth`` stream, both versions, on ``dra.sock``) and
``Registrar`` (``dra.sock``'s registration with the kubelet's plugin watcher).
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

import anyio
from anyio.abc import TaskStatus

from devplugin_sdk._engine.events import Events
from devplugin_sdk._engine.handle import PluginHandle, Strategy
from devplugin_sdk._engine.kubelet_watch import DirectoryWatcher
from devplugin_sdk._wire import dra_health
from devplugin_sdk._wire.dra_service import handlers as dra_handlers
from devplugin_sdk.dra import Dra, _rules, kube_api
from devplugin_sdk.dra._claims.checkpoint import Checkpoint, private_directory
from devplugin_sdk.dra._claims.cleanup import Cleanup, report_corrupt_checkpoint
from devplugin_sdk.dra._claims.lock import LOCK_NAME, SharedState
from devplugin_sdk.dra._claims.metadata import Metadata
from devplugin_sdk.dra._claims.preparer import Preparer
from devplugin_sdk.dra._claims.status import StatusWriter
from devplugin_sdk.dra._pool.health import HealthBoard
from devplugin_sdk.dra._pool.plugins import Plugins
from devplugin_sdk.dra._pool.publisher import Publisher
from devplugin_sdk.dra._registrar import HEALTH_SERVICES, SERVICES, Registrar
from devplugin_sdk.dra.resources import ResourceApi
from devplugin_sdk.observe import DraStatus
from devplugin_sdk.settings import Settings

__all__ = ["DraDriver"]


class DraDriver:
    """The DRA kubelet plugin of one runner.

    Args:
        options: The driver's options.
        settings: The runner's settings (``plugins_registry_dir``, timings).
        watcher: The runner's directory watcher, not started yet: the driver adds its
            directories.
        both: The device-plugin API serves the plugins too (``api: both``).
        expected: Resources of the initial plugins: nothing is published or registered before
            each has discovered its devices (or ``FIRST_LIST_WAIT`` has passed), so a restarted
            driver never withdraws devices it still has.

    Attributes:
        events: Where the driver's events go (the runner's observer).

    Raises:
        ValueError: the node name is unknown or invalid, or the kubelet would refuse the
            driver's registration (``_rules``: the DRA socket outside the kubelet's root
            directory or too long for a unix socket).
    """

    def __init__(
        self,
        options: Dra,
        settings: Settings,
        watcher: DirectoryWatcher,
        *,
        both: bool,
        expected: Collection[str],
    ) -> None:
        self.options = options
        self.settings = settings
        self.watcher = watcher
        self.plugin_dir = options.resolved_plugin_dir
        root = options.kubelet_root_dir or _rules.kubelet_root(settings.plugins_registry_dir)
        problem = _rules.driver_problem(options.driver) or _rules.endpoint_problem(
            self.plugin_dir / "dra.sock", root
        )
        if problem is not None:
            raise ValueError(problem)
        self.events = Events(None)
        node_name = options.resolved_node_name()
        self.health = HealthBoard(node_name, options.health_timeout)
        self.plugins = Plugins(options, self.health, both=both, expected=expected)
        self.registrar = Registrar(
            options.driver,
            node_name,
            # dra-<pod UID>.sock with rolling upgrades, as the kubeletplugin helper names it.
            settings.instance_socket(self.plugin_dir, "dra.sock"),
            settings,
            self.plugins.registered,
        )
        watcher.add(settings.plugins_registry_dir, self.plugin_dir)
        self.publisher: Publisher | None = None
        self.preparer: Preparer | None = None
        self.cleanup: Cleanup | None = None
        self.status_writer: StatusWriter | None = None
        self.corrupt_checkpoints = 0
        self._sockets_down = anyio.Event()  # the registrar has stopped serving, for good

    def strategy(self, device_plugin: Strategy) -> Strategy:
        """Each plugin's registration strategy: the driver's own, or with ``both``, the driver's
        beside ``device_plugin``'s; on shutdown a plugin leaves the pool only once the driver's
        sockets are down."""
        plugins = self.plugins
        inner = plugins.alongside(device_plugin) if plugins.both else plugins.attach

        async def served(
            plugin: PluginHandle, settings: Settings, watcher: DirectoryWatcher
        ) -> None:
            # Shielded from the process's shutdown: ended here, once the sockets are down.
            scope = anyio.CancelScope(shield=True)

            async def attached() -> None:
                with scope:
                    await inner(plugin, settings, watcher)
                tg.cancel_scope.cancel()

            async with anyio.create_task_group() as tg:
                tg.start_soon(attached)
                try:
                    await anyio.sleep_forever()
                finally:
                    # SIGTERM stops everything at once. The kubelet may call this instance
                    # until its DRA socket is down (it picks among a rolling upgrade's instances
                    # by their connections), and calls in flight finish in the servers' grace:
                    # until then, the plugin's devices stay found. A plugin stopped alone (a
                    # configuration reload) leaves at once.
                    with (
                        anyio.CancelScope(shield=True),
                        anyio.move_on_after(2 * settings.stop_grace + 1.0),
                    ):
                        for _ in range(3):  # the driver's own cancellation runs first
                            await anyio.lowlevel.checkpoint()
                        if self.registrar.closing:
                            await self._sockets_down.wait()
                    scope.cancel()

        return served

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Connect, load the checkpoint, publish and register until cancelled.

        ``task_status.started()`` once the checkpoint is loaded.

        Raises:
            MissingDependencyError: no Kubernetes client is installed (the ``dra`` extra).
            SocketInUseError: another live instance serves the driver's sockets.
        """
        api: ResourceApi = self.options.api or kube_api(self.options.kubeconfig)
        try:
            private_directory(self.plugin_dir)  # 0700: no one else renames a checkpoint in
            self.settings.plugins_registry_dir.mkdir(parents=True, exist_ok=True)
            self.publisher = Publisher(api, self.options.driver, self.registrar.node_name)
            self.status_writer = StatusWriter(self.options.driver, api)
            checkpoint = Checkpoint(self.plugin_dir / "checkpoint.json")
            shared = SharedState(checkpoint, self._lock_path())
            self.preparer = Preparer(
                self.options.driver,
                self.registrar.node_name,
                api,
                lookup=self.plugins.find,
                checkpoint=checkpoint,
                cdi_dir=self.options.cdi_dir,
                hook_timeout=self.settings.hook_timeout,
                metadata=Metadata(self.options.driver, self.plugin_dir),
                status=self.status_writer,
                shared=shared,
            )
            # Under the lock: the cleanup of unfinished prepares must not take the spec of a
            # prepare that the previous instance has in flight.
            async with shared.held(self.preparer.prepared):
                await self.preparer.load()
            async with anyio.create_task_group() as tg:
                self._after_load(api, tg)
                tg.start_soon(self.publisher.run)
                tg.start_soon(self.plugins.run)
                task_status.started()
                self.plugins.publish_to(self.publisher.want)
                await self.plugins.ready.wait()
                services = [
                    *dra_handlers(self.preparer.prepare, self.preparer.unprepare, SERVICES),
                    *dra_health.handlers(self.health.watch, HEALTH_SERVICES),
                ]
                try:
                    await self.registrar.run(services, self.watcher)
                finally:
                    self._sockets_down.set()
        finally:
            self._sockets_down.set()
            if self.options.api is None:
                with anyio.CancelScope(shield=True):
                    await api.aclose()

    def _after_load(self, api: ResourceApi, tg: anyio.abc.TaskGroup) -> None:
        """Report a checkpoint that was set aside; start the stale-claim cleanup."""
        assert self.preparer is not None
        driver, node = self.options.driver, self.registrar.node_name
        loaded = self.preparer.loaded
        if loaded.problem is not None:
            self.corrupt_checkpoints += 1
            self.events.dra_checkpoint_corrupted(driver)
            where = f"; moved to {loaded.aside}" if loaded.aside else ""
            message = (
                f"DRA driver {driver}: the checkpoint {self.preparer.checkpoint.path} cannot be "
                f"used: {loaded.problem}{where}; started from the CDI specs on disk"
            )
            tg.start_soon(report_corrupt_checkpoint, api, driver, node, message)
        self.cleanup = Cleanup(
            driver, api, self.preparer, self.options.cleanup_interval, self.events.dra_stale_claim
        )
        if self.options.cleanup_interval > 0:
            tg.start_soon(self.cleanup.run)

    def _lock_path(self) -> Path | None:
        """``serialize.lock`` beside the checkpoint when instances may overlap (a pod UID)."""
        return self.plugin_dir / LOCK_NAME if self.settings.instance_uid else None

    def status(self) -> DraStatus:
        """What the driver is doing (``Running.dra``)."""
        publisher, preparer = self.publisher, self.preparer
        return DraStatus(
            driver=self.options.driver,
            node_name=self.registrar.node_name,
            registered=self.registrar.registered,
            registrations=self.registrar.registrations,
            generation=publisher.generation if publisher is not None else 0,
            published=len(publisher.published or ()) if publisher is not None else 0,
            pending_seconds=publisher.pending_seconds if publisher is not None else 0.0,
            prepared_claims=len(preparer.prepared) if preparer is not None else 0,
            last_error=publisher.last_error if publisher is not None else None,
            recovered_claims=preparer.recovered() if preparer is not None else 0,
            taints_dropped=publisher.taints_dropped if publisher is not None else False,
            health_streams=self.health.streams,
            stale_claims_unprepared=self.cleanup.unprepared if self.cleanup is not None else 0,
            checkpoint_corrupted=self.corrupt_checkpoints,
            status_write_failures=(
                self.status_writer.failed if self.status_writer is not None else 0
            ),
        )
