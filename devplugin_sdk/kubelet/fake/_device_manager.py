"""The device manager's endpoints: one per resource, dialled back at registration, followed on
ListAndWatch, disconnected when the stream ends, and the views of capacity built from them.

It follows the kubelet (protocol reference, sections 3 and 4): ListAndWatch messages replace
the device set and are checkpointed; a stream end disconnects the plugin (healthy devices become
unhealthy, grace period starts). Clients are kept per (resource, socket path) as from v1.37
(PR #135437): an older registration's stream end disconnects that registration only, and the
resource's devices stay with its newest endpoint. With ``per_socket_clients`` off it is v1.32 to
v1.36: the client is looked up by resource name (kubelet issue #121994), so a duplicate
registration gets torn down when the old stream ends.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import anyio
import grpc

from devplugin_sdk._wire import client as _client
from devplugin_sdk._wire.client import call
from devplugin_sdk.kubelet.fake._records import KubeletDevice

__all__ = ["DeviceManager", "Endpoint", "ResourceBooks", "Spawn", "call", "code_name", "rpc_error"]

log = logging.getLogger("devplugin_sdk.fake_kubelet")

#: Starts a task in the kubelet's task group.
Spawn = Callable[..., None]


class _Knobs(Protocol):
    """What the device manager reads from FakeKubelet at each use (tests turn some of them)."""

    grace_period: float
    dial_timeout: float
    per_socket_clients: bool
    on_list: Callable[[str, tuple[KubeletDevice, ...]], None] | None


@dataclass(eq=False)
class Endpoint:
    """One registration: the kubelet's connection to a plugin socket."""

    resource: str
    socket_path: Path
    channel: grpc.aio.Channel
    plugin: _client.DevicePluginClient
    options: _client.PluginOptions = field(
        default_factory=lambda: _client.PluginOptions(
            pre_start_required=False, preferred_allocation=False
        )
    )
    stopped_at: float | None = None
    # Cancelling it ends the ListAndWatch stream from the kubelet's side, even before it opens.
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)
    # Set once the kubelet has processed the end of the stream.
    ended: anyio.Event = field(default_factory=anyio.Event)


@dataclass
class ResourceBooks:
    """The device manager's state for one resource."""

    devices: dict[str, KubeletDevice] = field(default_factory=dict)
    healthy: set[str] = field(default_factory=set)
    unhealthy: set[str] = field(default_factory=set)
    endpoint: Endpoint | None = None
    stopped_at: float | None = None
    seen_list: bool = False
    messages: int = 0
    streams_ended: int = 0


class DeviceManager:
    """The endpoints and device sets of every resource.

    Args:
        knobs: FakeKubelet, read at each use (grace period, dial timeout, client keys, on_list).
        spawn: Starts a task in the kubelet's task group (each ListAndWatch follower).
        checkpoint: Schedules a checkpoint write (after every list).
        notify: Wakes the kubelet's waiters on every change.
    """

    def __init__(
        self,
        knobs: _Knobs,
        *,
        spawn: Spawn,
        checkpoint: Callable[[], None],
        notify: Callable[[], None],
    ) -> None:
        self._knobs = knobs
        self._spawn = spawn
        self._checkpoint = checkpoint
        self._notify = notify
        self._books: dict[str, ResourceBooks] = {}
        self._clients: dict[tuple[str, str], Endpoint] = {}
        self._streams: set[Endpoint] = set()

    # ------------------------------------------------------------------ connecting

    async def connect(self, resource: str, path: Path) -> str | None:
        """Dial the plugin, get its options and start ListAndWatch (connectClient).

        Returns:
            None, or the kubelet's error for the registration.
        """
        # A connection of its own, as each grpc-go ClientConn of the kubelet has: grpcio's
        # global subchannel pool would hand a new registration the connection of the last one,
        # to the plugin's old server, which ends its streams as it stops.
        channel = grpc.aio.insecure_channel(
            f"unix:{path}", options=[("grpc.use_local_subchannel_pool", 1)]
        )
        client = Endpoint(resource, path, channel, _client.DevicePluginClient(channel))
        key = self._key(resource, path)
        self._clients[key] = client
        try:
            dialled = await _client.ready(channel, self._knobs.dial_timeout)
        except grpc.aio.UsageError:  # disconnected under us (see below): closed
            dialled = False
        if not dialled:
            self._deregister(key)
            await channel.close()
            return "failed to dial device plugin: context deadline exceeded"
        try:
            # A call cancelled under us (the plugin's old stream ended and, as in v1.32,
            # disconnected this newest client) is the kubelet's Canceled error.
            client.options = await call(client.plugin.options())
        except grpc.aio.AioRpcError as exc:
            self._deregister(key)
            await channel.close()
            return (
                "failed to get device plugin options: "
                f"rpc error: code = {code_name(exc.code())} desc = {exc.details()}"
            )
        books = self._books.setdefault(resource, ResourceBooks())
        # The new endpoint replaces any previous one for the resource, live or stopped.
        books.endpoint = client
        books.stopped_at = None
        self._streams.add(client)
        self._spawn(self._run_client, client)
        return None

    def _key(self, resource: str, path: Path) -> tuple[str, str]:
        return (resource, str(path) if self._knobs.per_socket_clients else "")

    def _deregister(self, key: tuple[str, str]) -> None:
        self._clients.pop(key, None)

    async def _run_client(self, client: Endpoint) -> None:
        try:
            with client.scope:
                try:
                    async for devices in client.plugin.list_and_watch():
                        self._on_list(client, devices)
                except grpc.aio.AioRpcError as exc:
                    log.info("ListAndWatch for %s ended: %s", client.resource, exc.code().name)
                except grpc.aio.UsageError:  # disconnected before the stream opened
                    log.info("ListAndWatch for %s ended: the connection is closed", client.resource)
                except anyio.get_cancelled_exc_class():
                    # ``disconnect`` cancels the scope, then closes the channel: a read can end
                    # with grpc.aio's bare CancelledError first, which the scope would not take
                    # for its own (and the task group would swallow, cutting the test short).
                    if not client.scope.cancel_called:
                        raise
                except Exception:
                    log.exception("ListAndWatch for %s failed", client.resource)
            log.info("ListAndWatch ended unexpectedly for resource %s", client.resource)
            # v1.32 looks the client up by resource name only: when an old registration's
            # stream ends it finds, and disconnects, the newest client of the resource.
            current = self._clients.get(self._key(client.resource, client.socket_path))
            if current is not None:
                await self.disconnect(current)
        finally:
            self._streams.discard(client)
            books = self._books.get(client.resource)
            if books is not None:
                books.streams_ended += 1
            client.ended.set()
            self._notify()

    async def disconnect(self, client: Endpoint) -> None:
        """End ``client``'s registration (PluginDisconnected)."""
        self._deregister(self._key(client.resource, client.socket_path))
        client.scope.cancel()
        await client.channel.close()
        books = self._books.get(client.resource)
        if books is not None and client.stopped_at is None:
            client.stopped_at = time.monotonic()
            if self._knobs.per_socket_clients and books.endpoint not in (client, None):
                # v1.37: an endpoint another registration took over leaves the resource alone.
                self._notify()
                return
            # PluginDisconnected: every healthy device becomes unhealthy; the grace clock starts.
            books.unhealthy |= books.healthy
            books.healthy.clear()
            books.stopped_at = client.stopped_at
        self._notify()

    async def deregister_plugin(self, client: Endpoint) -> None:
        """The plugin watcher saw ``client``'s socket go (DeRegisterPlugin): the client is looked
        up as a stream end looks it up, so up to v1.36 that is the resource's newest one."""
        current = self._clients.get(self._key(client.resource, client.socket_path))
        if current is not None:
            await self.disconnect(current)

    async def disconnect_all(self) -> None:
        """Disconnect every plugin (the kubelet stops)."""
        for client in list(self._clients.values()):
            await self.disconnect(client)

    def _on_list(self, client: Endpoint, devices: tuple[KubeletDevice, ...]) -> None:
        on_list = self._knobs.on_list
        if on_list is not None:
            on_list(client.resource, devices)
        books = self._books.setdefault(client.resource, ResourceBooks())
        books.devices = {}
        books.healthy = set()
        books.unhealthy = set()
        for kd in devices:
            books.devices[kd.id] = kd
            (books.healthy if kd.healthy else books.unhealthy).add(kd.id)
        books.seen_list = True
        books.messages += 1
        self._checkpoint()
        self._notify()

    async def drop_streams(self, resource: str | None) -> int:
        """End the streams (of ``resource``) from the kubelet's side; see FakeKubelet."""
        dropped = [c for c in self._streams if resource is None or c.resource == resource]
        for client in dropped:
            client.scope.cancel()
        for client in dropped:
            await client.ended.wait()
        return len(dropped)

    def restore(self, resources: list[str]) -> None:
        """Take the resources of the checkpoint read at kubelet start."""
        now = time.monotonic()
        for resource in resources:
            # Resources from the checkpoint get a stopped endpoint and empty sets.
            books = self._books.setdefault(resource, ResourceBooks())
            books.devices.clear()
            books.healthy.clear()
            books.unhealthy.clear()
            books.endpoint = None
            books.stopped_at = now

    # ------------------------------------------------------------------ views

    def books(self, resource: str) -> ResourceBooks | None:
        """The books of ``resource`` as they are (no grace-period expiry)."""
        return self._books.get(resource)

    def live_books(self, resource: str) -> ResourceBooks | None:
        """The books of ``resource``, emptied once its endpoint outlived the grace period."""
        books = self._books.get(resource)
        if books is None:
            return None
        if (
            books.stopped_at is not None
            and time.monotonic() - books.stopped_at >= self._knobs.grace_period
        ):
            # GetCapacity drops an endpoint stopped for longer than the grace period.
            books.devices.clear()
            books.healthy.clear()
            books.unhealthy.clear()
            books.endpoint = None
        return books

    def describe(self) -> list[str]:
        """What the kubelet sees of each resource, one part of ``FakeKubelet.describe`` each."""
        return [
            f"{resource}: capacity={self.capacity(resource)} "
            f"allocatable={self.allocatable(resource)} "
            f"registered={self.is_registered(resource)}"
            for resource in sorted(self._books)
        ]

    def registered_devices(self) -> dict[str, list[str]]:
        """The healthy IDs of every resource (the checkpoint's ``RegisteredDevices``)."""
        return {r: sorted(b.healthy) for r, b in self._books.items()}

    def capacity(self, resource: str) -> int:
        books = self.live_books(resource)
        return 0 if books is None else len(books.healthy) + len(books.unhealthy)

    def allocatable(self, resource: str) -> int:
        books = self.live_books(resource)
        return 0 if books is None else len(books.healthy)

    def devices(self, resource: str) -> dict[str, KubeletDevice]:
        books = self.live_books(resource)
        return {} if books is None else dict(books.devices)

    def is_registered(self, resource: str) -> bool:
        books = self._books.get(resource)
        return bool(books and books.endpoint is not None and books.endpoint.stopped_at is None)

    def connections(self, resource: str) -> int:
        return sum(
            1 for c in self._clients.values() if c.resource == resource and c.stopped_at is None
        )

    def messages(self, resource: str) -> int:
        books = self._books.get(resource)
        return 0 if books is None else books.messages

    def ended_streams(self, resource: str) -> int:
        books = self._books.get(resource)
        return 0 if books is None else books.streams_ended


def code_name(code: grpc.StatusCode) -> str:
    # grpc-go spells codes in CamelCase ("InvalidArgument").
    return "".join(part.capitalize() for part in code.name.split("_"))


def rpc_error(exc: grpc.aio.AioRpcError) -> str:
    """A plugin's error status as the kubelet prints it."""
    return f"rpc error: code = {code_name(exc.code())} desc = {exc.details()}"
