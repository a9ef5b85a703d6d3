"""Registration through the kubelet's plugin watcher: serve both APIs on one socket and wait.

The kubelet finds the socket in its plugins_registry directory by itself, asks for
``GetInfo``, dials the DevicePlugin service on the same socket and reports the outcome through
``NotifyRegistrationStatus``. It re-discovers the socket after its own restarts, so only a removed
socket or a failed registration makes us serve again, on a fresh socket (the kubelet does not
retry a socket it has recorded). The kubelet's own ListAndWatch stream staying away for
``stream_lost_grace`` after a registration is a loss too: a kubelet that dropped the stream
never reopens it by itself, and a fresh socket makes it register again (a kubelet still
restarting finds the fresh socket when it is back).
"""

from __future__ import annotations

import logging
import math

import anyio
import grpc

from devplugin_sdk._engine.kubelet_watch import DirectoryWatcher
from devplugin_sdk._engine.link import Link
from devplugin_sdk._engine.servicer import DevicePluginServicer
from devplugin_sdk._logging import printable
from devplugin_sdk._wire import watcher_registration
from devplugin_sdk._wire.server import FileId, SocketVanishedError, file_id, start_server
from devplugin_sdk.settings import Settings

log = logging.getLogger("devplugin_sdk")

__all__ = ["keep_registered"]


async def keep_registered(
    servicer: DevicePluginServicer, link: Link, settings: Settings, watcher: DirectoryWatcher
) -> None:
    """Keep ``servicer``'s plugin served in the plugin-watcher directory until cancelled.

    Raises:
        SocketInUseError: another live server answers on the plugin's socket.
    """
    await _WatcherRegistration(servicer, link, settings, watcher).run()


class _WatcherRegistration:
    def __init__(
        self,
        servicer: DevicePluginServicer,
        link: Link,
        settings: Settings,
        watcher: DirectoryWatcher,
    ) -> None:
        self.servicer = servicer
        self.streams = servicer.streams
        self.link = link
        self.settings = settings
        self.watcher = watcher
        self.resource = servicer.resource
        self.socket_path = settings.plugins_registry_dir / servicer.plugin.effective_socket_name
        self.failed = False  # the kubelet reported a failed registration
        self.registration = watcher_registration.handler(
            self.resource, self._on_status, self._on_info
        )

    async def run(self) -> None:
        server: grpc.aio.Server | None = None
        serving = self.servicer.serving()
        try:
            while True:
                self.failed = False
                self.socket_path.parent.mkdir(parents=True, exist_ok=True)
                serving = self.servicer.serving()
                try:
                    server, own_id = await start_server(
                        self.socket_path, [serving.handler, self.registration]
                    )
                except SocketVanishedError:
                    await anyio.sleep(self.settings.register_backoff_initial)
                    continue
                log.info(
                    "%s: serving for the plugin watcher on %s",
                    self.resource,
                    self.socket_path,
                    extra={"resource": self.resource},
                )
                self.link.lost(await self._wait_for_loss(own_id))
                stopping, server = server, None
                self.streams.expect_nothing()
                await self.servicer.stop(stopping, serving, self.settings.stop_grace)
        finally:
            self.link.down()
            if server is not None:
                with anyio.CancelScope(shield=True):
                    await self.servicer.stop(server, serving, self.settings.stop_grace)

    def _on_info(self) -> None:
        # The plugin watcher's GetInfo starts a registration: the kubelet then dials the
        # DevicePlugin service on this socket, asks for the options and opens its stream.
        self.streams.expect_kubelet()

    def _on_status(self, registered: bool, error: str) -> None:
        if registered:
            self.streams.registered()
            self.link.up(0.0, "through the plugin watcher")
            self.watcher.notify()
            return
        log.error(
            "%s: the kubelet's plugin watcher failed to register us: %s; recreating the socket",
            self.resource,
            printable(error),
            extra={"resource": self.resource},
        )
        self.streams.expect_nothing()
        self.link.registered = False
        self.failed = True
        self.watcher.notify()

    async def _wait_for_loss(self, own_id: FileId) -> str:
        """Wait until the registration is lost; return why."""
        grace = self.settings.stream_lost_grace
        while True:
            generation = self.watcher.generation
            if self.failed:
                return "registration failed"
            if file_id(self.socket_path) != own_id:
                return "our socket was removed"
            timeout = math.inf
            streams = self.streams
            lost_for = streams.missing_for()
            if self.link.registered and lost_for is not None:
                if lost_for >= grace:
                    return (
                        f"no ListAndWatch stream from the kubelet for {lost_for:.1f}s "
                        f"({len(streams)} from other clients)"
                    )
                timeout = grace - lost_for
            with anyio.move_on_after(timeout):
                await self.watcher.wait(generation)
