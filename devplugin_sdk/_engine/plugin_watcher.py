"""Registration through the kubelet's plugin watcher: serve, be found, wait for the loss, again.

The kubelet finds a registration socket in its plugins_registry directory by itself, asks for
``GetInfo``, dials the endpoint it names (for a device plugin, the DevicePlugin service on the
same socket) and reports the outcome through ``NotifyRegistrationStatus``. It re-discovers the
socket after its own restarts, so only a removed socket or a failed registration makes us serve
again, on a fresh socket (the kubelet does not retry a socket it has recorded).
``serve_until_lost`` is that loop for any ``Site`` (a device plugin's one socket here, a DRA
driver's two in ``dra._registrar``); ``keep_registered`` is the device plugin's strategy.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import anyio
import grpc

from devplugin_sdk._backoff import Backoff
from devplugin_sdk._engine.handle import PluginHandle
from devplugin_sdk._engine.kubelet_watch import DirectoryWatcher
from devplugin_sdk._logging import printable
from devplugin_sdk._wire import watcher_registration
from devplugin_sdk._wire.server import FileId, SocketVanishedError, file_id, start_server
from devplugin_sdk.settings import Settings

log = logging.getLogger("devplugin_sdk")

__all__ = ["Site", "Socket", "keep_registered", "serve_until_lost"]

OnStatus = Callable[[bool, str], None]


@dataclass(frozen=True, eq=False)
class Socket:
    """One socket a ``Site`` serves: its path, its identity there and how its server stops."""

    path: Path
    identity: FileId
    stop: Callable[[], Awaitable[None]]


class Site(Protocol):
    """What the plugin watcher finds: the sockets served, and what the kubelet's answers mean."""

    #: Who is registering, for the logs ("<resource>", "DRA <driver>").
    name: str

    def registration(self, on_status: OnStatus) -> grpc.GenericRpcHandler:
        """The Registration service (``watcher_registration.handler``) reporting to
        ``on_status``."""
        ...

    async def start(self, registration: grpc.GenericRpcHandler, sockets: list[Socket]) -> None:
        """Serve the sockets, ``registration`` on the one in plugins_registry, appending each
        to ``sockets`` once it serves.

        Raises:
            SocketVanishedError: a socket was deleted as soon as it was bound.
        """
        ...

    def accepted(self) -> None:
        """The kubelet reported the registration done."""
        ...

    def refused(self) -> None:
        """The kubelet reported the registration failed (it is served again, on fresh sockets)."""
        ...

    def check(self) -> tuple[str | None, float]:
        """Why the registration is lost beyond the sockets, if it is; else how many seconds
        until it may be (``math.inf``: only a directory change can tell)."""
        ...

    def lost(self, reason: str) -> None:
        """The registration is lost (its sockets stop next)."""
        ...


async def serve_until_lost(
    site: Site,
    settings: Settings,
    watcher: DirectoryWatcher,
    *,
    pause: float = 0.0,
    closing: Callable[[], None] = lambda: None,
) -> None:
    """Serve ``site`` until its registration is lost, stop it, and again, until cancelled.

    Args:
        site: What is served and registered.
        settings: Lifecycle settings (``register_backoff_initial`` and ``_max``: the backoff
            between sockets deleted as they are bound, and between refused registrations).
        watcher: The process's directory watcher, watching every directory of the site.
        pause: Seconds to wait after a loss before serving again (at least the backoff when
            the kubelet refused the registration).
        closing: Called once it stops for good, before its sockets stop.

    Raises:
        SocketInUseError: another live server answers on one of the site's sockets.
    """
    status = _Status(site, watcher)
    registration = site.registration(status)
    sockets: list[Socket] = []
    vanished = Backoff(settings.register_backoff_initial, settings.register_backoff_max)
    refused = Backoff(settings.register_backoff_initial, settings.register_backoff_max)
    try:
        while True:
            status.failed = False
            try:
                await site.start(registration, sockets)
            except SocketVanishedError:
                await _stop(sockets)
                await vanished.sleep()
                continue
            vanished.reset()
            reason = await _wait_for_loss(site, sockets, watcher, status)
            site.lost(reason)
            await _stop(sockets)
            if status.failed:
                # The kubelet refused it: each fresh socket starts another registration.
                await anyio.sleep(max(pause, refused.next()))
            else:
                refused.reset()
                await anyio.sleep(pause)
    finally:
        closing()
        with anyio.CancelScope(shield=True):
            await _stop(sockets)


class _Status:
    """NotifyRegistrationStatus of one site: passed on to it, a failure kept for the loop."""

    def __init__(self, site: Site, watcher: DirectoryWatcher) -> None:
        self.site = site
        self.watcher = watcher
        self.failed = False

    def __call__(self, registered: bool, error: str) -> None:
        if registered:
            self.site.accepted()
        else:
            log.error(
                "%s: the kubelet's plugin watcher failed to register us: %s; recreating the socket",
                self.site.name,
                printable(error),
                extra={"resource": self.site.name},
            )
            self.site.refused()
            self.failed = True
        self.watcher.notify()


async def _wait_for_loss(
    site: Site, sockets: list[Socket], watcher: DirectoryWatcher, status: _Status
) -> str:
    """Wait until the registration is lost; return why."""
    while True:
        generation = watcher.generation
        if status.failed:
            return "the kubelet reported a failed registration"
        for socket in reversed(sockets):  # the registration socket is served last
            if file_id(socket.path) != socket.identity:
                return f"{socket.path} was removed"
        reason, timeout = site.check()
        if reason is not None:
            return reason
        with anyio.move_on_after(timeout):
            await watcher.wait(generation)


async def _stop(sockets: list[Socket]) -> None:
    # In the order they were served: the registration socket (served last) goes last. Its
    # removal makes the kubelet close its connection to the site, failing the calls in flight;
    # until then they finish in the servers' stop grace (a DRA driver's prepares, while the
    # next instance of a rolling upgrade already takes the new calls).
    # Dropped before stopping, so that a cancellation can never stop one twice.
    while sockets:
        await sockets.pop(0).stop()


async def keep_registered(
    plugin: PluginHandle, settings: Settings, watcher: DirectoryWatcher
) -> None:
    """Keep ``plugin`` served in the plugin-watcher directory until cancelled (a ``Strategy``).

    Raises:
        SocketInUseError: another live server answers on the plugin's socket.
    """
    try:
        await serve_until_lost(_DevicePluginSite(plugin, settings), settings, watcher)
    finally:
        plugin.link.down()


class _DevicePluginSite:
    """One device plugin: both services on one socket in plugins_registry.

    The kubelet's own ListAndWatch stream staying away for ``stream_lost_grace`` after a
    registration is a loss too: a kubelet that dropped the stream never reopens it by itself,
    and a fresh socket makes it register again (a kubelet still restarting finds the fresh
    socket when it is back).
    """

    def __init__(self, plugin: PluginHandle, settings: Settings) -> None:
        self.plugin = plugin
        self.name = plugin.resource
        self.settings = settings
        self.path = settings.instance_socket(settings.plugins_registry_dir, plugin.socket_name)
        self.rolling = bool(settings.instance_uid)

    def registration(self, on_status: OnStatus) -> grpc.GenericRpcHandler:
        return watcher_registration.handler(self.name, on_status, self._on_info)

    def _on_info(self) -> None:
        # The plugin watcher's GetInfo starts a registration: the kubelet then dials the
        # DevicePlugin service on this socket, asks for the options and opens its stream.
        self.plugin.streams.expect_kubelet()

    async def start(self, registration: grpc.GenericRpcHandler, sockets: list[Socket]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        serving = self.plugin.serving()
        server, identity = await start_server(self.path, [serving.handler, registration])
        grace = self.settings.stop_grace
        sockets.append(
            Socket(self.path, identity, lambda: self.plugin.stop(server, serving, grace))
        )
        log.info(
            "%s: serving for the plugin watcher on %s",
            self.name,
            self.path,
            extra={"resource": self.name},
        )

    def accepted(self) -> None:
        self.plugin.streams.registered()
        self.plugin.link.up(0.0, "through the plugin watcher")

    def refused(self) -> None:
        self.plugin.streams.expect_nothing()
        self.plugin.link.down()

    def check(self) -> tuple[str | None, float]:
        streams = self.plugin.streams
        lost_for = streams.missing_for()
        if not self.plugin.link.registered or lost_for is None:
            return None, math.inf
        grace = self.settings.stream_lost_grace
        if self.rolling and streams.dropped:
            # Beside another instance (rolling upgrades), an older kubelet ends our stream when
            # the previous pod's ends (kubelet issue #121994): a fresh socket at once.
            grace = 0.0
        if lost_for >= grace:
            return (
                f"no ListAndWatch stream from the kubelet for {lost_for:.1f}s "
                f"({len(streams)} from other clients)"
            ), 0.0
        return None, grace - lost_for

    def lost(self, reason: str) -> None:
        self.plugin.link.lost(reason)
        self.plugin.streams.expect_nothing()
