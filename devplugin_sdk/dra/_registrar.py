"""A DRA driver's registration with the kubelet's plugin watcher, through the engine's loop.

As Kubernetes' kubeletplugin helper does: the DRA socket first, then ``<driver>-reg.sock`` in
plugins_registry answering GetInfo with type ``DRAPlugin``, the driver name, the DRA socket's
path and the services it serves. The kubelet finds that socket again after its own restarts; a
removed socket or a failed registration makes the registrar serve both sockets anew
(``plugin_watcher.serve_until_lost``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc

from devplugin_sdk._engine.kubelet_watch import DirectoryWatcher
from devplugin_sdk._engine.plugin_watcher import Socket, serve_until_lost
from devplugin_sdk._wire import watcher_registration
from devplugin_sdk._wire.server import start_server
from devplugin_sdk.api import constants
from devplugin_sdk.settings import Settings

log = logging.getLogger("devplugin_sdk")

__all__ = ["HEALTH_SERVICES", "SERVICES", "Registrar"]

#: The DRAPlugin services the driver serves, in the order the kubelet should prefer them: it
#: takes the first one of the plugin's list that it speaks (pkg/kubelet/cm/dra/plugin, v1 from
#: 1.34).
SERVICES = (constants.DRA_SERVICE_V1, constants.DRA_SERVICE_V1BETA1)
#: The health streams it serves beside them (a kubelet that speaks both takes v1).
HEALTH_SERVICES = (constants.DRA_HEALTH_SERVICE_V1, constants.DRA_HEALTH_SERVICE_V1ALPHA1)


class Registrar:
    """Serves one DRA driver's ``dra.sock`` and registers it (a ``plugin_watcher.Site``).

    Args:
        driver: The driver name.
        node_name: The node, for the log.
        dra_socket: Where the DRAPlugin services are served.
        settings: The runner's settings (``plugins_registry_dir``, timings).
        on_change: Called with whether the driver is registered, whenever that changes.

    Attributes:
        registered: The kubelet's plugin watcher reported the driver registered.
        registrations: How many times it did.
    """

    def __init__(
        self,
        driver: str,
        node_name: str,
        dra_socket: Path,
        settings: Settings,
        on_change: Callable[[bool], None],
    ) -> None:
        self.driver = driver
        self.name = f"DRA {driver}"
        self.node_name = node_name
        self.dra_socket = dra_socket
        # kubeletplugin's registration socket name: <driver>-reg.sock, or with rolling updates
        # RollingUpdateRegistrarSocketFile's (the pod UID in it, hashed where too long).
        self.registration_socket = settings.instance_socket(
            settings.plugins_registry_dir, f"{driver}-reg.sock", prefix="dra", key=driver
        )
        self.settings = settings
        self.registered = False
        self.registrations = 0
        #: It is stopping for good (its sockets go next, or have gone).
        self.closing = False
        self._on_change = on_change
        self._services: list[grpc.GenericRpcHandler] = []

    async def run(self, services: list[grpc.GenericRpcHandler], watcher: DirectoryWatcher) -> None:
        """Serve ``services`` (the DRAPlugin handlers) on ``dra.sock`` and keep them registered
        until cancelled; ``watcher`` must watch plugins_registry and the DRA socket's directory.

        Raises:
            SocketInUseError: another live instance serves the driver's sockets.
        """
        self._services = services
        try:
            pause = self.settings.register_backoff_initial
            await serve_until_lost(self, self.settings, watcher, pause=pause, closing=self._close)
        finally:
            self._set(False)

    def _close(self) -> None:
        self.closing = True

    # ------------------------------------------------------------------ plugin_watcher.Site

    def registration(self, on_status: Callable[[bool, str], None]) -> grpc.GenericRpcHandler:
        return watcher_registration.handler(
            self.driver,
            on_status,
            self._on_info,
            plugin_type=constants.PLUGIN_TYPE_DRA_PLUGIN,
            endpoint=str(self.dra_socket),
            versions=(*SERVICES, *HEALTH_SERVICES),
        )

    def _on_info(self) -> None:
        log.debug("%s: the kubelet's plugin watcher asked for our info", self.name)

    async def start(self, registration: grpc.GenericRpcHandler, sockets: list[Socket]) -> None:
        # The DRA socket first: the kubelet dials it as soon as it has the endpoint. Its idle
        # connections stay open: the kubelet holds one between calls to see that we are alive.
        for path, handlers, close_idle in (
            (self.dra_socket, self._services, False),
            (self.registration_socket, [registration], True),
        ):
            server, identity = await start_server(path, handlers, close_idle=close_idle)
            sockets.append(Socket(path, identity, self._stopper(server)))
        log.info(
            "%s: serving %s, registration socket %s (node %s)",
            self.name,
            self.dra_socket,
            self.registration_socket,
            self.node_name,
        )

    def _stopper(self, server: grpc.aio.Server) -> Callable[[], Awaitable[None]]:
        async def stop() -> None:
            await server.stop(self.settings.stop_grace)

        return stop

    def accepted(self) -> None:
        self.registrations += 1
        log.info(
            "%s: registered with the kubelet (%s)",
            self.name,
            ", ".join((*SERVICES, *HEALTH_SERVICES)),
        )
        self._set(True)

    def check(self) -> tuple[str | None, float]:
        return None, math.inf  # only the sockets and the kubelet's report tell

    def lost(self, reason: str) -> None:
        self._set(False)
        log.info("%s: %s; serving and registering again", self.name, reason)

    def refused(self) -> None:
        self._set(False)

    def _set(self, registered: bool) -> None:
        self.registered = registered
        self._on_change(registered)
