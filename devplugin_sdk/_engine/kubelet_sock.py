"""Registration through ``kubelet.sock``: serve, register, wait for the loss, again.

The strategy for every kubelet (the plugin watcher is the other one, ``plugin_watcher``). The
kubelet deletes every socket in its directory when it starts and then creates a new
``kubelet.sock``, so a loss is seen both ways, plus the kubelet closing our stream while it stays
up. Pods admitted before the plugin is back fail for good (protocol reference 7.3), so the path
from a new ``kubelet.sock`` to the kubelet holding our devices is kept short: the next server is
started (staged, ``_server.start_staged``) as soon as the loss is seen, usually while the
kubelet is still starting; once ``kubelet.sock`` is there its socket is renamed into place and
Register is called at once; the old server stops after the new registration (the kubelet accepts
any socket name, but the name stays the same: a staged server leaves grpcio nothing to delete on
the final path). With the same kubelet as before, the old server stops first (kubelet issue
#121994). Where a staged path would be too long, a server starts on the final path once the old
one has stopped. With a pod UID (``Settings.pod_uid``, rolling upgrades) the socket name is the
instance's own, and a stream the kubelet drops while ``kubelet.sock`` stays is a registration
torn down for another instance's end (up to v1.36): it is redone at once, on the same server.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import anyio
import grpc

from devplugin_sdk._backoff import Backoff
from devplugin_sdk._engine.handle import PluginHandle
from devplugin_sdk._engine.kubelet_watch import DirectoryWatcher
from devplugin_sdk._engine.servicer import Serving
from devplugin_sdk._logging import printable
from devplugin_sdk._wire import registration as _registration
from devplugin_sdk._wire.server import (
    FileId,
    SocketVanishedError,
    file_id,
    publish,
    remove_socket,
    remove_staging,
    staged_path,
    start_server,
    start_staged,
)
from devplugin_sdk.api import constants
from devplugin_sdk.settings import Settings

log = logging.getLogger("devplugin_sdk")

__all__ = ["keep_registered"]

_REPEAT_WAITING = 60.0  # seconds between repeats of a "directory missing" warning


async def keep_registered(
    plugin: PluginHandle, settings: Settings, watcher: DirectoryWatcher
) -> None:
    """Keep ``plugin`` registered through ``kubelet.sock`` until cancelled (a ``Strategy``).

    Raises:
        RegistrationRejectedError: the kubelet rejected the plugin for good.
        SocketInUseError: another live server answers on the plugin's socket.
    """
    await _KubeletSockRegistration(plugin, settings, watcher).run()


@dataclass(eq=False)
class _Server:
    """One gRPC server of the plugin, and where its socket is."""

    server: grpc.aio.Server
    serving: Serving
    staged: Path | None  # the private path grpcio bound (None: bound on the socket path)
    own_id: FileId | None = None  # its socket's identity on the socket path, once there


class _KubeletSockRegistration:
    def __init__(self, plugin: PluginHandle, settings: Settings, watcher: DirectoryWatcher) -> None:
        self.plugin = plugin
        self.link = plugin.link
        self.streams = plugin.streams
        self.settings = settings
        self.watcher = watcher
        self.resource = plugin.resource
        # With a pod UID, a name of this instance's own: the next pod's instance serves beside it.
        self.socket_path = settings.instance_socket(settings.device_plugin_dir, plugin.socket_name)
        self.rolling = bool(settings.instance_uid)
        self.again_in_place = False  # the kubelet dropped a registration that can be redone
        self.current: _Server | None = None  # on the socket path
        self.next: _Server | None = None  # staged, not on the socket path yet
        self.old: _Server | None = None  # lost; stops once the next one is registered
        self.staging = True  # False once staging failed: serve on the socket path
        self.registered_with: FileId | None = None  # the kubelet.sock we last registered with
        self.stopped_at: float | None = None
        self.backoff = Backoff(settings.register_backoff_initial, settings.register_backoff_max)

    async def run(self) -> None:
        remove_staging(self.settings.device_plugin_dir)  # what a killed process left there
        try:
            while True:
                kubelet = await self._kubelet_socket()
                if not await self._serving():
                    continue
                if self.registered_with == kubelet:
                    await self._stop_old()
                    await self._let_the_old_stream_end()
                if not await self._register(kubelet):
                    continue
                # The old server stops once the kubelet's stream has sent our devices, off the
                # path of a kubelet restart (a new kubelet never had a connection to it).
                self.link.lost(await self._wait_for_loss(kubelet))
                if self.again_in_place:
                    self.again_in_place = False
                    continue  # the same server registers again
                await self._retire_current()
                await self._prepare_next()
        finally:
            self.link.down()
            self.streams.expect_nothing()
            servers = [self.old, self.current, self.next]
            self.old = self.current = self.next = None
            with anyio.CancelScope(shield=True):
                for server in servers:
                    if server is not None:
                        await self._stop(server)
                remove_staging(self.settings.device_plugin_dir)

    async def _kubelet_socket(self) -> FileId:
        """The identity of ``kubelet.sock``, once it exists.

        While it waits it says so: once at info level while the directory exists (the kubelet
        is starting, or not running), and every ``_REPEAT_WAITING`` seconds at warning level
        while the directory is missing or not a directory (a wrong path or a missing mount).
        """
        said: str | None = None
        said_at = 0.0
        while True:
            generation = self.watcher.generation
            kubelet = file_id(self.settings.kubelet_socket)
            if kubelet is not None:
                return kubelet
            why, serious = self._absent()
            repeat = _REPEAT_WAITING if serious else math.inf
            if why != said or time.monotonic() - said_at >= repeat:
                log.log(
                    logging.WARNING if serious else logging.INFO,
                    "%s: waiting for the kubelet: %s",
                    self.resource,
                    why,
                    extra={"resource": self.resource},
                )
                said, said_at = why, time.monotonic()
            with anyio.move_on_after(max(0.0, said_at + repeat - time.monotonic())):
                await self.watcher.wait(generation)

    def _absent(self) -> tuple[str, bool]:
        """Why ``kubelet.sock`` is not there, and whether that looks like a mistake."""
        directory = self.settings.device_plugin_dir
        if not directory.exists():
            return f"the directory {directory} does not exist (yet); still waiting", True
        if not directory.is_dir():
            return f"{directory} is not a directory", True
        why = f"no {self.settings.kubelet_socket} yet; registering as soon as it appears"
        if directory != Path(constants.DEVICE_PLUGIN_PATH):
            # Not the kubelet's own directory: nothing may ever create kubelet.sock there.
            why += (
                f" (not the kubelet's default directory {constants.DEVICE_PLUGIN_PATH}: "
                f"start a kubelet there, e.g. `devplugin fake-kubelet --dir {directory}`)"
            )
        return why, False

    async def _serving(self) -> bool:
        """Make sure a server of ours is on our socket path; False when it must be tried again."""
        current = self.current
        if current is not None:
            if file_id(self.socket_path) == current.own_id:
                return True
            await self._retire_current()  # its socket was removed or replaced
        if self.next is None:
            await self._prepare_next()
        if self.next is None:
            return await self._serve_in_place()
        if self.old is not None and self.old.staged is None:
            await self._stop_old()  # grpcio would delete the socket path when it stops
        staged = self.next
        assert staged.staged is not None
        ours = [self.old.own_id] if self.old is not None and self.old.own_id else []
        generation = self.watcher.generation
        try:
            staged.own_id = publish(staged.staged, self.socket_path, replaceable=ours)
        except (SocketVanishedError, FileNotFoundError):
            self.next = None
            await self._stop(staged)
            await self._socket_removed(generation)
            return False
        self.next, self.current = None, staged
        return True

    async def _prepare_next(self) -> bool:
        """Start the next server on a staged path (nothing when staging is not possible);
        whether a next server is staged."""
        if self.next is not None:
            return True
        path = staged_path(self.settings.device_plugin_dir) if self.staging else None
        if path is None:
            return False
        serving = self.plugin.serving()
        try:
            server = await start_staged(path, [serving.handler])
        except OSError as exc:
            self.staging = False
            log.info(
                "%s: cannot stage servers in %s (%s); serving on %s directly",
                self.resource,
                path.parent,
                exc,
                self.socket_path,
                extra={"resource": self.resource},
            )
            return False
        self.next = _Server(server, serving, path)
        return True

    async def _serve_in_place(self) -> bool:
        """Start a server on the socket path itself, once the old one has stopped."""
        await self._stop_old()
        generation = self.watcher.generation
        serving = self.plugin.serving()
        try:
            server, own_id = await start_server(self.socket_path, [serving.handler])
        except SocketVanishedError:
            await self._socket_removed(generation)
            return False
        self.current = _Server(server, serving, None, own_id)
        return True

    async def _socket_removed(self, generation: int) -> None:
        # A starting kubelet deletes every file in its directory, ours included.
        log.info(
            "%s: socket removed as it was created (kubelet starting); again",
            self.resource,
            extra={"resource": self.resource},
        )
        with anyio.move_on_after(self.settings.register_backoff_initial):
            await self.watcher.wait(generation)

    async def _let_the_old_stream_end(self) -> None:
        """With the same kubelet as before, let it process the old stream's end first, or it may
        tear down the new registration (kubelet issue #121994)."""
        if self.stopped_at is None:
            return
        remaining = self.settings.reregister_delay - (time.monotonic() - self.stopped_at)
        if remaining > 0:
            await anyio.sleep(remaining)

    async def _register(self, kubelet: FileId) -> bool:
        """One Register call; on failure wait the backoff (or a directory change) and say so."""
        started = time.perf_counter()
        attempt = self.watcher.generation  # a new kubelet.sock during the call retries at once
        streams = self.streams
        streams.expect_kubelet()
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._serve_again_if_removed)
            outcome, why = await _registration.register_once(
                self.settings.kubelet_socket,
                resource_name=self.resource,
                endpoint=self.socket_path.name,
                pre_start_required=self.plugin.pre_start_required,
                preferred_allocation=self.plugin.preferred_allocation,
                timeout=self.settings.register_timeout,
            )
            tg.cancel_scope.cancel()
        if outcome is _registration.Outcome.TIMED_OUT and await self._stream_arrives():
            # Kubelets up to v1.34 finish a registration the client gave up on; retrying at
            # once would register twice.
            outcome = _registration.Outcome.REGISTERED
        if outcome is not _registration.Outcome.REGISTERED:
            streams.expect_nothing()
            delay = self.backoff.next()
            log.warning(
                "%s: Register failed (%s); retrying in %.2gs",
                self.resource,
                printable(why),
                delay,
                extra={"resource": self.resource},
            )
            with anyio.move_on_after(delay):
                await self.watcher.wait(attempt)
            return False
        self.backoff.reset()
        # The kubelet that answered serves kubelet.sock now: a kubelet that started during the
        # call (and so deleted our socket) is the one we reached, not the one we saw before.
        self.registered_with = file_id(self.settings.kubelet_socket) or kubelet
        streams.registered()
        seconds = time.perf_counter() - started
        self.link.up(
            seconds, f"with the kubelet as {self.socket_path.name} in {seconds * 1e3:.1f} ms"
        )
        return True

    async def _serve_again_if_removed(self) -> None:
        """While Register is in flight, serve again at once if our socket is deleted.

        A kubelet that starts deletes every socket in its directory, then serves kubelet.sock.
        Published just before its cleanup, our socket is gone by the time our Register reaches
        the new kubelet.sock, and the kubelet's dial-back would find nothing until its dial
        timeout (10 s). Served again, the dial-back's next attempt reaches us and this one
        Register succeeds (no second registration to race the first).
        """
        while True:
            generation = self.watcher.generation
            current = self.current
            if current is not None and file_id(self.socket_path) != current.own_id:
                log.info(
                    "%s: socket removed during Register (a kubelet starting); serving again",
                    self.resource,
                    extra={"resource": self.resource},
                )
                with anyio.CancelScope(shield=True):  # never half-replaced by the call's end
                    served = await self._serving()
                if served:
                    self.streams.expect_kubelet()  # its dial-back comes to the new one
                continue
            await self.watcher.wait(generation)

    async def _stream_arrives(self) -> bool:
        """Whether the kubelet's ListAndWatch stream opens within the Register deadline."""
        streams = self.streams
        with anyio.move_on_after(self.settings.register_timeout):
            while streams.kubelet is None:
                await self.watcher.wait(self.watcher.generation)
        return streams.kubelet is not None

    async def _wait_for_loss(self, kubelet: FileId) -> str:
        """Wait until the registration is lost; return why."""
        streams = self.streams
        grace = self.settings.stream_lost_grace
        while True:
            generation = self.watcher.generation
            own_id = self.current.own_id if self.current is not None else None
            if file_id(self.socket_path) != own_id:
                # The kubelet deletes every socket in its directory when it starts.
                return "our socket was removed (kubelet restart)"
            current = file_id(self.settings.kubelet_socket)
            if current is not None and current != kubelet:
                return "kubelet.sock was recreated (kubelet restart)"
            sent = streams.kubelet_sent()
            if self.old is not None and sent is not None and sent >= 0:
                # The kubelet holds our devices again: now the old server may take the loop.
                await self._stop_old()
                continue
            # The kubelet dropped our stream: it is stopping, restarting or replacing us. A
            # kubelet that starts deletes our socket, then serves kubelet.sock at once; the next
            # server is bound aside now, off that path (a real kubelet takes seconds to start).
            if streams.dropped and self.next is None and await self._prepare_next():
                continue
            timeout = math.inf
            lost_for = streams.missing_for()
            if self._dropped_beside_a_sibling(lost_for, current, kubelet):
                self.again_in_place = True
                return (
                    "the kubelet ended our stream while it stays up (up to v1.36 it does so to "
                    "the newest instance when an older one's stream ends, kubelet issue "
                    "#121994); registering again at once"
                )
            if lost_for is not None and current is not None:
                # The kubelet never retries a closed ListAndWatch: only a new registration helps,
                # whatever other clients' streams are open.
                if lost_for >= grace:
                    return (
                        f"no ListAndWatch stream from the kubelet for {lost_for:.1f}s while it "
                        f"is up ({len(streams)} from other clients)"
                    )
                timeout = grace - lost_for
            with anyio.move_on_after(timeout):
                await self.watcher.wait(generation)

    def _dropped_beside_a_sibling(
        self, lost_for: float | None, current: FileId | None, kubelet: FileId
    ) -> bool:
        """Whether the kubelet ended our stream while it stays up, with rolling upgrades on.

        Then another instance of the plugin (the previous pod) has just stopped, and an older
        kubelet tore down our registration for its stream's end; it never reopens the stream,
        so only a new Register helps, and the sooner, the fewer admissions fail. (A kubelet
        that is stopping fails the Register, and its successor's start is seen as usual.)
        """
        return (
            self.rolling
            and self.streams.dropped
            and lost_for is not None
            and current == kubelet
            and self.current is not None
        )

    async def _retire_current(self) -> None:
        """The current server lost its registration: it becomes the old one."""
        self.streams.expect_nothing()
        await self._stop_old()
        self.old, self.current = self.current, None

    async def _stop_old(self) -> None:
        # Dropped before stopping, so that a cancellation can never stop it twice.
        old, self.old = self.old, None
        if old is not None:
            await self._stop(old)

    async def _stop(self, server: _Server) -> None:
        if server.staged is not None:
            # grpcio removes only the staged path; like grpcio, no new connection once stopping.
            remove_socket(self.socket_path, server.own_id)
        await self.plugin.stop(server.server, server.serving, self.settings.stop_grace)
        if server.own_id is not None:
            self.stopped_at = time.monotonic()
