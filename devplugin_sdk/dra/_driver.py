"""A DRA driver's kubelet plugin built from the runner's plugins: its parts, built and wired up.

The runner makes one ``DraDriver`` and runs each served plugin with its ``strategy``. The driver
builds both rooms when it is made and runs them in ``run``: the published pool (``Plugins``, each
plugin's strategy and the pool their devices make; ``Publisher``, the pool in ResourceSlices;
``HealthBoard``, the kubelet's ``DRAResourceHealth`` stream) and the claims side
(``ClaimService``, the kubelet's ``DRAPlugin`` service, with its store, preparer and files; the
stale-claim ``Cleanup``; the ``StatusWriter``), both served on ``dra.sock`` by the ``Registrar``
(its registration with the kubelet's plugin watcher).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Collection, Sequence
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
from devplugin_sdk.dra._claims.files import ClaimFiles
from devplugin_sdk.dra._claims.metadata import Metadata
from devplugin_sdk.dra._claims.preparer import Preparer
from devplugin_sdk.dra._claims.service import ClaimService
from devplugin_sdk.dra._claims.status import StatusWriter
from devplugin_sdk.dra._claims.store import LOCK_NAME, Store
from devplugin_sdk.dra._pool.health import HealthBoard
from devplugin_sdk.dra._pool.plugins import Plugins
from devplugin_sdk.dra._pool.publisher import Publisher
from devplugin_sdk.dra._registrar import HEALTH_SERVICES, SERVICES, Registrar
from devplugin_sdk.dra.resources import (
    ClaimDeviceStatus,
    NodeEvent,
    ResourceApi,
    ResourceClaim,
    ResourceSlice,
    SliceEvent,
)
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
        driver, node_name = options.driver, options.resolved_node_name()
        self.health = HealthBoard(node_name, options.health_timeout)
        self.plugins = Plugins(options, self.health, both=both, expected=expected)
        self.registrar = Registrar(
            driver,
            node_name,
            # dra-<pod UID>.sock with rolling upgrades, as the kubeletplugin helper names it.
            settings.instance_socket(self.plugin_dir, "dra.sock"),
            settings,
            self.plugins.registered,
        )
        watcher.add(settings.plugins_registry_dir, self.plugin_dir)
        self.api: ResourceApi = options.api or _KubeApi(options.kubeconfig)
        self.publisher = Publisher(self.api, driver, node_name)
        self.status_writer = StatusWriter(driver, self.api)
        self.store = Store(
            Checkpoint(self.plugin_dir / "checkpoint.json"),
            self._lock_path(),
            lock_timeout=options.lock_timeout,
        )
        self.claims = self._claims_side(node_name)
        self.cleanup = Cleanup(
            driver,
            self.api,
            self.store,
            self.claims.unprepare,
            interval=options.cleanup_interval,
            counted=self._stale_claim,
        )
        self.corrupt_checkpoints = 0
        self._going = _Going()

    def _claims_side(self, node_name: str) -> ClaimService:
        """The kubelet's ``DRAPlugin`` service over ``store``: its preparer and the claims'
        files."""
        driver = self.options.driver
        files = ClaimFiles(driver, self.options.cdi_dir, Metadata(driver, self.plugin_dir))
        preparer = Preparer(
            driver,
            node_name,
            lookup=self.plugins.find,
            store=self.store,
            files=files,
            hook_timeout=self.settings.hook_timeout,
        )
        return ClaimService(
            driver, self.api, self.store, preparer, files, status=self.status_writer
        )

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
                        await self._going.down()
                    scope.cancel()

        return served

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Connect, load the checkpoint, publish and register until cancelled.

        ``task_status.started()`` once the checkpoint is loaded.

        Raises:
            MissingDependencyError: no Kubernetes client is installed (the ``dra`` extra).
            SocketInUseError: another live instance serves the driver's sockets.
        """
        try:
            if isinstance(self.api, _KubeApi):
                self.api.connect()
            private_directory(self.plugin_dir)  # 0700: no one else renames a checkpoint in
            self.settings.plugins_registry_dir.mkdir(parents=True, exist_ok=True)
            await self.claims.start()
            async with anyio.create_task_group() as tg:
                await tg.start(self._going.watch)
                self._after_load(tg)
                tg.start_soon(self.publisher.run)
                tg.start_soon(self.plugins.run)
                task_status.started()
                self.plugins.publish_to(self.publisher.want)
                await self.plugins.ready.wait()
                services = [
                    *dra_handlers(self.claims.prepare, self.claims.unprepare, SERVICES),
                    *dra_health.handlers(self.health.watch, HEALTH_SERVICES, self.health.period),
                ]
                try:
                    await self.registrar.run(services, self.watcher)
                finally:
                    self._going.sockets_down.set()
        finally:
            self._going.sockets_down.set()
            if isinstance(self.api, _KubeApi):
                with anyio.CancelScope(shield=True):
                    await self.api.aclose()

    def _after_load(self, tg: anyio.abc.TaskGroup) -> None:
        """Report a checkpoint that was set aside; start the stale-claim cleanup."""
        driver, node = self.options.driver, self.registrar.node_name
        loaded = self.store.loaded
        if loaded.problem is not None:
            self.corrupt_checkpoints += 1
            self.events.dra_checkpoint_corrupted(driver)
            where = f"; moved to {loaded.aside}" if loaded.aside else ""
            message = (
                f"DRA driver {driver}: the checkpoint {self.store.checkpoint.path} cannot be "
                f"used: {loaded.problem}{where}; started from the CDI specs on disk"
            )
            tg.start_soon(report_corrupt_checkpoint, self.api, driver, node, message)
        if self.options.cleanup_interval > 0:
            tg.start_soon(self.cleanup.run)

    def _stale_claim(self, driver: str, reason: str) -> None:
        self.events.dra_stale_claim(driver, reason)  # the runner sets events after __init__

    def _lock_path(self) -> Path | None:
        """``serialize.lock`` beside the checkpoint when instances may overlap (a pod UID)."""
        return self.plugin_dir / LOCK_NAME if self.settings.instance_uid else None

    def status(self) -> DraStatus:
        """What the driver is doing (``Running.dra``)."""
        publisher = self.publisher
        return DraStatus(
            driver=self.options.driver,
            node_name=self.registrar.node_name,
            registered=self.registrar.registered,
            registrations=self.registrar.registrations,
            generation=publisher.generation,
            published=len(publisher.published or ()),
            pending_seconds=publisher.pending_seconds,
            prepared_claims=len(self.store.entries()),
            last_error=publisher.last_error,
            recovered_claims=self.store.recovered(),
            taints_dropped=publisher.taints_dropped,
            health_streams=self.health.streams,
            stale_claims_unprepared=self.cleanup.unprepared,
            checkpoint_corrupted=self.corrupt_checkpoints,
            status_write_failures=self.status_writer.failed,
        )


class _Going:
    """Whether a plugin that stops goes with the whole driver, and when the driver's sockets are
    down.

    A plugin stopped alone (a configuration reload) leaves the pool at once; one stopped with the
    driver (SIGTERM cancels every task at once, in no set order) waits until the driver's sockets
    are down. The driver's cancellation is told by a task of the driver's own (``watch``): its
    cancellation is pending from the moment the driver's scope is cancelled, whichever task the
    event loop happens to run first.
    """

    def __init__(self) -> None:
        #: The registrar has stopped serving, for good.
        self.sockets_down = anyio.Event()
        self._stopping = anyio.Event()
        self._watcher: anyio.TaskInfo | None = None

    async def watch(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Run in the driver's task group until the driver stops."""
        self._watcher = anyio.get_current_task()
        task_status.started()
        try:
            await anyio.sleep_forever()
        finally:
            self._stopping.set()

    def stopping(self) -> bool:
        """The driver is stopping, or has stopped (or never ran)."""
        return (
            self._watcher is None
            or self._stopping.is_set()
            or self._watcher.has_pending_cancellation()
        )

    async def down(self) -> None:
        """Return at once for a plugin stopped alone; when the driver stops too, once its sockets
        are down."""
        if self.stopping():
            await self.sockets_down.wait()


class _KubeApi:
    """The Kubernetes API of a driver given none (``kube_api``), made by ``connect`` when the
    driver runs: making it reads the kubeconfig or the pod's service account, and needs the
    ``dra`` extra, neither of which belongs in the driver's construction.
    """

    def __init__(self, kubeconfig: Path | None) -> None:
        self._kubeconfig = kubeconfig
        self._api: ResourceApi | None = None

    def connect(self) -> None:
        """Make the client.

        Raises:
            MissingDependencyError: no Kubernetes client is installed (the ``dra`` extra).
            ValueError: the configuration cannot be loaded.
        """
        if self._api is None:
            self._api = kube_api(self._kubeconfig)

    @property
    def _made(self) -> ResourceApi:
        if self._api is None:
            raise RuntimeError("the Kubernetes API is used before the DRA driver runs")
        return self._api

    async def read_claim(self, namespace: str, name: str) -> ResourceClaim:
        return await self._made.read_claim(namespace, name)

    async def list_slices(self, driver: str, node_name: str) -> list[ResourceSlice]:
        return await self._made.list_slices(driver, node_name)

    async def create_slice(self, resource_slice: ResourceSlice) -> ResourceSlice:
        return await self._made.create_slice(resource_slice)

    async def update_slice(self, resource_slice: ResourceSlice) -> ResourceSlice:
        return await self._made.update_slice(resource_slice)

    async def delete_slice(self, name: str) -> None:
        await self._made.delete_slice(name)

    def watch_slices(
        self, driver: str, node_name: str, resource_version: str = ""
    ) -> AsyncIterator[SliceEvent | None]:
        return self._made.watch_slices(driver, node_name, resource_version)

    async def node_uid(self, node_name: str) -> str:
        return await self._made.node_uid(node_name)

    async def apply_claim_status(
        self, claim: ResourceClaim, field_manager: str, devices: Sequence[ClaimDeviceStatus]
    ) -> None:
        await self._made.apply_claim_status(claim, field_manager, devices)

    async def create_event(self, event: NodeEvent) -> None:
        await self._made.create_event(event)

    async def aclose(self) -> None:
        if self._api is not None:
            await self._api.aclose()
