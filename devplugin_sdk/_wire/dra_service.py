"""The kubelet's DRA gRPC service (``DRAPlugin``, v1 and v1beta1), served on ``dra.sock``.

Both versions call the same two coroutines, so a kubelet of 1.32 and one of 1.34 get the same
behaviour. A claim's failure is its own response entry; only a request that cannot be read at
all fails the whole call (the kubelet then retries the pod). The kubelet's side, ``DraClient``,
is here too, for FakeKubelet and ``devplugin conformance --dra``.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import grpc

from devplugin_sdk._wire import dra_convert
from devplugin_sdk._wire.client import Unary
from devplugin_sdk._wire.dra_model import ClaimRef, PreparedClaim
from devplugin_sdk._wire.server import unary

__all__ = ["DraClient", "handlers", "method_path"]

log = logging.getLogger("devplugin_sdk")

Prepare = Callable[[Sequence[ClaimRef]], Awaitable[dict[str, PreparedClaim]]]
Unprepare = Callable[[Sequence[ClaimRef]], Awaitable[dict[str, str]]]


def method_path(service: str, method: str) -> str:
    """``/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources`` for ``v1.DRAPlugin``."""
    pb = dra_convert.VERSIONS[service]
    return f"/{pb.DESCRIPTOR.package}.DRAPlugin/{method}"


def handlers(
    prepare: Prepare, unprepare: Unprepare, services: Sequence[str]
) -> list[grpc.GenericRpcHandler]:
    """Generic handlers of the ``DRAPlugin`` service of each version in ``services``."""
    out = []
    for service in services:
        pb = dra_convert.VERSIONS[service]

        def make(pb: Any = pb) -> dict[str, grpc.RpcMethodHandler[Any, Any]]:
            async def node_prepare(
                request: Any, context: grpc.aio.ServicerContext[Any, Any]
            ) -> Any:
                return dra_convert.prepare_response(pb, await prepare(dra_convert.claims(request)))

            async def node_unprepare(
                request: Any, context: grpc.aio.ServicerContext[Any, Any]
            ) -> Any:
                return dra_convert.unprepare_response(
                    pb, await unprepare(dra_convert.claims(request))
                )

            return {
                "NodePrepareResources": unary(
                    node_prepare, pb.NodePrepareResourcesRequest, pb.NodePrepareResourcesResponse
                ),
                "NodeUnprepareResources": unary(
                    node_unprepare,
                    pb.NodeUnprepareResourcesRequest,
                    pb.NodeUnprepareResourcesResponse,
                ),
            }

        out.append(
            grpc.method_handlers_generic_handler(f"{pb.DESCRIPTOR.package}.DRAPlugin", make())
        )
    return out


class DraClient:
    """The kubelet's end of a ``DRAPlugin`` connection, in SDK types.

    Args:
        channel: A channel to the plugin's ``dra.sock``.
        service: The service to call, ``v1.DRAPlugin`` or ``v1beta1.DRAPlugin`` (what the
            kubelet chose from the plugin's list).

    Errors are grpc.aio's own (``grpc.aio.AioRpcError``); an answer that does not parse is an
    INTERNAL one.
    """

    def __init__(self, channel: grpc.aio.Channel, service: str) -> None:
        self.service = service
        pb = dra_convert.VERSIONS[service]
        self._pb = pb
        # An answer that is not the response message is an INTERNAL error (``Unary``).
        self._prepare = Unary[Any, Any](
            channel, method_path(service, "NodePrepareResources"), pb.NodePrepareResourcesResponse
        )
        self._unprepare = Unary[Any, Any](
            channel,
            method_path(service, "NodeUnprepareResources"),
            pb.NodeUnprepareResourcesResponse,
        )

    async def prepare(self, claims: Sequence[ClaimRef], timeout: float) -> dict[str, PreparedClaim]:
        """NodePrepareResources: the per-claim results by UID."""
        response = await self._prepare(
            dra_convert.prepare_request(self._pb, claims), timeout=timeout
        )
        return dra_convert.prepared(response)

    async def unprepare(self, claims: Sequence[ClaimRef], timeout: float) -> dict[str, str]:
        """NodeUnprepareResources: the per-claim errors by UID (empty: done)."""
        response = await self._unprepare(
            dra_convert.unprepare_request(self._pb, claims), timeout=timeout
        )
        return dra_convert.unprepared(response)
