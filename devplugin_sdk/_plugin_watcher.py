"""Registration through the kubelet's plugin watcher: serve both APIs on one socket and wait.

The kubelet finds the socket in its plugins_registry directory by itself, asks for
``GetInfo``, dials the DevicePlugin service on the same socket and reports the outcome through
``NotifyRegistrationStatus``. It re-discovers the socket after its own restarts, so only a removed
socket or a failed registration makes us serve again, on a fresh socket (the kubelet does not
retry a socket it has recorded).
"""

from __future__ import annotations

import logging

import anyio
import grpc

from devplugin_sdk import _watcher_registration
from devplugin_sdk._kubelet_watch import DirectoryWatcher, file_id
from devplugin_sdk._link import Link
from devplugin_sdk._server import SocketVanishedError, start_server
from devplugin_sdk._servicer import DevicePluginServicer
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
    resource = servicer.resource
    socket_path = settings.plugins_registry_dir / servicer.plugin.effective_socket_name
    failed = False  # the kubelet reported a failed registration

    def on_status(registered: bool, error: str) -> None:
        nonlocal failed
        if registered:
            link.up(0.0, "through the plugin watcher")
            return
        log.error(
            "%s: the kubelet's plugin watcher failed to register us: %s; recreating the socket",
            resource,
            error,
            extra={"resource": resource},
        )
        link.registered = False
        failed = True
        watcher.notify()

    handlers = [servicer.handler(), _watcher_registration.handler(resource, on_status)]
    server: grpc.aio.Server | None = None
    try:
        while True:
            failed = False
            socket_path.parent.mkdir(parents=True, exist_ok=True)
            try:
                server, own_id = await start_server(socket_path, handlers)
            except SocketVanishedError:
                await anyio.sleep(settings.register_backoff_initial)
                continue
            log.info(
                "%s: serving for the plugin watcher on %s",
                resource,
                socket_path,
                extra={"resource": resource},
            )
            while not failed and file_id(socket_path) == own_id:
                await watcher.wait(watcher.generation)
            link.lost("registration failed" if failed else "our socket was removed")
            stopping, server = server, None
            await servicer.stop(stopping, settings.stop_grace)
    finally:
        link.down()
        if server is not None:
            with anyio.CancelScope(shield=True):
                await servicer.stop(server, settings.stop_grace)
