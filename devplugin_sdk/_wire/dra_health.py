"""The kubelet's DRA health stream (``DRAResourceHealth``, v1 and v1alpha1), served on ``dra.sock``.

Both versions have the same messages under different packages and stream what the same async
iterator yields, each message the health of every device. The kubelet's side,
``DraHealthClient``, is here too, for FakeKubelet; neither side shows protobuf to its caller.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from types import ModuleType
from typing import Any

import grpc

from devplugin_sdk._wire.client import call
from devplugin_sdk._wire.dra_model import DeviceHealthStatus
from devplugin_sdk.api import constants
from devplugin_sdk.api.dra_health.v1 import dra_health_pb2 as v1
from devplugin_sdk.api.dra_health.v1alpha1 import dra_health_pb2 as v1alpha1

__all__ = ["VERSIONS", "DraHealthClient", "handlers"]

#: The generated module of each version, by the service name the plugin advertises.
VERSIONS: Mapping[str, ModuleType] = {
    constants.DRA_HEALTH_SERVICE_V1: v1,
    constants.DRA_HEALTH_SERVICE_V1ALPHA1: v1alpha1,
}

#: What the service streams: every device's health, once per message.
Watch = Callable[[], AsyncIterator[Sequence[DeviceHealthStatus]]]


def handlers(watch: Watch, services: Sequence[str]) -> list[grpc.GenericRpcHandler]:
    """Generic handlers of the ``DRAResourceHealth`` service of each version in ``services``;
    each stream the kubelet opens iterates a new ``watch()``."""
    out = []
    for service in services:
        pb = VERSIONS[service]

        def make(pb: ModuleType = pb) -> grpc.RpcMethodHandler[Any, Any]:
            async def node_watch_resources(
                request: Any, context: grpc.aio.ServicerContext[Any, Any]
            ) -> AsyncIterator[Any]:
                updates = watch()
                try:
                    async for statuses in updates:
                        yield _response(pb, statuses)
                finally:
                    aclose = getattr(updates, "aclose", None)
                    if aclose is not None:
                        await aclose()

            return grpc.unary_stream_rpc_method_handler(
                node_watch_resources,
                request_deserializer=pb.NodeWatchResourcesRequest.FromString,
                response_serializer=pb.NodeWatchResourcesResponse.SerializeToString,
            )

        out.append(
            grpc.method_handlers_generic_handler(
                f"{pb.DESCRIPTOR.package}.DRAResourceHealth", {"NodeWatchResources": make()}
            )
        )
    return out


def _response(pb: ModuleType, statuses: Sequence[DeviceHealthStatus]) -> Any:
    response = pb.NodeWatchResourcesResponse()
    for status in statuses:
        entry = response.devices.add()
        entry.device.pool_name = status.pool
        entry.device.device_name = status.device
        entry.health = pb.HealthStatus.Value(status.health)
        entry.last_updated_time = status.updated
        entry.health_check_timeout_seconds = status.timeout_seconds
        entry.message = status.message
    return response


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
