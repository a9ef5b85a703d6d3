"""``PluginClient``: a connection to one plugin socket, dialled and called the way the kubelet's
device manager does (insecure gRPC, 10 s dial, 4 MiB receive limit), and its ``ListStream``."""

from __future__ import annotations

import errno
import os
import stat
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from types import TracebackType

import anyio
import grpc

from devplugin_sdk._wire import client as _client
from devplugin_sdk.api import constants
from devplugin_sdk.kubelet.probe._errors import (
    NotADevicePluginError,
    NotAnsweringError,
    PluginRpcError,
    ProbeError,
    ProtocolViolation,
    SocketMissingError,
)
from devplugin_sdk.kubelet.probe._lists import DeviceList, PluginOptions
from devplugin_sdk.types import Allocation

__all__ = ["ListStream", "PluginClient"]


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
            PluginRpcError: the stream ended with an error status, or sent a message that is not
                a ListAndWatchResponse (INTERNAL).
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
        try:
            return _device_list(payload)
        except grpc.aio.AioRpcError as exc:  # not a ListAndWatchResponse
            self._call.cancel()  # as grpc-go cancels the kubelet's stream
            raise _stream_error(exc) from None

    def __aiter__(self) -> AsyncIterator[DeviceList]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[DeviceList]:
        while True:
            yield await self.next()


def _device_list(payload: bytes) -> DeviceList:
    return DeviceList(
        devices=_client.decode_listed_devices(payload),
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
