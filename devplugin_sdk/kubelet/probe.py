"""A kubelet's-eye client of any device plugin's socket, and ``devplugin probe`` built on it.

``PluginClient`` dials and calls a plugin exactly as the kubelet's device manager does (insecure
gRPC over the unix socket, 10 s dial, 4 MiB receive limit), whatever language the plugin is in;
``probe``/``watch`` report what the kubelet would get. ``conformance`` reuses the client.
Kubelet behaviour is from the protocol reference (kubelet-device-plugin-protocol.md, sections 2.2,
5 and 8), which cites kubelet v1.32 ``pkg/kubelet/cm/devicemanager``.
"""

from __future__ import annotations

import errno
import os
import stat
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import anyio
import grpc

from devplugin_sdk._wire import client as _client
from devplugin_sdk._wire import convert
from devplugin_sdk.api import constants
from devplugin_sdk.types import Allocation

__all__ = [
    "AllocationReport",
    "DeviceChange",
    "DeviceList",
    "ListStream",
    "ListedDevice",
    "NotADevicePluginError",
    "NotAnsweringError",
    "PluginClient",
    "PluginOptions",
    "PluginRpcError",
    "ProbeError",
    "ProbeReport",
    "ProtocolViolation",
    "SocketMissingError",
    "allocate_like_kubelet",
    "allocation_json",
    "diff_devices",
    "probe",
    "watch",
]

# ------------------------------------------------------------------------------------------ errors


class ProbeError(Exception):
    """Talking to the plugin failed; ``kind`` is a stable word for scripts (``--json``)."""

    kind = "probe-error"


class SocketMissingError(ProbeError):
    """Nothing exists at the socket path."""

    kind = "socket-missing"


class NotAnsweringError(ProbeError):
    """The path exists but no server answers on it (stale socket, hung server, permissions)."""

    kind = "not-answering"


class NotADevicePluginError(ProbeError):
    """Something answers, but it is not a v1beta1 device plugin (not gRPC, or not the service)."""

    kind = "not-a-device-plugin"


class PluginRpcError(ProbeError):
    """The plugin answered an RPC with an error status, or did not answer it in time.

    Attributes:
        rpc: The method name, e.g. ``"Allocate"``.
        code: The gRPC status code.
        details: The plugin's message.
    """

    kind = "rpc-error"

    def __init__(self, rpc: str, code: grpc.StatusCode, details: str) -> None:
        self.rpc = rpc
        self.code = code
        self.details = details
        super().__init__(f"{rpc} failed: {code.name}: {details}")


class ProtocolViolation(ProbeError):
    """The plugin answered, but with something the kubelet cannot use."""

    kind = "protocol-violation"


# ------------------------------------------------------------------------------------------ data


# The plugin's DevicePluginOptions, which the kubelet reads once per registration.
PluginOptions = convert.PluginOptions

# One device of a ListAndWatch message, as sent; shared with FakeKubelet.
ListedDevice = convert.ListedDevice


@dataclass(frozen=True, slots=True)
class DeviceList:
    """One ListAndWatch message: the complete device set (each message replaces the last).

    Attributes:
        devices: The devices in message order, duplicates kept.
        size: Encoded size of the message in bytes.
        received_at: ``time.time()`` when it arrived.
    """

    devices: tuple[ListedDevice, ...]
    size: int
    received_at: float

    @property
    def healthy(self) -> list[ListedDevice]:
        return [d for d in self.devices if d.healthy]

    def by_id(self) -> dict[str, ListedDevice]:
        # Duplicate IDs: the kubelet keeps the last entry in its device map.
        return {d.id: d for d in self.devices}


@dataclass(frozen=True, slots=True)
class DeviceChange:
    """How one device differs between two ListAndWatch messages."""

    id: str
    before: ListedDevice | None
    after: ListedDevice | None

    def describe(self) -> str:
        if self.before is None and self.after is not None:
            return f"+{self.id} {self.after.health}{_numa_suffix(self.after)}"
        if self.after is None:
            return f"-{self.id}"
        assert self.before is not None
        parts = []
        if self.before.health != self.after.health:
            parts.append(f"{self.before.health} -> {self.after.health}")
        if self.before.numa_nodes != self.after.numa_nodes:
            parts.append(
                f"NUMA {_numa_text(self.before.numa_nodes)} -> {_numa_text(self.after.numa_nodes)}"
            )
        return f"{self.id} {', '.join(parts)}"

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "before": None if self.before is None else self.before.to_json(),
            "after": None if self.after is None else self.after.to_json(),
        }


def _numa_text(nodes: tuple[int, ...]) -> str:
    return ",".join(map(str, nodes)) if nodes else "-"


def _numa_suffix(device: ListedDevice) -> str:
    return f" NUMA {_numa_text(device.numa_nodes)}" if device.numa_nodes else ""


def diff_devices(before: DeviceList, after: DeviceList) -> list[DeviceChange]:
    """The devices added, removed or changed (health or NUMA) from ``before`` to ``after``."""
    old, new = before.by_id(), after.by_id()
    changes = []
    for device_id in [*old, *(i for i in new if i not in old)]:
        a, b = old.get(device_id), new.get(device_id)
        if a != b:
            changes.append(DeviceChange(device_id, a, b))
    return changes


def allocation_json(allocation: Allocation) -> dict[str, Any]:
    """A ContainerAllocateResponse as plain JSON, with the protocol's field names."""
    return {
        "devices": [
            {
                "container_path": n.container_path,
                "host_path": n.host_path,
                "permissions": n.permissions,
            }
            for n in allocation.device_nodes
        ],
        "mounts": [
            {"container_path": m.container_path, "host_path": m.host_path, "read_only": m.read_only}
            for m in allocation.mounts
        ],
        "envs": dict(allocation.env),
        "annotations": dict(allocation.annotations),
        "cdi_devices": list(allocation.cdi_devices),
    }


# ------------------------------------------------------------------------------------------ client


class ListStream:
    """An open ListAndWatch stream; iterate it for ``DeviceList`` messages.

    Iteration ends with ``ProtocolViolation`` when the plugin ends the stream (the kubelet then
    treats the plugin as gone) or sends a message over the receive limit.
    """

    def __init__(self, stream: _client.Stream[bytes], opened_at: float) -> None:
        self._call = stream
        self.opened_at = opened_at
        self.messages = 0

    @property
    def ended(self) -> bool:
        """Whether the RPC has finished (by the plugin, an error or ``cancel``)."""
        return self._call.done()

    def cancel(self) -> None:
        """Close the stream from the client side, as the kubelet does on shutdown."""
        self._call.cancel()

    async def next(self, timeout: float | None = None) -> DeviceList:
        """Wait for the next message; a timeout cancels the stream (grpc.aio does so).

        Raises:
            TimeoutError: no message within ``timeout`` seconds.
            ProtocolViolation: the stream ended or the message was too big.
            PluginRpcError: the stream ended with an error status.
            ProbeError: the stream was cancelled from this side (``cancel`` or a timeout).
        """
        if self._call.cancelled():
            raise ProbeError("the ListAndWatch stream was closed by this client")
        with anyio.fail_after(timeout):
            try:
                payload = await self._call.read()
            except grpc.aio.AioRpcError as exc:
                raise _stream_error(exc) from None
        if payload is None:
            raise ProtocolViolation(
                "the plugin ended the ListAndWatch stream; the kubelet treats that as the plugin "
                "going away (its devices become unhealthy until it registers again)"
            )
        self.messages += 1
        return _device_list(payload)

    def __aiter__(self) -> AsyncIterator[DeviceList]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[DeviceList]:
        while True:
            yield await self.next()


def _device_list(payload: bytes) -> DeviceList:
    return DeviceList(
        devices=convert.decode_listed_devices(payload),
        size=len(payload),
        received_at=time.time(),
    )


def _stream_error(exc: grpc.aio.AioRpcError) -> ProbeError:
    if exc.code() is grpc.StatusCode.RESOURCE_EXHAUSTED:
        # grpc-go's default 4 MiB receive limit, which the kubelet never raises.
        return ProtocolViolation(
            f"ListAndWatch message over the kubelet's {constants.MAX_MESSAGE_BYTES} byte receive "
            f"limit ({exc.details()}); the kubelet ends the stream and drops the resource"
        )
    if exc.code() is grpc.StatusCode.UNIMPLEMENTED:
        return NotADevicePluginError(f"ListAndWatch is not implemented: {exc.details()}")
    if exc.code() is grpc.StatusCode.UNAVAILABLE:
        return PluginRpcError(
            "ListAndWatch",
            exc.code(),
            f"{exc.details()}; the connection broke (did the plugin exit or restart?)",
        )
    return PluginRpcError("ListAndWatch", exc.code(), exc.details() or "")


class PluginClient:
    """A connection to one plugin socket, made and used the way the kubelet does.

    Open it with ``await PluginClient.connect(path)`` and close it with ``close()`` or
    ``async with``. Every unary call is bounded by ``rpc_timeout`` (the kubelet sets none but
    PreStartContainer's 30 s, and would wait for ever).

    Args:
        path: The plugin's unix socket.
        channel: A grpc.aio channel to it.
        rpc_timeout: Deadline of each unary call, seconds.
    """

    def __init__(self, path: Path, channel: grpc.aio.Channel, *, rpc_timeout: float = 10.0) -> None:
        self.path = path
        self.rpc_timeout = rpc_timeout
        self.connect_seconds = 0.0
        self._channel = channel
        self._plugin = _client.DevicePluginClient(channel)

    @classmethod
    async def connect(
        cls,
        path: str | os.PathLike[str],
        *,
        timeout: float = constants.KUBELET_DIAL_TIMEOUT_S,
        rpc_timeout: float = 10.0,
        max_receive_bytes: int = constants.MAX_MESSAGE_BYTES,
    ) -> PluginClient:
        """Dial ``path`` like the kubelet: insecure gRPC, wait for READY up to ``timeout``.

        Args:
            path: The plugin's socket.
            timeout: Dial timeout (the kubelet's is 10 s).
            rpc_timeout: Deadline of each unary call afterwards.
            max_receive_bytes: Receive limit (the kubelet's is grpc-go's default, 4 MiB).

        Raises:
            SocketMissingError: nothing at ``path``.
            NotAnsweringError: no server accepts on ``path``, or none speaks within ``timeout``.
            NotADevicePluginError: ``path`` is not a socket, or what answers is not gRPC.
        """
        path = Path(path)
        started = time.perf_counter()
        await _check_socket(path)
        channel = grpc.aio.insecure_channel(
            f"unix:{path}",
            options=[("grpc.max_receive_message_length", max_receive_bytes)],
        )
        try:
            await _wait_ready(channel, path, timeout)
        except BaseException:
            await channel.close()
            raise
        client = cls(path, channel, rpc_timeout=rpc_timeout)
        client.connect_seconds = time.perf_counter() - started
        return client

    async def close(self) -> None:
        """Close the connection; open streams are cancelled (the plugin sees the client go)."""
        await self._channel.close(grace=None)

    async def __aenter__(self) -> PluginClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        with anyio.CancelScope(shield=True):
            await self.close()

    async def options(self) -> PluginOptions:
        """Call GetDevicePluginOptions.

        Raises:
            NotADevicePluginError: the server does not implement v1beta1.DevicePlugin.
            PluginRpcError: any other error status.
        """
        try:
            return await self._plugin.options(timeout=self.rpc_timeout)
        except grpc.aio.AioRpcError as exc:
            if exc.code() is grpc.StatusCode.UNIMPLEMENTED:
                hint = ""
                if self.path.name == constants.KUBELET_SOCKET_NAME:
                    hint = " (kubelet.sock is the kubelet's Registration server, not a plugin)"
                raise NotADevicePluginError(
                    f"{self.path} answers gRPC but does not serve v1beta1.DevicePlugin: "
                    f"GetDevicePluginOptions is UNIMPLEMENTED{hint}"
                ) from None
            raise _rpc_error("GetDevicePluginOptions", exc) from None

    def list_and_watch(self) -> ListStream:
        """Open a ListAndWatch stream (no deadline, like the kubelet's)."""
        # Raw bytes, so that message sizes can be reported.
        return ListStream(self._plugin.list_and_watch_raw(), time.perf_counter())

    async def preferred_allocation(
        self, available: Sequence[str], must_include: Sequence[str], size: int
    ) -> tuple[str, ...] | None:
        """Call GetPreferredAllocation for one container.

        Returns:
            The IDs of the first container response, or None when the answer has none (the
            kubelet then chooses by itself).

        Raises:
            PluginRpcError: an error status (the kubelet fails the pod on it).
        """
        try:
            return await self._plugin.preferred_allocation(
                available, must_include, size, timeout=self.rpc_timeout
            )
        except grpc.aio.AioRpcError as exc:
            raise _rpc_error("GetPreferredAllocation", exc) from None

    async def allocate(self, *containers: Sequence[str]) -> list[Allocation]:
        """Call Allocate with one container request per argument.

        Returns:
            One ``Allocation`` per container response, as many as the plugin sent.

        Raises:
            PluginRpcError: an error status (the kubelet fails the pod with its message).
            ProtocolViolation: a response the kubelet could not use (an empty host path, bad
                permissions).
        """
        try:
            return await self._plugin.allocate(*containers, timeout=self.rpc_timeout)
        except grpc.aio.AioRpcError as exc:
            raise _rpc_error("Allocate", exc) from None
        except ValueError as exc:
            raise ProtocolViolation(
                f"Allocate answered an unusable container response: {exc}"
            ) from None

    async def pre_start_container(self, device_ids: Sequence[str]) -> None:
        """Call PreStartContainer, with the kubelet's 30 s deadline (or ``rpc_timeout``).

        Raises:
            PluginRpcError: an error status (the container fails to start).
        """
        timeout = min(self.rpc_timeout, constants.PRE_START_CONTAINER_TIMEOUT_S)
        try:
            await self._plugin.pre_start_container(device_ids, timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            raise _rpc_error("PreStartContainer", exc) from None


def _rpc_error(rpc: str, exc: grpc.aio.AioRpcError) -> PluginRpcError:
    details = exc.details() or ""
    if exc.code() is grpc.StatusCode.DEADLINE_EXCEEDED:
        details = f"no answer within the probe's deadline ({details})"
    return PluginRpcError(rpc, exc.code(), details)


async def _check_socket(path: Path) -> None:
    """Fail fast with a clear reason when ``path`` cannot be a live plugin socket."""
    try:
        mode = (await anyio.Path(path).stat()).st_mode
    except FileNotFoundError:
        raise SocketMissingError(
            f"no socket at {path}: is the plugin running, and is this its device-plugin "
            "directory? (the kubelet deletes every socket there when it restarts)"
        ) from None
    except PermissionError:
        raise NotAnsweringError(f"cannot reach {path}: permission denied (run as root?)") from None
    if not stat.S_ISSOCK(mode):
        raise NotADevicePluginError(f"{path} is not a unix socket")
    try:
        stream = await anyio.connect_unix(path)
    except OSError as exc:
        if exc.errno == errno.ECONNREFUSED:
            raise NotAnsweringError(
                f"nobody answers on {path}: connection refused (a stale socket left by a plugin "
                "that exited or crashed?)"
            ) from None
        if exc.errno in (errno.EACCES, errno.EPERM):
            raise NotAnsweringError(f"cannot connect to {path}: permission denied") from None
        raise NotAnsweringError(f"cannot connect to {path}: {exc.strerror or exc}") from None
    await stream.aclose()


async def _wait_ready(channel: grpc.aio.Channel, path: Path, timeout: float) -> None:
    """Wait for READY; a connection refused at the HTTP/2 level means 'not gRPC'."""
    deadline = anyio.current_time() + timeout
    state = channel.get_state(try_to_connect=True)
    while state is not grpc.ChannelConnectivity.READY:
        if state is grpc.ChannelConnectivity.TRANSIENT_FAILURE:
            # The socket accepted a plain connection a moment ago (_check_socket), so a
            # failed channel means the HTTP/2 handshake failed: not a gRPC server.
            raise NotADevicePluginError(
                f"{path} accepts connections but does not speak gRPC (HTTP/2); "
                "it is not a device plugin socket"
            )
        if not await _client.state_change(channel, state, deadline - anyio.current_time()):
            break
        state = channel.get_state(try_to_connect=True)
    else:
        return
    raise NotAnsweringError(
        f"{path} accepted a connection but no gRPC server answered within {timeout:g} s "
        "(the kubelet gives up after 10 s: 'failed to dial device plugin')"
    )


# ------------------------------------------------------------------------------------------ probe


@dataclass(frozen=True, slots=True)
class AllocationReport:
    """An allocation made the kubelet's way, and what the plugin answered.

    Attributes:
        requested: A device count, or the explicit IDs asked for.
        preferred: GetPreferredAllocation's answer (None when not advertised or not called;
            an empty tuple when the plugin answered with no container response).
        device_ids: The IDs sent in Allocate.
        allocation: The container response.
        containers: How many container responses the plugin sent (the kubelet sends one
            request and reads only the first response).
    """

    requested: int | tuple[str, ...]
    preferred: tuple[str, ...] | None
    device_ids: tuple[str, ...]
    allocation: Allocation
    containers: int = 1

    def to_json(self) -> dict[str, Any]:
        return {
            "requested": self.requested
            if isinstance(self.requested, int)
            else list(self.requested),
            "preferred": None if self.preferred is None else list(self.preferred),
            "device_ids": list(self.device_ids),
            "container_responses": self.containers,
            "response": allocation_json(self.allocation),
        }


@dataclass(frozen=True, slots=True)
class ProbeReport:
    """What the kubelet gets from a plugin: its options, first device list and an allocation.

    Attributes:
        socket: The socket probed.
        connect_seconds: Time to a READY connection.
        options: The plugin's options.
        options_seconds: Time GetDevicePluginOptions took.
        devices: The first ListAndWatch message.
        list_seconds: Time from opening the stream to its first message.
        allocation: The allocation, when one was asked for.
    """

    socket: str
    connect_seconds: float
    options: PluginOptions
    options_seconds: float
    devices: DeviceList
    list_seconds: float
    allocation: AllocationReport | None = None
    notes: tuple[str, ...] = field(default=())

    def to_json(self) -> dict[str, Any]:
        healthy = len(self.devices.healthy)
        return {
            "socket": self.socket,
            "connect_ms": round(self.connect_seconds * 1000, 3),
            "options": self.options.to_json(),
            "options_ms": round(self.options_seconds * 1000, 3),
            "list_ms": round(self.list_seconds * 1000, 3),
            "list_bytes": self.devices.size,
            "capacity": len(self.devices.by_id()),
            "allocatable": healthy,
            "devices": [d.to_json() for d in self.devices.devices],
            "allocation": None if self.allocation is None else self.allocation.to_json(),
            "notes": list(self.notes),
        }


async def allocate_like_kubelet(
    client: PluginClient,
    options: PluginOptions,
    devices: DeviceList,
    request: int | Sequence[str],
) -> AllocationReport:
    """Allocate for one container as the kubelet would, or with explicit IDs.

    For a count: candidates are the healthy devices; GetPreferredAllocation is asked when
    advertised, its valid IDs are taken first and the rest filled in list order (the kubelet
    fills in random order). Explicit IDs go to Allocate as they are.

    Raises:
        ProtocolViolation: fewer healthy devices than requested (the kubelet's admission error).
        PluginRpcError: an RPC failed.
    """
    preferred: tuple[str, ...] | None = None
    if isinstance(request, int):
        if request < 1:
            raise ValueError(f"allocation size must be >= 1, got {request}")
        available = list(dict.fromkeys(d.id for d in devices.healthy))
        if len(available) < request:
            # The kubelet's admission message for this case.
            raise ProtocolViolation(
                "requested number of devices unavailable. "
                f"Requested: {request}, Available: {len(available)}"
            )
        chosen: list[str] = []
        if options.preferred_allocation:
            answer = await client.preferred_allocation(available, [], request)
            preferred = () if answer is None else answer
            # Only IDs among the candidates count; extra IDs are dropped.
            candidates = set(available)
            chosen = [i for i in dict.fromkeys(preferred) if i in candidates][:request]
        for device_id in available:
            if len(chosen) >= request:
                break
            if device_id not in chosen:
                chosen.append(device_id)
        ids = tuple(chosen)
        requested: int | tuple[str, ...] = request
    else:
        ids = tuple(request)
        requested = ids
    responses = await client.allocate(ids)
    if not responses:
        # The kubelet's admission error for an empty answer.
        raise ProtocolViolation("Allocate answered no container response")
    return AllocationReport(requested, preferred, ids, responses[0], len(responses))


async def probe(
    client: PluginClient, *, allocate: int | Sequence[str] | None = None
) -> ProbeReport:
    """Ask a connected plugin what the kubelet would ask: options, first list, an allocation.

    Args:
        client: A connected client.
        allocate: A device count, explicit device IDs, or None for no allocation.

    Raises:
        ProbeError: the plugin failed one of the calls, or is not a device plugin.
    """
    started = time.perf_counter()
    options = await client.options()
    options_seconds = time.perf_counter() - started
    stream = client.list_and_watch()
    try:
        try:
            devices = await stream.next(timeout=client.rpc_timeout)
        except TimeoutError:
            raise ProtocolViolation(
                f"no ListAndWatch message within {client.rpc_timeout:g} s; the kubelet sees no "
                "devices (capacity 0) until the plugin sends its first list"
            ) from None
        list_seconds = time.perf_counter() - stream.opened_at
    finally:
        stream.cancel()
    notes: list[str] = []
    if options.pre_start_required:
        notes.append("PreStartContainer is required (the kubelet calls it before every start)")
    allocation = None
    if allocate is not None:
        allocation = await allocate_like_kubelet(client, options, devices, allocate)
        if options.pre_start_required:
            notes.append("probe does not call PreStartContainer")
    return ProbeReport(
        socket=str(client.path),
        connect_seconds=client.connect_seconds,
        options=options,
        options_seconds=options_seconds,
        devices=devices,
        list_seconds=list_seconds,
        allocation=allocation,
        notes=tuple(notes),
    )


async def watch(
    client: PluginClient, since: DeviceList | None = None
) -> AsyncIterator[tuple[DeviceList, list[DeviceChange]]]:
    """Follow ListAndWatch, yielding each message that changes the device set.

    Args:
        client: A connected client.
        since: The list already shown; the stream's first message is yielded only if it differs.

    Yields:
        The new list and its changes from the previous one.

    Raises:
        ProbeError: the stream ended (the kubelet would drop the plugin) or failed.
    """
    stream = client.list_and_watch()
    previous = since
    try:
        async for devices in stream:
            changes = [] if previous is None else diff_devices(previous, devices)
            if previous is None or changes:
                yield devices, changes
            previous = devices
    finally:
        stream.cancel()
