"""FakeKubelet: the kubelet's side of the device-plugin protocol, run against real plugins.

Shipped, not only for tests: ``devplugin conformance --register-dir`` and ``devplugin demo`` run
it, and ``devplugin_sdk.testing`` re-exports it for plugin authors' tests. It speaks to plugins
through ``_client``, ``_registration`` and ``watcher_registration`` and never sees protobuf.

It follows the kubelet v1.32 device manager as written down in the protocol reference:
registration validates with the kubelet's error strings and dials back synchronously, calling
GetDevicePluginOptions inside Register; ListAndWatch messages replace the device set and are
checkpointed; a stream end disconnects the plugin (healthy devices become unhealthy, grace period
starts), and, as in v1.32, the client is looked up by resource name (kubelet issue #121994), so a
duplicate registration gets torn down when the old stream ends. ``allocate`` chooses devices the
kubelet's way. ``restart`` wipes the directory except the checkpoint, as kubelet start does.
Its DRA side (``dra``, ``_fake_dra``) registers DRA drivers found by the plugin watcher and
prepares pods' ResourceClaims as the kubelet's DRA manager does.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import shutil
import socket
import stat
import tempfile
import time
import zlib
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import anyio
import anyio.to_thread
import grpc

from devplugin_sdk import _names, fswatch
from devplugin_sdk._wire import client as _client
from devplugin_sdk._wire import registration as _registration
from devplugin_sdk._wire import watcher_registration
from devplugin_sdk.api import constants
from devplugin_sdk.kubelet.fake_dra import KUBELET_SERVICES, FakeDra
from devplugin_sdk.kubelet.memory_api import MemoryApi
from devplugin_sdk.settings import Settings
from devplugin_sdk.types import Allocation

log = logging.getLogger("devplugin_sdk.fake_kubelet")

T = TypeVar("T")

__all__ = [
    "AdmissionError",
    "ContainerAllocation",
    "ContainerStartError",
    "FakeKubelet",
    "FakeKubeletError",
    "KubeletDevice",
    "Registration",
]


class FakeKubeletError(Exception):
    """An error the kubelet would report for a pod."""


class AdmissionError(FakeKubeletError):
    """Pod admission failed (``UnexpectedAdmissionError`` on a real node)."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(f"Allocate failed due to {reason}, which is unexpected")


class ContainerStartError(FakeKubeletError):
    """Container creation failed (``CreateContainerConfigError`` on a real node)."""


#: A device as the kubelet last heard of it (id, health string, NUMA nodes); ``healthy`` is
#: true only for the exact string "Healthy".
KubeletDevice = _client.ListedDevice


@dataclass(frozen=True, slots=True)
class Registration:
    """One Register call as the kubelet saw it."""

    resource_name: str
    endpoint: str
    version: str
    pre_start_required: bool
    preferred_allocation: bool
    at: float
    error: str | None = None


@dataclass(frozen=True, slots=True)
class ContainerAllocation:
    """What a container got: the chosen device IDs and the plugin's response."""

    pod: str
    container: str
    resource_name: str
    device_ids: tuple[str, ...]
    allocation: Allocation
    preferred: tuple[str, ...] | None = None


@dataclass(eq=False)
class _Client:
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
class _Books:
    """The device manager's state for one resource."""

    devices: dict[str, KubeletDevice] = field(default_factory=dict)
    healthy: set[str] = field(default_factory=set)
    unhealthy: set[str] = field(default_factory=set)
    endpoint: _Client | None = None
    stopped_at: float | None = None
    seen_list: bool = False
    messages: int = 0
    streams_ended: int = 0


class FakeKubelet:
    """A kubelet for tests: a real Registration server on ``kubelet.sock`` in a temporary dir.

    Use as an async context manager; ``settings()`` gives plugin settings pointing at it.

    Args:
        directory: The device-plugin directory; a short new temporary one by default (unix
            socket paths are limited to 107 bytes).
        grace_period: Seconds a disconnected plugin's resource keeps its capacity (5 min real).
        dial_timeout: How long Register waits for the plugin's socket to accept (10 s real).
        register_delay: Extra seconds Register takes before dialing (a slow kubelet).
        per_socket_clients: Track clients per (resource, socket) as kubelet v1.37 does, instead
            of per resource (v1.32, with its duplicate-registration bug).
        seed: Seed of the random order in which the kubelet iterates its sets.
        plugin_watcher: Also run the plugin watcher on ``registry_directory`` (plugins put a
            socket there instead of calling Register).
        registry_directory: The plugins_registry directory; by default ``plugins_registry``
            beside ``directory``.
        on_list: Called with the resource name and the devices as each ListAndWatch message
            arrives, before the kubelet's own bookkeeping (a benchmark's clock, say); it must
            not block.
        dra_api: The API (``testing.MemoryApi``) where the DRA side reads ResourceClaims and
            deletes ResourceSlices. With it, the plugin watcher runs even without
            ``plugin_watcher`` (DRA drivers always register there).
        node_name: The node this kubelet runs on (DRA pools are named after it).
        dra_services: The DRA gRPC services this kubelet speaks, most recent first; a 1.32
            kubelet is ``("v1beta1.DRAPlugin",)``.
        dra_call_timeout: The deadline of the DRA calls (45 s real).
        dra_wiping_delay: How long after a DRA driver went away its slices are deleted (30 s).

    Fault hooks, for what a real kubelet does on its own: ``drop_streams()`` ends ListAndWatch
    streams while the kubelet stays up, ``reject(reason)`` answers registrations with an error,
    ``crash()`` leaves a stale ``kubelet.sock``, ``restart()`` wipes the directory.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str] | None = None,
        *,
        grace_period: float = constants.ENDPOINT_STOP_GRACE_PERIOD_S,
        dial_timeout: float = constants.KUBELET_DIAL_TIMEOUT_S,
        register_delay: float = 0.0,
        per_socket_clients: bool = False,
        seed: int = 0,
        plugin_watcher: bool = False,
        registry_directory: str | os.PathLike[str] | None = None,
        on_list: Callable[[str, tuple[KubeletDevice, ...]], None] | None = None,
        dra_api: MemoryApi | None = None,
        node_name: str = "node-1",
        dra_services: Sequence[str] = KUBELET_SERVICES,
        dra_call_timeout: float = constants.DRA_CALL_TIMEOUT_S,
        dra_wiping_delay: float = constants.DRA_WIPING_DELAY_S,
    ) -> None:
        self._own_directory = directory is None
        self.directory = Path(directory) if directory is not None else Path()
        self._registry_arg = Path(registry_directory) if registry_directory is not None else None
        self.registry_directory = self._registry_arg or self.directory.parent / "plugins_registry"
        self.plugin_watcher = plugin_watcher
        self.node_name = node_name
        self.dra = FakeDra(
            dra_api,
            node_name=node_name,
            services=dra_services,
            call_timeout=dra_call_timeout,
            wiping_delay=dra_wiping_delay,
            notify=self._notify,
        )
        self._watched: dict[Path, _Client | None] = {}
        self._watcher_scope: anyio.CancelScope | None = None
        self.grace_period = grace_period
        self.dial_timeout = dial_timeout
        self.register_delay = register_delay
        self.per_socket_clients = per_socket_clients
        self.registrations: list[Registration] = []
        self.register_calls = 0
        self.restarts = 0
        self.on_list = on_list
        self._rejection: tuple[str, int | None] | None = None
        self._streams: set[_Client] = set()
        self._random = random.Random(seed)
        self._books: dict[str, _Books] = {}
        self._clients: dict[tuple[str, str], _Client] = {}
        self._allocations: dict[tuple[str, str, str], ContainerAllocation] = {}
        self._server: grpc.aio.Server | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._changed = anyio.Event()
        self._pod_counter = 0
        self._checkpoint_dirty = False
        self._checkpoint_wakeup = anyio.Event()
        self._checkpoint_lock = anyio.Lock()

    # ------------------------------------------------------------------ context management

    async def __aenter__(self) -> FakeKubelet:
        if self._own_directory:
            root = Path(tempfile.mkdtemp(prefix="dpk-", dir="/tmp"))
            self.directory = root / "device-plugins"
            self.registry_directory = self._registry_arg or root / "plugins_registry"
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        self._tg.start_soon(self._checkpoint_writer)
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        with anyio.CancelScope(shield=True):
            await self.stop()
        assert self._tg is not None
        self._tg.cancel_scope.cancel()
        result = await self._tg.__aexit__(exc_type, exc, tb)
        if self._own_directory:
            shutil.rmtree(self.directory.parent, ignore_errors=True)
        return result

    @property
    def socket_path(self) -> Path:
        """Path of ``kubelet.sock``."""
        return self.directory / constants.KUBELET_SOCKET_NAME

    @property
    def checkpoint_path(self) -> Path:
        return self.directory / constants.CHECKPOINT_NAME

    @property
    def running(self) -> bool:
        return self._server is not None

    def settings(self, **overrides: Any) -> Settings:
        """Plugin settings for this kubelet, with test-friendly timings."""
        values: dict[str, Any] = {
            "device_plugin_dir": self.directory,
            "register_timeout": 15.0,
            "register_backoff_initial": 0.02,
            "register_backoff_max": 0.5,
            "restart_poll_interval": 0.5,
            "stream_lost_grace": 1.0,
            "reregister_delay": 0.2,
            "health_interval": 0.5,
            "stop_grace": 0.5,
            "plugins_registry_dir": self.registry_directory,
            "registration": "watcher" if self.plugin_watcher else "kubelet",
        }
        values.update(overrides)
        return Settings(**values)

    # ------------------------------------------------------------------ kubelet start / stop

    async def start(self) -> None:
        """Start as the kubelet does: read the checkpoint, clean the directory, serve."""
        if self._server is not None:
            raise RuntimeError("FakeKubelet is already running")
        self.directory.mkdir(mode=0o750, parents=True, exist_ok=True)
        async with self._checkpoint_lock:
            self._read_checkpoint()
            self._cleanup_directory()
        server = grpc.aio.server()
        server.add_generic_rpc_handlers([_registration.registration_server(self._register)])
        server.add_insecure_port(f"unix:{self.socket_path}")
        with anyio.CancelScope(shield=True):  # never leave a half-started server behind
            await server.start()
        self._server = server
        assert self._tg is not None
        self.dra.start(self._tg)
        if self.plugin_watcher or self.dra.api is not None:
            # Unlike device-plugins, plugins_registry is not cleaned at start: existing sockets
            # are found by a scan and registered again.
            self.registry_directory.mkdir(parents=True, exist_ok=True)
            assert self._tg is not None
            self._watcher_scope = anyio.CancelScope()
            self._tg.start_soon(self._run_plugin_watcher, self._watcher_scope)
        self._notify()

    async def stop(self) -> None:
        """Stop gracefully: disconnect every plugin and remove ``kubelet.sock``."""
        server, self._server = self._server, None
        if server is None:
            return
        if self._watcher_scope is not None:
            self._watcher_scope.cancel()
            self._watcher_scope = None
        self._watched.clear()
        await self.dra.stop()
        for client in list(self._clients.values()):
            await self._disconnect(client)
        await server.stop(0)
        # Go's unix listener removes its socket on Close (grpcio does too; make it certain).
        self.socket_path.unlink(missing_ok=True)
        async with self._checkpoint_lock:
            self._flush_checkpoint()
        self._notify()

    async def crash(self) -> None:
        """Stop without cleanup: plugins' streams break and a stale ``kubelet.sock`` stays."""
        await self.stop()
        stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        stale.bind(str(self.socket_path))
        stale.close()  # bound, never listening: connections are refused
        self._notify()

    async def restart(self) -> None:
        """Stop, then start again (wiping every non-directory file but the checkpoint).

        There is no variant that keeps the plugins' sockets: a kubelet removes every entry
        directly in its directory but the checkpoint and subdirectories *before* it creates the
        new ``kubelet.sock``, and does not start at all if a removal fails (protocol reference,
        7.1). What a restart keeps is what a real one keeps: sockets in subdirectories (where no
        plugin should put one) and, with ``plugin_watcher``, the ``plugins_registry`` directory,
        whose sockets the watcher finds and registers again.
        """
        await self.stop()
        self.restarts += 1
        await self.start()

    # ------------------------------------------------------------------ fault hooks

    def reject(self, reason: str | None, *, times: int | None = None) -> None:
        """Answer registrations with the error ``reason`` until cleared with ``reject(None)``.

        On the ``kubelet.sock`` path Register fails with ``reason`` (status UNKNOWN, as the
        kubelet's errors are) before any check or dial-back; e.g. the kubelet's version
        rejection, ``requested API version "v1beta1" is not supported by kubelet. Supported
        version is ["v2"]``. On the plugin-watcher path the connection that follows a valid
        GetInfo fails with ``reason`` and the plugin is told so through
        NotifyRegistrationStatus. Each rejection is recorded in ``registrations``.

        Args:
            reason: The kubelet's error message, or None to accept registrations again.
            times: Reject only the next ``times`` registrations, then accept again.
        """
        if reason is not None and times is not None and times < 1:
            raise ValueError(f"times must be at least 1, got {times}")
        self._rejection = None if reason is None else (reason, times)

    def _take_rejection(self) -> str | None:
        if self._rejection is None:
            return None
        reason, times = self._rejection
        if times is not None:
            self._rejection = (reason, times - 1) if times > 1 else None
        return reason

    async def drop_streams(self, resource: str | None = None) -> int:
        """End ListAndWatch streams from the kubelet's side while the kubelet stays up.

        The kubelet does this on its own errors (a message over 4 MiB) and, in v1.32, when an
        old registration's stream ends (issue #121994). Each end is processed as the kubelet
        does: the plugin is disconnected (its healthy devices become unhealthy and the grace
        period starts) and never redialled; only a new registration brings the resource back.
        Returns once every end has been processed.

        Args:
            resource: Only the streams of this resource; every stream by default.

        Returns:
            How many streams were ended.
        """
        dropped = [c for c in self._streams if resource is None or c.resource == resource]
        for client in dropped:
            client.scope.cancel()
        for client in dropped:
            await client.ended.wait()
        return len(dropped)

    def _cleanup_directory(self) -> None:
        # The kubelet removes every entry directly in its directory except the checkpoint and
        # subdirectories, whatever its type (CleanupPluginDirectory).
        for entry in os.scandir(self.directory):
            if entry.name == constants.CHECKPOINT_NAME or entry.is_dir(follow_symlinks=False):
                continue
            # os.RemoveAll in the kubelet: a file already gone is not an error.
            Path(entry.path).unlink(missing_ok=True)

    def _read_checkpoint(self) -> None:
        try:
            data = json.loads(self.checkpoint_path.read_text())["Data"]
        except (OSError, ValueError, KeyError):
            return
        now = time.monotonic()
        for resource in data.get("RegisteredDevices", {}):
            # Resources from the checkpoint get a stopped endpoint and empty sets.
            books = self._books.setdefault(resource, _Books())
            books.devices.clear()
            books.healthy.clear()
            books.unhealthy.clear()
            books.endpoint = None
            books.stopped_at = now

    def _write_checkpoint(self) -> None:
        """Schedule a checkpoint write (the kubelet writes one after every list and allocation).

        Writes happen off the event loop and coalesce, so the views update first, as in the
        kubelet, and a slow disk does not inflate what tests measure; ``stop`` flushes.
        """
        self._checkpoint_dirty = True
        self._checkpoint_wakeup.set()

    def _checkpoint_text(self) -> str:
        entries = [
            {
                "PodUID": a.pod,
                "ContainerName": a.container,
                "ResourceName": a.resource_name,
                "DeviceIDs": {"-1": list(a.device_ids)},
                "AllocResp": "",
            }
            for a in self._allocations.values()
        ]
        registered = {r: sorted(b.healthy) for r, b in self._books.items()}
        data = json.dumps(
            {"PodDeviceEntries": entries, "RegisteredDevices": registered}, sort_keys=True
        )
        return f'{{"Data":{data},"Checksum":{zlib.crc32(data.encode())}}}'

    def _flush_checkpoint(self) -> None:
        if not self._checkpoint_dirty:
            return
        self._checkpoint_dirty = False
        tmp = self.checkpoint_path.with_name(".checkpoint.tmp")
        tmp.write_text(self._checkpoint_text())
        os.replace(tmp, self.checkpoint_path)

    async def _checkpoint_writer(self) -> None:
        while True:
            await self._checkpoint_wakeup.wait()
            self._checkpoint_wakeup = anyio.Event()
            # start() cleans the directory under the same lock: it must not see a temp file.
            async with self._checkpoint_lock:
                text = self._checkpoint_text()
                self._checkpoint_dirty = False

                def write(text: str = text) -> None:
                    tmp = self.checkpoint_path.with_name(".checkpoint.bg.tmp")
                    tmp.write_text(text)
                    os.replace(tmp, self.checkpoint_path)

                try:
                    await anyio.to_thread.run_sync(write)
                except OSError:
                    log.exception("FakeKubelet could not write its checkpoint")

    # ------------------------------------------------------------------ Register

    async def _register(self, request: _registration.RegisterCall) -> str | None:
        """Register: None accepts it; an error message is the kubelet's answer."""
        self.register_calls += 1
        self._notify()  # tests may wait for a call to arrive (wait_for)
        record = Registration(
            resource_name=request.resource_name,
            endpoint=request.endpoint,
            version=request.version,
            pre_start_required=request.pre_start_required,
            preferred_allocation=request.preferred_allocation,
            at=time.monotonic(),
        )
        done = anyio.Event()
        outcome: list[str | None] = []

        async def connect() -> None:
            error = await self._connect(request)
            self.registrations.append(record if error is None else _with_error(record, error))
            outcome.append(error)
            self._notify()
            done.set()

        # v1.32 ignores the request's context: a client that gives up does not stop the
        # kubelet from dialing back, fetching options and opening ListAndWatch.
        assert self._tg is not None
        self._tg.start_soon(connect)
        await done.wait()
        return outcome[0]

    async def _connect(self, request: _registration.RegisterCall) -> str | None:
        rejection = self._take_rejection()
        if rejection is not None:
            return rejection
        if request.version not in constants.SUPPORTED_VERSIONS:
            return (
                f'requested API version "{request.version}" is not supported by kubelet. '
                f'Supported version is ["{constants.VERSION}"]'
            )
        if not _names.is_extended_resource_name(request.resource_name):
            return f'the ResourceName "{request.resource_name}" is invalid'
        if self.register_delay:
            await anyio.sleep(self.register_delay)
        return await self._connect_client(
            request.resource_name, _join_endpoint(self.directory, request.endpoint)
        )

    async def _connect_client(self, resource: str, path: Path) -> str | None:
        """Dial the plugin, get its options and start ListAndWatch (connectClient)."""
        channel = grpc.aio.insecure_channel(f"unix:{path}")
        client = _Client(resource, path, channel, _client.DevicePluginClient(channel))
        key = self._key(resource, path)
        self._clients[key] = client
        if not await _client.ready(channel, self.dial_timeout):
            self._deregister(key)
            await channel.close()
            return "failed to dial device plugin: context deadline exceeded"
        try:
            client.options = await client.plugin.options()
        except grpc.aio.AioRpcError as exc:
            self._deregister(key)
            await channel.close()
            return (
                "failed to get device plugin options: "
                f"rpc error: code = {_code_name(exc.code())} desc = {exc.details()}"
            )
        books = self._books.setdefault(resource, _Books())
        # The new endpoint replaces any previous one for the resource, live or stopped.
        books.endpoint = client
        books.stopped_at = None
        assert self._tg is not None
        self._streams.add(client)
        self._tg.start_soon(self._run_client, client)
        return None

    # ------------------------------------------------------------------ plugin watcher

    async def _run_plugin_watcher(self, scope: anyio.CancelScope) -> None:
        with scope:
            self._scan_registry()
            async for _changed in fswatch.watch([self.registry_directory], poll_interval=1.0):
                self._scan_registry()

    def _scan_registry(self) -> None:
        present: set[Path] = set()
        for entry in os.scandir(self.registry_directory):
            # Only sockets whose name does not start with "." count.
            if entry.name.startswith(".") or not stat.S_ISSOCK(
                entry.stat(follow_symlinks=False).st_mode
            ):
                continue
            path = Path(entry.path)
            present.add(path)
            if path not in self._watched:
                self._watched[path] = None
                assert self._tg is not None
                self._tg.start_soon(self._register_watched, path)
        for path in set(self._watched) - present:
            # Deleting the socket deregisters the plugin.
            client = self._watched.pop(path)
            if client is not None and self._tg is not None:
                self._tg.start_soon(self._disconnect, client)
            elif self._tg is not None:
                self._tg.start_soon(self.dra.deregister, path)

    async def _register_watched(self, path: Path) -> None:
        """The reconciler's registration of one socket, retried with backoff until recorded."""
        backoff = 0.05
        while path in self._watched and self._server is not None:
            error, info = await self._validate_watched(path)
            if info is not None and error is None:
                break
            if info is not None:
                await self._notify_status(path, False, f"RegisterPlugin error -- {error}")
            await anyio.sleep(backoff)
            # The kubelet retries from 0.5 s up to about 2 minutes; scaled down here.
            backoff = min(backoff * 2, 2.0)
        else:
            return
        if info.type == constants.PLUGIN_TYPE_DRA_PLUGIN:
            error = self._take_rejection() or await self.dra.register(path, info)
            await self._notify_status(
                path, error is None, "" if error is None else f"RegisterPlugin error -- {error}"
            )
            return
        record = Registration(
            resource_name=info.name,
            endpoint=str(path),
            version=constants.VERSION,
            pre_start_required=False,
            preferred_allocation=False,
            at=time.monotonic(),
        )
        endpoint = Path(info.endpoint) if info.endpoint else path
        self.register_calls += 1
        error = self._take_rejection()
        if error is None:
            error = await self._connect_client(info.name, endpoint)
        client = self._books[info.name].endpoint if error is None else None
        if client is not None:
            self._watched[path] = client
            record = Registration(
                resource_name=record.resource_name,
                endpoint=record.endpoint,
                version=record.version,
                pre_start_required=client.options.pre_start_required,
                preferred_allocation=client.options.preferred_allocation,
                at=record.at,
            )
        self.registrations.append(record if error is None else _with_error(record, error))
        self._notify()
        # Failures after the plugin is recorded are not retried (v1.32): the plugin is told.
        await self._notify_status(
            path, error is None, "" if error is None else f"RegisterPlugin error -- {error}"
        )

    async def _validate_watched(
        self, path: Path
    ) -> tuple[str | None, watcher_registration.PluginInfo | None]:
        try:
            info = await watcher_registration.get_info(path, dial_timeout=self.dial_timeout)
        except (TimeoutError, grpc.aio.AioRpcError) as exc:
            return f"failed to get plugin info: {exc}", None
        if info.type == constants.PLUGIN_TYPE_DRA_PLUGIN:
            return None, info  # the DRA manager validates it (FakeDra.register)
        if info.type != constants.PLUGIN_TYPE_DEVICE_PLUGIN:
            return f"plugin type {info.type!r} is not handled here", info
        if constants.VERSION not in info.supported_versions:
            return (
                "plugin validation failed with err: manager version, v1beta1, is not among plugin "
                f"supported versions {list(info.supported_versions)}",
                info,
            )
        if not _names.is_extended_resource_name(info.name):
            return (
                "plugin validation failed with err: invalid name of device plugin socket: "
                f'the ResourceName "{info.name}" is invalid',
                info,
            )
        return None, info

    async def _notify_status(self, path: Path, registered: bool, error: str) -> None:
        try:
            await watcher_registration.notify_status(path, registered, error)
        except grpc.aio.AioRpcError as exc:
            log.info("NotifyRegistrationStatus to %s failed: %s", path, exc.code().name)

    def _key(self, resource: str, path: Path) -> tuple[str, str]:
        return (resource, str(path) if self.per_socket_clients else "")

    def _deregister(self, key: tuple[str, str]) -> None:
        self._clients.pop(key, None)

    async def _run_client(self, client: _Client) -> None:
        try:
            with client.scope:
                try:
                    async for devices in client.plugin.list_and_watch():
                        self._on_list(client, devices)
                except grpc.aio.AioRpcError as exc:
                    log.info("ListAndWatch for %s ended: %s", client.resource, exc.code().name)
                except Exception:
                    log.exception("ListAndWatch for %s failed", client.resource)
            log.info("ListAndWatch ended unexpectedly for resource %s", client.resource)
            # v1.32 looks the client up by resource name only: when an old registration's
            # stream ends it finds, and disconnects, the newest client of the resource.
            current = self._clients.get(self._key(client.resource, client.socket_path))
            if current is not None:
                await self._disconnect(current)
        finally:
            self._streams.discard(client)
            books = self._books.get(client.resource)
            if books is not None:
                books.streams_ended += 1
            client.ended.set()
            self._notify()

    async def _disconnect(self, client: _Client) -> None:
        self._deregister(self._key(client.resource, client.socket_path))
        client.scope.cancel()
        await client.channel.close()
        books = self._books.get(client.resource)
        if books is not None and client.stopped_at is None:
            client.stopped_at = time.monotonic()
            # PluginDisconnected: every healthy device becomes unhealthy; the grace clock starts.
            books.unhealthy |= books.healthy
            books.healthy.clear()
            books.stopped_at = client.stopped_at
        self._notify()

    def _on_list(self, client: _Client, devices: tuple[KubeletDevice, ...]) -> None:
        if self.on_list is not None:
            self.on_list(client.resource, devices)
        books = self._books.setdefault(client.resource, _Books())
        books.devices = {}
        books.healthy = set()
        books.unhealthy = set()
        for kd in devices:
            books.devices[kd.id] = kd
            (books.healthy if kd.healthy else books.unhealthy).add(kd.id)
        books.seen_list = True
        books.messages += 1
        self._write_checkpoint()
        self._notify()

    # ------------------------------------------------------------------ views

    def _live_books(self, resource: str) -> _Books | None:
        books = self._books.get(resource)
        if books is None:
            return None
        if (
            books.stopped_at is not None
            and time.monotonic() - books.stopped_at >= self.grace_period
        ):
            # GetCapacity drops an endpoint stopped for longer than the grace period.
            books.devices.clear()
            books.healthy.clear()
            books.unhealthy.clear()
            books.endpoint = None
        return books

    def capacity(self, resource: str) -> int:
        """Node capacity for ``resource`` (healthy plus unhealthy devices)."""
        books = self._live_books(resource)
        return 0 if books is None else len(books.healthy) + len(books.unhealthy)

    def allocatable(self, resource: str) -> int:
        """Node allocatable for ``resource`` (healthy devices)."""
        books = self._live_books(resource)
        return 0 if books is None else len(books.healthy)

    def devices(self, resource: str) -> dict[str, KubeletDevice]:
        """Devices of ``resource`` from the latest ListAndWatch message."""
        books = self._live_books(resource)
        return {} if books is None else dict(books.devices)

    def is_registered(self, resource: str) -> bool:
        """Whether ``resource`` has a live (not stopped) endpoint."""
        books = self._books.get(resource)
        return bool(books and books.endpoint is not None and books.endpoint.stopped_at is None)

    def connections(self, resource: str) -> int:
        """How many live client connections the kubelet holds for ``resource``."""
        return sum(
            1 for c in self._clients.values() if c.resource == resource and c.stopped_at is None
        )

    def messages(self, resource: str) -> int:
        """How many ListAndWatch messages the kubelet processed for ``resource``."""
        books = self._books.get(resource)
        return 0 if books is None else books.messages

    def ended_streams(self, resource: str) -> int:
        """How many ListAndWatch streams of ``resource`` have ended, each end processed."""
        books = self._books.get(resource)
        return 0 if books is None else books.streams_ended

    def successful_registrations(self, resource: str) -> list[Registration]:
        return [r for r in self.registrations if r.resource_name == resource and r.error is None]

    # ------------------------------------------------------------------ waiting

    def _notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    async def wait_for(
        self, predicate: Callable[[], bool], timeout: float = 5.0, what: str = "condition"
    ) -> None:
        """Wait until ``predicate()`` holds, re-checking on every kubelet state change.

        Raises:
            TimeoutError: naming ``what`` and the kubelet's view, after ``timeout`` seconds.
        """
        try:
            with anyio.fail_after(timeout):
                while not predicate():
                    with anyio.move_on_after(0.05):
                        # Capacity can also change with time alone (the grace period).
                        await self._changed.wait()
        except TimeoutError:
            raise TimeoutError(
                f"timed out after {timeout:g}s waiting for {what}; {self.describe()}"
            ) from None

    async def wait_for_allocatable(self, resource: str, count: int, timeout: float = 5.0) -> None:
        """Wait until ``allocatable(resource) == count``."""
        await self.wait_for(
            lambda: self.allocatable(resource) == count,
            timeout,
            f"allocatable {resource} == {count}",
        )

    async def wait_for_health(
        self, resource: str, device_id: str, health: str, timeout: float = 5.0
    ) -> None:
        """Wait until the kubelet sees ``device_id`` with ``health``."""

        def check() -> bool:
            device = self.devices(resource).get(device_id)
            return device is not None and device.health == str(health)

        await self.wait_for(check, timeout, f"{resource} device {device_id} {health}")

    async def wait_for_registrations(self, resource: str, count: int, timeout: float = 5.0) -> None:
        """Wait until ``resource`` has registered successfully ``count`` times in total."""
        await self.wait_for(
            lambda: len(self.successful_registrations(resource)) >= count,
            timeout,
            f"{count} registrations of {resource}",
        )

    def describe(self) -> str:
        """A one-line summary of what the kubelet sees, for failure messages."""
        parts = [f"kubelet {'running' if self.running else 'stopped'}"]
        for resource in sorted(self._books):
            parts.append(
                f"{resource}: capacity={self.capacity(resource)} "
                f"allocatable={self.allocatable(resource)} "
                f"registered={self.is_registered(resource)}"
            )
        parts.append(f"{len(self.registrations)} Register calls")
        return "; ".join(parts)

    # ------------------------------------------------------------------ allocation

    async def allocate(
        self,
        resource: str,
        count: int,
        *,
        pod: str | None = None,
        container: str = "main",
        start: bool = True,
    ) -> ContainerAllocation:
        """Admit a container asking for ``count`` devices, as the kubelet does.

        Chooses devices (GetPreferredAllocation when offered), calls Allocate, records the
        result, then, with ``start``, calls PreStartContainer when the plugin requires it.

        Raises:
            AdmissionError: with the kubelet's reason (no healthy devices, unavailable, RPC error).
            ContainerStartError: PreStartContainer failed.
        """
        if pod is None:
            self._pod_counter += 1
            pod = f"pod-{self._pod_counter}"
        key = (pod, container, resource)
        existing = self._allocations.get(key)
        if existing is not None:
            if len(existing.device_ids) != count:
                raise AdmissionError(
                    f'pod "{pod}" container "{container}" changed request for resource '
                    f'"{resource}" from {len(existing.device_ids)} to {count}'
                )
            if start:
                await self.start_container(existing)
            return existing
        client, available = self._candidates(resource, count)
        chosen, preferred = await self._choose(client, available, count)
        ids = list(chosen)
        self._random.shuffle(ids)
        try:
            allocation = await _call(client.plugin.allocate_first(ids))
        except grpc.aio.AioRpcError as exc:
            raise AdmissionError(_rpc_error(exc)) from None
        if allocation is None:
            raise AdmissionError(_NO_CONTAINERS)
        result = ContainerAllocation(
            pod=pod,
            container=container,
            resource_name=resource,
            device_ids=tuple(sorted(ids)),
            allocation=allocation,
            preferred=preferred,
        )
        self._allocations[key] = result
        self._write_checkpoint()
        self._notify()
        if start:
            await self.start_container(result)
        return result

    def _candidates(self, resource: str, count: int) -> tuple[_Client, list[str]]:
        """The endpoint and the healthy free devices, in Go's random set order (the kubelet's
        checks before it asks the plugin anything)."""
        books = self._live_books(resource)
        if books is None or not books.seen_list:
            raise AdmissionError(f"cannot allocate unregistered device {resource}")
        if not books.healthy:
            raise AdmissionError(
                f"no healthy devices present; cannot allocate unhealthy devices {resource}"
            )
        in_use = {
            i
            for a in self._allocations.values()
            if a.resource_name == resource
            for i in a.device_ids
        }
        available = sorted(books.healthy - in_use)
        self._random.shuffle(available)  # Go set iteration order is random
        if len(available) < count:
            raise AdmissionError(
                f"requested number of devices unavailable for {resource}. "
                f"Requested: {count}, Available: {len(available)}"
            )
        client = books.endpoint
        if client is None:
            raise AdmissionError(f"unknown Device Plugin {resource}")
        if client.stopped_at is not None:
            raise AdmissionError(f"endpoint {client.socket_path} has been stopped")
        return client, available

    async def _choose(
        self, client: _Client, available: list[str], count: int
    ) -> tuple[list[str], tuple[str, ...] | None]:
        """The devices to allocate: the plugin's preference (intersected with the candidates),
        filled up from the candidates; and what the plugin preferred."""
        chosen: list[str] = []
        preferred: tuple[str, ...] | None = None
        if client.options.preferred_allocation:
            try:
                preferred = await _call(client.plugin.preferred_allocation(available, [], count))
            except grpc.aio.AioRpcError as exc:
                raise AdmissionError(
                    f"device plugin GetPreferredAllocation rpc failed with err: {_rpc_error(exc)}"
                ) from None
            if preferred is not None:
                # Only the intersection with the candidates counts; order means nothing.
                valid = [i for i in dict.fromkeys(preferred) if i in set(available)]
                if len(valid) > count:
                    valid = self._random.sample(valid, count)
                chosen = valid
        for device_id in available:
            if len(chosen) >= count:
                break
            if device_id not in chosen:
                chosen.append(device_id)
        return chosen, preferred

    async def start_container(self, allocation: ContainerAllocation) -> None:
        """Start (or restart) a container: PreStartContainer when the plugin requires it.

        Raises:
            ContainerStartError: the plugin's endpoint is gone or PreStartContainer failed.
        """
        books = self._live_books(allocation.resource_name)
        client = books.endpoint if books is not None else None
        if client is None:
            raise ContainerStartError(
                f"endpoint not found in cache for a registered resource: {allocation.resource_name}"
            )
        if client.stopped_at is not None or not client.options.pre_start_required:
            return
        try:
            await _call(
                client.plugin.pre_start_container(
                    allocation.device_ids, timeout=constants.PRE_START_CONTAINER_TIMEOUT_S
                )
            )
        except grpc.aio.AioRpcError as exc:
            raise ContainerStartError(
                f"device plugin PreStartContainer rpc failed with err: {_rpc_error(exc)}"
            ) from None

    def release(self, allocation: ContainerAllocation) -> None:
        """The pod ended: its devices are free again (the plugin is never told)."""
        self._allocations.pop(
            (allocation.pod, allocation.container, allocation.resource_name), None
        )
        self._write_checkpoint()
        self._notify()

    def allocated(self, resource: str) -> set[str]:
        """IDs of ``resource`` held by containers."""
        return {
            i
            for a in self._allocations.values()
            if a.resource_name == resource
            for i in a.device_ids
        }

    async def call_allocate(self, resource: str, device_ids: Iterable[str]) -> Allocation:
        """Call the plugin's Allocate directly with ``device_ids`` (no admission checks).

        Raises:
            grpc.aio.AioRpcError: the plugin's error status.
            AdmissionError: the plugin answered no container response.
        """
        client = self._client_for(resource)
        allocation = await client.plugin.allocate_first(list(device_ids))
        if allocation is None:
            raise AdmissionError(_NO_CONTAINERS)
        return allocation

    def _client_for(self, resource: str) -> _Client:
        books = self._books.get(resource)
        if books is None or books.endpoint is None:
            raise AdmissionError(f"unknown Device Plugin {resource}")
        return books.endpoint


async def _call(call: Awaitable[T]) -> T:
    """Await a call to the plugin; a call cancelled under us is the kubelet's Canceled error.

    grpc.aio raises asyncio.CancelledError when the call (not this task) is cancelled, e.g.
    because the plugin's connection closed; it must not look like this task's cancellation.
    """
    try:
        return await call
    except asyncio.CancelledError:
        task = asyncio.current_task()
        cancelling = getattr(task, "cancelling", None)
        if task is None or cancelling is None or cancelling():
            raise
        raise grpc.aio.AioRpcError(
            grpc.StatusCode.CANCELLED,
            grpc.aio.Metadata(),
            grpc.aio.Metadata(),
            details="the call to the plugin was cancelled",
        ) from None


# The kubelet's message dumps the empty response, which protobuf's text format prints as nothing.
_NO_CONTAINERS = "no containers return in allocation response "


def _join_endpoint(directory: Path, endpoint: str) -> Path:
    # The kubelet joins the endpoint onto its directory with no other check (filepath.Join).
    return Path(os.path.normpath(directory / endpoint))


def _with_error(record: Registration, error: str) -> Registration:
    return Registration(
        resource_name=record.resource_name,
        endpoint=record.endpoint,
        version=record.version,
        pre_start_required=record.pre_start_required,
        preferred_allocation=record.preferred_allocation,
        at=record.at,
        error=error,
    )


def _code_name(code: grpc.StatusCode) -> str:
    # grpc-go spells codes in CamelCase ("InvalidArgument").
    return "".join(part.capitalize() for part in code.name.split("_"))


def _rpc_error(exc: grpc.aio.AioRpcError) -> str:
    return f"rpc error: code = {_code_name(exc.code())} desc = {exc.details()}"
