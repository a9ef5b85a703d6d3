"""The kubelet's end of a v1beta1.DevicePlugin connection, spoken in SDK types.

FakeKubelet, ``probe`` and ``conformance`` call plugins through ``DevicePluginClient``; ``convert``
builds and reads the messages, so none of them sees protobuf. Errors stay grpc.aio's own
(``grpc.aio.AioRpcError`` with the plugin's status): each caller tells its own story about them;
an answer that is not the protobuf message expected is one too, INTERNAL (``Unary``), as grpc-go
makes it for the kubelet. ``ready`` and ``state_change`` bound a dial without leaving gRPC work
behind the event loop; ``call`` tells a call cancelled under us from our own cancellation.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from typing import Any, Generic, TypeVar

import anyio
import grpc
from google.protobuf.message import DecodeError, Message

from devplugin_sdk._wire import convert
from devplugin_sdk.api.deviceplugin.v1beta1 import deviceplugin_pb2 as pb
from devplugin_sdk.types import Allocation

__all__ = [
    "DevicePluginClient",
    "ListedDevice",
    "PluginOptions",
    "Stream",
    "Unary",
    "call",
    "decode_listed_devices",
    "ready",
    "state_change",
    "undecodable",
]

T = TypeVar("T")
Req = TypeVar("Req", bound=Message)
Resp = TypeVar("Resp", bound=Message)

ListedDevice = convert.ListedDevice
PluginOptions = convert.PluginOptions

_SERVICE = "/v1beta1.DevicePlugin"
_LIST_AND_WATCH = f"{_SERVICE}/ListAndWatch"


async def state_change(
    channel: grpc.aio.Channel, state: grpc.ChannelConnectivity, timeout: float
) -> bool:
    """Wait up to ``timeout`` seconds for ``channel`` to leave ``state``.

    grpc.aio leaves a cancelled connectivity watch registered in gRPC core, which completes it
    later, possibly once this event loop is closed (another loop's poller then fails with
    "Event loop is closed"). So when the wait times out or is cancelled, the channel is closed,
    which completes the watch at once, and the watch is let finish here.

    Returns:
        True once the state changed; False after ``timeout``, with the channel closed.
    """
    watch = asyncio.ensure_future(channel.wait_for_state_change(state))
    try:
        with anyio.move_on_after(timeout):
            await asyncio.shield(watch)
            return True
        return False
    finally:
        if not watch.done():
            with anyio.CancelScope(shield=True):
                await channel.close()
                with anyio.move_on_after(1.0):
                    await asyncio.wait([watch])


async def ready(channel: grpc.aio.Channel, timeout: float) -> bool:
    """Connect ``channel`` and wait up to ``timeout`` seconds for it to be READY.

    Returns:
        True when READY; False after ``timeout``, with the channel closed (see
        ``state_change``).
    """
    deadline = anyio.current_time() + timeout
    state = channel.get_state(try_to_connect=True)
    while state is not grpc.ChannelConnectivity.READY:
        if not await state_change(channel, state, deadline - anyio.current_time()):
            return False
        state = channel.get_state(try_to_connect=True)
    return True


async def call(awaitable: Awaitable[T]) -> T:
    """Await a gRPC call so that cancellation means what it says, either way.

    A unary grpc.aio call runs in a task of its own and re-raises its cancellation as a bare
    asyncio.CancelledError: an anyio cancel scope around the caller then does not recognise it
    as its own and lets it escape (in a task group, the group cancels itself and then swallows
    it). And a call cancelled under us (its channel closed) raises that same bare error without
    anyone cancelling the caller. So the call is awaited through a shield: our cancellation
    cancels the call and is re-raised as it came; the call's own, and a call on a channel
    already closed (grpc.aio's UsageError), is a CANCELLED ``grpc.aio.AioRpcError``.
    """
    inner = asyncio.ensure_future(awaitable)
    try:
        return await asyncio.shield(inner)
    except grpc.aio.UsageError:  # "Channel is closed": closed before the call began
        raise _cancelled("the client connection is closed") from None
    except asyncio.CancelledError:
        if not inner.done():  # we are cancelled: so is the call
            inner.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.wait([inner])
            raise
        task = asyncio.current_task()
        cancelling = getattr(task, "cancelling", None)
        if cancelling is not None:
            ours = cancelling() > 0
        else:  # Python 3.10: an anyio cancellation shows as a cancelled enclosing scope
            ours = anyio.current_effective_deadline() == -math.inf
        if ours:
            raise
        raise _cancelled("the call to the plugin was cancelled") from None


def _cancelled(details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(
        grpc.StatusCode.CANCELLED, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details
    )


def undecodable(message: str, size: int) -> grpc.aio.AioRpcError:
    """The error of an answer whose bytes are not the ``message`` expected (INTERNAL, as grpc-go
    reports a message it cannot unmarshal)."""
    return grpc.aio.AioRpcError(
        grpc.StatusCode.INTERNAL,
        grpc.aio.Metadata(),
        grpc.aio.Metadata(),
        details=f"the plugin's answer is not a valid {message} message "
        f"({size} bytes that do not parse as one)",
    )


def decode_listed_devices(payload: bytes) -> tuple[ListedDevice, ...]:
    """``convert.decode_listed_devices``, with ``undecodable``'s error for bytes that do not parse.

    Raises:
        grpc.aio.AioRpcError: INTERNAL, ``payload`` is not a ListAndWatchResponse.
    """
    try:
        return convert.decode_listed_devices(payload)
    except DecodeError:
        raise undecodable("ListAndWatchResponse", len(payload)) from None


class _Undecodable:
    """What the deserializer hands over for bytes that do not parse: grpcio would log a
    traceback for an exception and hand the caller None."""

    def __init__(self, size: int) -> None:
        self.size = size


def _lenient(message: type[Resp]) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Resp | _Undecodable:
        try:
            return message.FromString(data)
        except DecodeError:
            return _Undecodable(len(data))

    return parse


class Unary(Generic[Req, Resp]):
    """One unary method of a service, called the kubelet's way: an answer that is not a
    ``response`` message raises ``undecodable``'s INTERNAL error, never a traceback.

    Args:
        channel: The channel to call over.
        method: The method's full path, ``/v1beta1.DevicePlugin/Allocate``.
        response: The answer's message type.
    """

    def __init__(self, channel: grpc.aio.Channel, method: str, response: type[Resp]) -> None:
        self._name = response.DESCRIPTOR.name
        self._call: grpc.aio.UnaryUnaryMultiCallable[Req, Any] = channel.unary_unary(
            method,
            request_serializer=_serialize,
            response_deserializer=_lenient(response),
        )

    async def __call__(self, request: Req, *, timeout: float | None = None) -> Resp:
        answer = await self._call(request, timeout=timeout)
        if isinstance(answer, _Undecodable):
            raise undecodable(self._name, answer.size)
        return answer  # type: ignore[no-any-return]


def _serialize(message: Message) -> bytes:
    return message.SerializeToString()


class Stream(Generic[T]):
    """An open ListAndWatch call; each message is decoded with ``decode`` as it is read.

    Reading and iterating end the same way: ``None`` (or the end of iteration) when the plugin
    ends the stream cleanly, ``grpc.aio.AioRpcError`` when it ends with an error status.
    """

    def __init__(
        self, call: grpc.aio.UnaryStreamCall[pb.Empty, bytes], decode: Callable[[bytes], T]
    ) -> None:
        self._call = call
        self._decode = decode

    def done(self) -> bool:
        """Whether the call has finished (by the plugin, an error or ``cancel``)."""
        return self._call.done()

    def cancelled(self) -> bool:
        """Whether the call was cancelled from this side."""
        return self._call.cancelled()

    def cancel(self) -> None:
        """Close the stream from the client side (the plugin sees its context cancelled)."""
        self._call.cancel()

    async def read(self) -> T | None:
        """The next message, or None once the plugin has ended the stream cleanly.

        Raises:
            grpc.aio.AioRpcError: the stream ended with an error status, or sent a message that
                is not a ListAndWatchResponse (INTERNAL; the stream is cancelled, as grpc-go
                cancels it for the kubelet).
        """
        payload = await self._call.read()
        if payload is grpc.aio.EOF:
            return None
        assert isinstance(payload, bytes)
        try:
            return self._decode(payload)
        except grpc.aio.AioRpcError:
            self._call.cancel()
            raise

    def __aiter__(self) -> AsyncIterator[T]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[T]:
        while (message := await self.read()) is not None:
            yield message


def _raw(payload: bytes) -> bytes:
    return payload


class DevicePluginClient:
    """Calls a plugin's v1beta1.DevicePlugin service over ``channel`` (which the caller owns).

    Every call takes an optional deadline; ``None`` means none, as the kubelet sets none but
    PreStartContainer's.

    Args:
        channel: A grpc.aio channel to the plugin's socket.
    """

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.channel = channel
        self._options = Unary[pb.Empty, pb.DevicePluginOptions](
            channel, f"{_SERVICE}/GetDevicePluginOptions", pb.DevicePluginOptions
        )
        self._preferred = Unary[pb.PreferredAllocationRequest, pb.PreferredAllocationResponse](
            channel, f"{_SERVICE}/GetPreferredAllocation", pb.PreferredAllocationResponse
        )
        self._allocate = Unary[pb.AllocateRequest, pb.AllocateResponse](
            channel, f"{_SERVICE}/Allocate", pb.AllocateResponse
        )
        self._pre_start = Unary[pb.PreStartContainerRequest, pb.PreStartContainerResponse](
            channel, f"{_SERVICE}/PreStartContainer", pb.PreStartContainerResponse
        )
        # ListAndWatch as raw bytes: decoded here, or handed over as they are (message sizes).
        self._list_and_watch: grpc.aio.UnaryStreamMultiCallable[pb.Empty, bytes]
        self._list_and_watch = channel.unary_stream(
            _LIST_AND_WATCH,
            request_serializer=pb.Empty.SerializeToString,
            response_deserializer=None,
        )

    async def options(self, *, timeout: float | None = None) -> PluginOptions:
        """Call GetDevicePluginOptions."""
        answer = await self._options(pb.Empty(), timeout=timeout)
        return convert.plugin_options(answer)

    def list_and_watch(self) -> Stream[tuple[ListedDevice, ...]]:
        """Open ListAndWatch (no deadline); each message is the plugin's whole device list."""
        return Stream(self._list_and_watch(pb.Empty()), decode_listed_devices)

    def list_and_watch_raw(self) -> Stream[bytes]:
        """Open ListAndWatch, reading each message as its encoded bytes.

        ``convert.decode_listed_devices`` decodes one; its length is the message's size.
        """
        return Stream(self._list_and_watch(pb.Empty()), _raw)

    async def preferred_allocation(
        self,
        available: Iterable[str],
        must_include: Iterable[str],
        size: int,
        *,
        timeout: float | None = None,
    ) -> tuple[str, ...] | None:
        """Call GetPreferredAllocation for one container.

        Returns:
            The IDs of the first container response (the only one the kubelet reads), or None
            when the answer has none.
        """
        answer = await self._preferred(
            convert.preferred_request(available, must_include, size), timeout=timeout
        )
        return convert.first_preferred(answer)

    async def allocate(
        self, *containers: Sequence[str], timeout: float | None = None
    ) -> list[Allocation]:
        """Call Allocate with one container request per argument.

        Returns:
            One ``Allocation`` per container response, as many as the plugin sent.

        Raises:
            grpc.aio.AioRpcError: the plugin's error status.
            ValueError: a container response no ``Allocation`` can hold (an empty host path).
        """
        answer = await self._allocate(convert.allocate_request(containers), timeout=timeout)
        return [convert.allocation_from_response(r) for r in answer.container_responses]

    async def allocate_first(
        self, device_ids: Sequence[str], *, timeout: float | None = None
    ) -> Allocation | None:
        """Call Allocate for one container and read only the first response, as the kubelet does.

        Returns:
            The first container response, or None when the plugin sent none.

        Raises:
            grpc.aio.AioRpcError: the plugin's error status.
            ValueError: a first response no ``Allocation`` can hold.
        """
        answer = await self._allocate(convert.allocate_request([device_ids]), timeout=timeout)
        if not answer.container_responses:
            return None
        return convert.allocation_from_response(answer.container_responses[0])

    async def pre_start_container(
        self, device_ids: Iterable[str], *, timeout: float | None = None
    ) -> None:
        """Call PreStartContainer for one container's devices."""
        await self._pre_start(convert.pre_start_request(device_ids), timeout=timeout)
