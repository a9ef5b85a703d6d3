"""The gRPC side of the v1beta1 DevicePlugin service: its handler table, requests that do not
parse, and SDK errors as gRPC statuses.

Handlers are registered as generic handlers so that ListAndWatch and Allocate can send
pre-encoded bytes without re-serialising. This is the one place where SDK errors become status
codes (the table in docs/concepts.md, "Allocation"), and where a refused call is logged. The
servicer (``_servicer``), which holds what the RPCs do, is the only user.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, NoReturn, TypeVar

import grpc
from google.protobuf.message import DecodeError

from devplugin_sdk._logging import printable
from devplugin_sdk._wire.server import unary
from devplugin_sdk.api.deviceplugin.v1beta1 import deviceplugin_pb2 as pb
from devplugin_sdk.errors import AllocationError, BackendError, UnknownDeviceError

log = logging.getLogger("devplugin_sdk")

M = TypeVar("M")

SERVICE = "v1beta1.DevicePlugin"

Unary = Callable[[Any, "grpc.aio.ServicerContext[Any, Any]"], Awaitable[Any]]


def handler(
    *,
    get_options: Unary,
    list_and_watch: Callable[[Any, grpc.aio.ServicerContext[Any, Any]], AsyncIterator[bytes]],
    get_preferred_allocation: Unary,
    allocate: Unary,
    pre_start_container: Unary,
) -> grpc.GenericRpcHandler:
    """The service's handler table; ListAndWatch and Allocate answer with encoded bytes."""
    return grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "GetDevicePluginOptions": unary(get_options, pb.Empty, pb.DevicePluginOptions),
            "ListAndWatch": grpc.unary_stream_rpc_method_handler(
                list_and_watch,
                request_deserializer=pb.Empty.FromString,
                response_serializer=_identity,
            ),
            "GetPreferredAllocation": grpc.unary_unary_rpc_method_handler(
                get_preferred_allocation,
                request_deserializer=lenient(pb.PreferredAllocationRequest),
                response_serializer=pb.PreferredAllocationResponse.SerializeToString,
            ),
            "Allocate": grpc.unary_unary_rpc_method_handler(
                allocate,
                request_deserializer=lenient(pb.AllocateRequest),
                response_serializer=_identity,
            ),
            "PreStartContainer": grpc.unary_unary_rpc_method_handler(
                pre_start_container,
                request_deserializer=lenient(pb.PreStartContainerRequest),
                response_serializer=pb.PreStartContainerResponse.SerializeToString,
            ),
        },
    )


def _identity(payload: bytes) -> bytes:
    return payload


class RequestError(Exception):
    """A malformed request: answered with INVALID_ARGUMENT."""


class Malformed:
    """Stands in for a request whose bytes did not parse (answered INVALID_ARGUMENT)."""

    def __init__(self, error: Exception) -> None:
        self.error = error


def parsed(request: M | Malformed, rpc: str) -> M:
    """The request, or INVALID_ARGUMENT when its bytes did not parse."""
    if isinstance(request, Malformed):
        raise RequestError(f"{rpc}: the request is not a valid protobuf message: {request.error}")
    return request


def lenient(message: Any) -> Callable[[bytes], Any]:
    """A deserializer that turns undecodable bytes into ``Malformed`` instead of raising
    (grpcio would answer UNKNOWN)."""

    def parse(data: bytes) -> Any:
        try:
            return message.FromString(data)
        except DecodeError as exc:
            return Malformed(exc)

    return parse


def status_for(exc: BaseException) -> grpc.StatusCode:
    """The gRPC status code for an exception raised while serving a request."""
    if isinstance(exc, (UnknownDeviceError, RequestError)):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(exc, AllocationError):
        return grpc.StatusCode.FAILED_PRECONDITION
    if isinstance(exc, TimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED
    if isinstance(exc, BackendError):
        return grpc.StatusCode.UNAVAILABLE
    return grpc.StatusCode.INTERNAL


async def refuse(
    rpc: str,
    context: grpc.aio.ServicerContext[Any, Any],
    exc: Exception,
    code: grpc.StatusCode,
    *,
    resource: str,
    on_refused: Callable[[str, str, str], None],
) -> NoReturn:
    """Log why a call failed and end it with ``code`` and the error's message.

    ``on_refused(resource, rpc, code name)`` reports the refusal (the plugin's events).
    """
    # Errors quote the request (unknown or repeated device IDs): no raw control
    # characters from a peer reach the log or the kubelet's events.
    message = printable(str(exc) or type(exc).__name__)
    if code is grpc.StatusCode.INTERNAL:
        message = f"{resource}: {type(exc).__name__}: {message}"
        log.error("%s: %s failed", resource, rpc, exc_info=exc, extra={"resource": resource})
    else:
        log.warning("%s: %s refused: %s", resource, rpc, message, extra={"resource": resource})
    if rpc != "Allocate":  # Allocate's outcome is reported with its duration
        on_refused(resource, rpc, code.name)
    await context.abort(code, message)
    raise AssertionError("unreachable")  # pragma: no cover - abort raises
