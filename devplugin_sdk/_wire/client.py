"""The kubelet's end of a v1beta1.DevicePlugin connection, spoken in SDK types.

FakeKubelet, ``probe`` and ``conformance`` call plugins through ``DevicePluginClient``; ``convert``
builds and reads the messages, so none of them sees protobuf. Errors stay grpc.aio's own
(``grpc.aio.AioRpcError`` with the plugin's status): each caller tells its own story about them.
``ready`` and ``state_change`` bound a dial without leaving gRPC work behind the event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from typing import Generic, TypeVar

import anyio
import grpc

from devplugin_sdk._wire import convert
from devplugin_sdk.api.deviceplugin.v1beta1 import deviceplugin_pb2 as pb
from devplugin_sdk.api.deviceplugin.v1beta1 import deviceplugin_pb2_grpc as pb_grpc
from devplugin_sdk.types import Allocation

__all__ = ["DevicePluginClient", "ListedDevice", "PluginOptions", "Stream", "ready", "state_change"]

T = TypeVar("T")

ListedDevice = convert.ListedDevice
PluginOptions = convert.PluginOptions

_LIST_AND_WATCH = "/v1beta1.DevicePlugin/ListAndWatch"


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
            grpc.aio.AioRpcError: the stream ended with an error status.
        """
        payload = await self._call.read()
        if payload is grpc.aio.EOF:
            return None
        assert isinstance(payload, bytes)
        return self._decode(payload)

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
        self._stub: pb_grpc.DevicePluginAsyncStub = pb_grpc.DevicePluginStub(channel)
        # ListAndWatch as raw bytes: decoded here, or handed over as they are (message sizes).
        self._list_and_watch: grpc.aio.UnaryStreamMultiCallable[pb.Empty, bytes]
        self._list_and_watch = channel.unary_stream(
            _LIST_AND_WATCH,
            request_serializer=pb.Empty.SerializeToString,
            response_deserializer=None,
        )

    async def options(self, *, timeout: float | None = None) -> PluginOptions:
        """Call GetDevicePluginOptions."""
        answer = await self._stub.GetDevicePluginOptions(pb.Empty(), timeout=timeout)
        return convert.plugin_options(answer)

    def list_and_watch(self) -> Stream[tuple[ListedDevice, ...]]:
        """Open ListAndWatch (no deadline); each message is the plugin's whole device list."""
        return Stream(self._list_and_watch(pb.Empty()), convert.decode_listed_devices)

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
        answer = await self._stub.GetPreferredAllocation(
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
        answer = await self._stub.Allocate(convert.allocate_request(containers), timeout=timeout)
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
        answer = await self._stub.Allocate(convert.allocate_request([device_ids]), timeout=timeout)
        if not answer.container_responses:
            return None
        return convert.allocation_from_response(answer.container_responses[0])

    async def pre_start_container(
        self, device_ids: Iterable[str], *, timeout: float | None = None
    ) -> None:
        """Call PreStartContainer for one container's devices."""
        await self._stub.PreStartContainer(convert.pre_start_request(device_ids), timeout=timeout)
