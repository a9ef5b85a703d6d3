"""A DRA driver's kubelet plugin built from the runner's plugins: sockets, registration, wiring.

The runner starts one ``DraDriver`` and hands each served plugin to it as its registration
strategy (``attach``; ``alongside`` runs the device-plugin registration too, for ``api: both``).
The driver reads every attached plugin's device state (the engine's one owner of devices and
health), publishes the healthy devices it is given through ``Publisher``, serves the kubelet's
``DRAPlugin`` service (both versions) on ``dra.sock`` through ``Preparer``, and registers
through the kubelet's plugin watcher, as Kubernetes' kubeletplugin helper does: the DRA socket
first, then ``<driver>-reg.sock`` in ``plugins_registry`` answering GetInfo with type
``DRAPlugin``, the driver name, the DRA socket's path and the services it serves. The kubelet
finds that socket again after its own restarts; a removed socket or a failed registration makes
the driver serve both sockets anew.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import anyio
import anyio.abc
import grpc
from anyio.abc import TaskStatus

from devplugin_sdk._engine.kubelet_watch import DirectoryWatcher
from devplugin_sdk._logging import printable
from devplugin_sdk._wire import watcher_registration
from devplugin_sdk._wire.dra_service import handlers as dra_handlers
from devplugin_sdk._wire.server import FileId, SocketVanishedError, file_id, start_server
from devplugin_sdk.api import constants
from devplugin_sdk.dra import Dra, device_name, kube_api
from devplugin_sdk.dra._checkpoint import Checkpoint
from devplugin_sdk.dra._prepare import Found, Preparer
from devplugin_sdk.dra._publisher import Publisher
from devplugin_sdk.dra.resources import ResourceApi, SliceDevice
from devplugin_sdk.settings import Settings
from devplugin_sdk.types import Health

if TYPE_CHECKING:
    from devplugin_sdk._engine.link import Link
    from devplugin_sdk._engine.servicer import DevicePluginServicer
    from devplugin_sdk._engine.state import DeviceState
    from devplugin_sdk.plugin import DevicePlugin

__all__ = ["SERVICES", "DraDriver"]

log = logging.getLogger("devplugin_sdk")

#: The services the driver serves, in the order the kubelet should prefer them: it takes the
#: first one of the plugin's list that it speaks (pkg/kubelet/cm/dra/plugin, v1 from 1.34).
SERVICES = (constants.DRA_SERVICE_V1, constants.DRA_SERVICE_V1BETA1)

Strategy = Callable[["DevicePluginServicer", "Link", Settings, DirectoryWatcher], Awaitable[None]]

#: How long the devices of a plugin that stopped stay published: a configuration reload stops a
#: changed plugin before its replacement has discovered its devices, which must not withdraw
#: (and then publish again) every device the two have in common.
DETACH_GRACE = 10.0


@dataclass(eq=False)
class _Source:
    resource: str
    plugin: DevicePlugin
    state: DeviceState
    link: Link


class DraDriver:
    """The DRA kubelet plugin of one runner.

    Args:
        options: The driver's options.
        settings: The runner's settings (``plugins_registry_dir``, timings).
        both: The device-plugin API serves the plugins too (``api: both``).
        expected: Resources of the initial plugins: nothing is published or registered before
            each has discovered its devices, so a restarted driver never withdraws devices it
            still has.

    Raises:
        ValueError: the node name is unknown or invalid.
    """

    def __init__(
        self, options: Dra, settings: Settings, *, both: bool, expected: Collection[str]
    ) -> None:
        self.options = options
        self.settings = settings
        self.both = both
        self.driver = options.driver
        self.node_name = options.resolved_node_name()
        self.plugin_dir = options.resolved_plugin_dir
        self.dra_socket = self.plugin_dir / "dra.sock"
        # kubeletplugin's default registration socket name (<driver>-reg.sock).
        self.registration_socket = settings.plugins_registry_dir / f"{self.driver}-reg.sock"
        self.sources: dict[str, _Source] = {}
        self.expected = set(expected)
        self.registered = False
        self.registrations = 0
        self.publisher: Publisher | None = None
        self.preparer: Preparer | None = None
        self._found: dict[str, Found] = {}
        self._ready = anyio.Event()
        self._failed = False
        self._watcher = DirectoryWatcher(
            [settings.plugins_registry_dir, self.plugin_dir], settings.restart_poll_interval
        )
        self._duplicates: set[str] = set()
        self._tg: anyio.abc.TaskGroup | None = None

    # ------------------------------------------------------------------ running

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Connect, load the checkpoint, publish and register until cancelled.

        ``task_status.started()`` once the checkpoint is loaded.

        Raises:
            MissingDependencyError: no Kubernetes client is installed (the ``dra`` extra).
            SocketInUseError: another live instance serves the driver's sockets.
        """
        api: ResourceApi = self.options.api or kube_api(self.options.kubeconfig)
        try:
            self.plugin_dir.mkdir(parents=True, exist_ok=True)
            self.settings.plugins_registry_dir.mkdir(parents=True, exist_ok=True)
            self.publisher = Publisher(api, self.driver, self.node_name)
            self.preparer = Preparer(
                self.driver,
                self.node_name,
                api,
                lookup=self._find,
                checkpoint=Checkpoint(self.plugin_dir / "checkpoint.json"),
                cdi_dir=self.options.cdi_dir,
                hook_timeout=self.settings.hook_timeout,
            )
            await self.preparer.load()
            async with anyio.create_task_group() as tg:
                self._tg = tg
                tg.start_soon(self._watcher.run)
                tg.start_soon(self.publisher.run)
                task_status.started()
                self._refresh()
                await self._ready.wait()
                await self._serve()
        finally:
            self._set_registered(False)
            if self.options.api is None:
                with anyio.CancelScope(shield=True):
                    await api.aclose()

    async def _serve(self) -> None:
        assert self.preparer is not None
        dra = dra_handlers(self.preparer.prepare, self.preparer.unprepare, SERVICES)
        registration = watcher_registration.handler(
            self.driver,
            self._on_status,
            self._on_info,
            plugin_type=constants.PLUGIN_TYPE_DRA_PLUGIN,
            endpoint=str(self.dra_socket),
            versions=SERVICES,
        )
        servers: list[grpc.aio.Server] = []
        try:
            while True:
                self._failed = False
                try:
                    # The DRA socket first: the kubelet dials it as soon as it has the endpoint.
                    server, dra_id = await start_server(self.dra_socket, dra, close_idle=False)
                    servers.append(server)
                    server, reg_id = await start_server(self.registration_socket, [registration])
                    servers.append(server)
                except SocketVanishedError:
                    await self._stop(servers)
                    await anyio.sleep(self.settings.register_backoff_initial)
                    continue
                log.info(
                    "DRA %s: serving %s, registration socket %s (node %s)",
                    self.driver,
                    self.dra_socket,
                    self.registration_socket,
                    self.node_name,
                )
                reason = await self._wait_for_loss(dra_id, reg_id)
                self._set_registered(False)
                log.info("DRA %s: %s; serving and registering again", self.driver, reason)
                await self._stop(servers)
                await anyio.sleep(self.settings.register_backoff_initial)
        finally:
            with anyio.CancelScope(shield=True):
                await self._stop(servers)

    async def _stop(self, servers: list[grpc.aio.Server]) -> None:
        while servers:
            await servers.pop().stop(self.settings.stop_grace)

    async def _wait_for_loss(self, dra_id: FileId, reg_id: FileId) -> str:
        while True:
            generation = self._watcher.generation
            if self._failed:
                return "the kubelet reported a failed registration"
            if file_id(self.registration_socket) != reg_id:
                return f"{self.registration_socket} was removed"
            if file_id(self.dra_socket) != dra_id:
                return f"{self.dra_socket} was removed"
            await self._watcher.wait(generation)

    def _on_info(self) -> None:
        log.debug("DRA %s: the kubelet's plugin watcher asked for our info", self.driver)

    def _on_status(self, registered: bool, error: str) -> None:
        if registered:
            self.registrations += 1
            log.info("DRA %s: registered with the kubelet (%s)", self.driver, ", ".join(SERVICES))
            self._set_registered(True)
            return
        log.error(
            "DRA %s: the kubelet's plugin watcher failed to register us: %s; recreating the socket",
            self.driver,
            printable(error),
        )
        self._set_registered(False)
        self._failed = True
        self._watcher.notify()

    def _set_registered(self, registered: bool) -> None:
        self.registered = registered
        if self.both:
            return  # the device-plugin registration owns the links
        for source in self.sources.values():
            if registered:
                source.link.up(0.0, f"as DRA driver {self.driver}")
            else:
                source.link.registered = False

    # ------------------------------------------------------------------ plugins

    async def attach(
        self,
        servicer: DevicePluginServicer,
        link: Link,
        settings: Settings,
        watcher: DirectoryWatcher,
    ) -> None:
        """Serve one plugin through this driver until cancelled (a registration strategy)."""
        resource = servicer.resource
        source = _Source(resource, servicer.plugin, servicer.state, link)
        self.sources[resource] = source
        if not self.both:
            link.stream_expected = False
            if self.registered:
                link.up(0.0, f"as DRA driver {self.driver}")
        unsubscribe = servicer.state.subscribe(self._refresh)
        self._refresh()
        try:
            await anyio.sleep_forever()
        finally:
            unsubscribe()
            if not self.both:
                link.down()
            if self.sources.get(resource) is source:
                self._detach(resource, source)

    def _detach(self, resource: str, source: _Source) -> None:
        """Keep a stopped plugin's devices published for ``DETACH_GRACE``, unless a new plugin
        of the resource attaches first."""

        async def later() -> None:
            await anyio.sleep(DETACH_GRACE)
            if self.sources.get(resource) is source:
                del self.sources[resource]
                self._refresh()

        if self._tg is None:
            del self.sources[resource]
            self._refresh()
        else:
            self._tg.start_soon(later)

    def alongside(self, strategy: Strategy) -> Strategy:
        """The strategy of ``api: both``: the device-plugin ``strategy`` lists only the devices
        DRA does not get, and the driver serves the others."""

        async def both(
            servicer: DevicePluginServicer,
            link: Link,
            settings: Settings,
            watcher: DirectoryWatcher,
        ) -> None:
            resource = servicer.resource
            servicer.state.list_only(lambda device: not self.options.selects(resource, device))
            async with anyio.create_task_group() as tg:
                tg.start_soon(self.attach, servicer, link, settings, watcher)
                await strategy(servicer, link, settings, watcher)
                tg.cancel_scope.cancel()

        return both

    def _find(self, name: str) -> Found | None:
        return self._found.get(name)

    def _refresh(self) -> None:
        """Recompute the pool from the attached plugins' states and hand it to the publisher."""
        found: dict[str, Found] = {}
        offered: list[SliceDevice] = []
        for source in self.sources.values():
            for device in source.state.devices:
                if not self.options.selects(source.resource, device):
                    continue
                name = device_name(device.id)
                if name in found:
                    if name not in self._duplicates:
                        self._duplicates.add(name)
                        log.error(
                            "DRA %s: device %s of %s has the same DRA name %s as device %s of "
                            "%s; only the first is published",
                            self.driver,
                            device.id,
                            source.resource,
                            name,
                            found[name].device.id,
                            found[name].resource,
                        )
                    continue
                health = source.state.health_of(device.id)
                found[name] = Found(source.resource, source.plugin, device, health)
                if health is Health.HEALTHY:  # an unhealthy device is withdrawn from the pool
                    offered.append(SliceDevice(name, device.attributes, device.capacity))
        self._found = found
        if not self._ready.is_set() and self.expected <= set(self.sources):
            self._ready.set()
        if self._ready.is_set() and self.publisher is not None:
            self.publisher.want(offered)

    @property
    def checkpoint_path(self) -> Path:
        """Where the prepared claims are kept."""
        return self.plugin_dir / "checkpoint.json"
