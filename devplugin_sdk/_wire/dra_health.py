"""The kubelet's DRA health stream (``DRAResourceHealth``, v1 and v1alpha1), served on ``dra.sock``.

Both versions have the same messages, field for field (tests/api), under different packages, so
their bytes are the same: a device's entry is encoded once (``encode_device``), entries are
packed into messages under the kubelet's size limit (``pack``), and every stream of either
version writes those bytes as they are. The kubelet's side, ``DraHealthClient``, is here too, for
FakeKubelet; neither side shows protobuf to its caller.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from types import ModuleType
from typing import Any

import anyio
import grpc

from devplugin_sdk._wire.client import call
from devplugin_sdk._wire.dra_model import DeviceHealthStatus
from devplugin_sdk.api import constants
from devplugin_sdk.api.dra_health.v1 import dra_health_pb2 as v1
from devplugin_sdk.api.dra_health.v1alpha1 import dra_health_pb2 as v1alpha1

__all__ = ["MESSAGE_LIMIT", "VERSIONS", "DraHealthClient", "encode_device", "handlers", "pack"]

log = logging.getLogger("devplugin_sdk")
_SAY_AGAIN_AFTER = 60.0

#: The generated module of each version, by the service name the plugin advertises.
VERSIONS: Mapping[str, ModuleType] = {
    constants.DRA_HEALTH_SERVICE_V1: v1,
    constants.DRA_HEALTH_SERVICE_V1ALPHA1: v1alpha1,
}

#: The most bytes one message of ours holds. The kubelet reads at most 4 MiB a message: grpc-go's
#: default (defaultClientMaxReceiveMessageSize, clientconn.go), which the kubelet keeps (its
#: grpc.NewClient in pkg/kubelet/cm/dra/plugin/dra_plugin_manager.go sets no MaxCallRecvMsgSize).
#: A quarter of it leaves room, and keeps what a client that does not read holds us to small.
MESSAGE_LIMIT = 1 << 20

#: What the service streams: the whole state, as messages already encoded (``pack``); every
#: message of one state before any of the next.
Watch = Callable[[], AsyncIterator[Sequence[bytes]]]


def encode_device(status: DeviceHealthStatus) -> bytes:
    """One device's entry: a ``NodeWatchResourcesResponse`` holding it alone. Protobuf appends
    repeated fields of concatenated messages, so entries joined are one message of them all."""
    entry = v1.DeviceHealth(
        device=v1.DeviceIdentifier(pool_name=status.pool, device_name=status.device),
        health=v1.HealthStatus.Value(status.health),
        last_updated_time=status.updated,
        health_check_timeout_seconds=status.timeout_seconds,
        message=status.message,
    )
    return v1.NodeWatchResourcesResponse(devices=[entry]).SerializeToString()


def pack(entries: Iterable[bytes], limit: int = MESSAGE_LIMIT) -> tuple[bytes, ...]:
    """``entries`` (``encode_device``) joined into as few messages as keep each within
    ``limit`` bytes; one empty message when there are none (the state: no device)."""
    messages: list[bytes] = []
    group: list[bytes] = []
    size = 0
    for entry in entries:
        if group and size + len(entry) > limit:
            messages.append(b"".join(group))
            group, size = [], 0
        group.append(entry)
        size += len(entry)
    if group or not messages:
        messages.append(b"".join(group))
    return tuple(messages)


def handlers(watch: Watch, services: Sequence[str], stall: float) -> list[grpc.GenericRpcHandler]:
    """Generic handlers of the ``DRAResourceHealth`` service of each version in ``services``;
    each stream the kubelet opens writes what a new ``watch()`` yields. A client that takes no
    message for ``stall`` seconds has its stream ended (``RESOURCE_EXHAUSTED``): it holds one
    message at most meanwhile, and the kubelet opens a failed stream again and gets the whole
    state."""
    out = []
    drops = _Drops()
    for service in services:
        pb = VERSIONS[service]

        async def node_watch_resources(
            request: Any, context: grpc.aio.ServicerContext[Any, Any]
        ) -> None:
            updates = watch()
            try:
                await _write(updates, context, stall)
            finally:
                aclose = getattr(updates, "aclose", None)
                if aclose is not None:
                    await aclose()
            drops.dropped(stall)
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED, f"no message taken for {stall:g} s"
            )

        out.append(
            grpc.method_handlers_generic_handler(
                f"{pb.DESCRIPTOR.package}.DRAResourceHealth",
                {
                    "NodeWatchResources": grpc.unary_stream_rpc_method_handler(
                        node_watch_resources,
                        request_deserializer=pb.NodeWatchResourcesRequest.FromString,
                    )
                },
            )
        )
    return out


class _Drops:
    """Says that streams were ended for a client that took nothing: once, then at most once a
    minute with how many more (many clients that never read make one line, not one each)."""

    def __init__(self) -> None:
        self.said = -_SAY_AGAIN_AFTER
        self.unsaid = 0

    def dropped(self, stall: float) -> None:
        self.unsaid += 1
        now = time.monotonic()
        if now - self.said < _SAY_AGAIN_AFTER:
            return
        log.warning(
            "DRA health stream: %d client(s) took no message for %gs; their streams are ended "
            "(opened again, they get the whole state)",
            self.unsaid,
            stall,
        )
        self.said, self.unsaid = now, 0


async def _write(
    updates: AsyncIterator[Sequence[bytes]],
    context: grpc.aio.ServicerContext[Any, Any],
    stall: float,
) -> None:
    """Write every message of ``updates`` (without end); return once a write waited ``stall``
    seconds for the client to take it."""
    async for messages in updates:
        for message in messages:
            with anyio.move_on_after(stall) as waited:
                await context.write(message)
            if waited.cancelled_caught:
                return


class DraHealthClient:
    """The kubelet's end of a ``DRAResourceHealth`` stream, in SDK types.

    Args:
        channel: A channel to the plugin's ``dra.sock``.
        service: ``v1.DRAResourceHealth`` or ``v1alpha1.DRAResourceHealth``.
    """

    def __init__(self, channel: grpc.aio.Channel, service: str) -> None:
        self.service = service
        pb = VERSIONS[service]
        self._pb = pb
        self._stream = channel.unary_stream(
            f"/{pb.DESCRIPTOR.package}.DRAResourceHealth/NodeWatchResources",
            request_serializer=pb.NodeWatchResourcesRequest.SerializeToString,
            response_deserializer=pb.NodeWatchResourcesResponse.FromString,
        )

    async def watch(self) -> AsyncIterator[list[DeviceHealthStatus]]:
        """NodeWatchResources: each message's devices, until the stream ends (its errors are
        grpc.aio's own; a stream cancelled under us, its channel closed, is a CANCELLED one,
        not a bare asyncio cancellation that would cancel the caller's task group)."""
        stream = self._stream(self._pb.NodeWatchResourcesRequest())
        try:
            while True:
                response: Any = await call(stream.read())
                if response is grpc.aio.EOF:
                    return
                yield [
                    DeviceHealthStatus(
                        d.device.pool_name,
                        d.device.device_name,
                        self._pb.HealthStatus.Name(d.health),
                        d.message,
                        d.health_check_timeout_seconds,
                        d.last_updated_time,
                    )
                    for d in response.devices
                ]
        finally:
            stream.cancel()
