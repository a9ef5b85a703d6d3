"""The v1beta1 DevicePlugin service on the wire: its handler table, which decodes each request into
plain values, calls what the engine's servicer does with them and encodes the answer; requests
that do not parse; and SDK errors as gRPC statuses.

Handlers are registered as generic handlers so that ListAndWatch and Allocate can send the
engine's pre-encoded bytes without re-serialising. This is the one place where SDK errors become
status codes (the table in docs/concepts.md, "Allocation"), and where a refused call is logged.
The servicer (``_engine.servicer``) is the only user.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, NoReturn, Protocol, TypeVar

import grpc
from google.protobuf.message import DecodeError, Message

from devplugin_sdk._logging import printable
from devplugin_sdk._wire import convert
from devplugin_sdk._wire.server import unary
from devplugin_sdk.api.deviceplugin.v1beta1 import deviceplugin_pb2 as pb
from devplugin_sdk.errors import AllocationError, BackendError, UnknownDeviceError

log = logging.getLogger("devplugin_sdk")

M = TypeVar("M")

SERVICE = "v1beta1.DevicePlugin"

Context = grpc.aio.ServicerContext[Any, Any]
Allocate = Callable[[Sequence[tuple[str, ...]]], Awaitable[bytes]]
"""Answers Allocate for each container's device IDs, in request order: the encoded reply."""
Prefer = Callable[[dict[str, None], dict[str, None], int], Awaitable[Sequence[str]]]
"""Answers GetPreferredAllocation for one container: (available, must_include, size) -> IDs.

Each list of IDs comes in order and without repeats, as a fresh dict's keys (the set of what may
be chosen, which a request for 81,920 memory units would otherwise build a second time)."""
PreStart = Callable[[tuple[str, ...]], Awaitable[None]]
"""Runs PreStartContainer for one container's device IDs."""


class Outcomes(Protocol):
    """Where the calls' outcomes are reported (the engine's event sink)."""

    def allocation(self, resource: str, seconds: float, error: str | None) -> None: ...

    def rpc_error(self, resource: str, rpc: str, code: str) -> None: ...


def handler(
    resource: str,
    *,
    pre_start_required: bool,
    preferred_allocation: bool,
    options_requested: Callable[[], None],
    list_and_watch: Callable[[], AsyncGenerator[bytes, None]],
    allocate: Allocate,
    prefer: Prefer,
    pre_start_container: PreStart,
    outcomes: Outcomes,
) -> grpc.GenericRpcHandler:
    """The service's handler table for one plugin.

    ``list_and_watch`` yields encoded ListAndWatchResponses and ``allocate`` answers with an
    encoded AllocateResponse; the other answers are encoded here. A call that raises is ended
    with ``status_for``'s code and the error's message, and reported to ``outcomes``.
    """
    options = convert.options(
        pre_start_required=pre_start_required, preferred_allocation=preferred_allocation
    )
    return _Calls(
        resource,
        options,
        options_requested,
        list_and_watch,
        allocate,
        prefer,
        pre_start_container,
        outcomes,
    ).handler()


@dataclass(frozen=True, slots=True)
class _Calls:
    """One plugin's calls, each as grpc.aio calls it: decode, ask the engine, encode."""

    resource: str
    options: pb.DevicePluginOptions
    options_requested: Callable[[], None]
    list_and_watch: Callable[[], AsyncGenerator[bytes, None]]
    allocate: Allocate
    prefer: Prefer
    pre_start_container: PreStart
    outcomes: Outcomes

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(
            SERVICE,
            {
                "GetDevicePluginOptions": unary(self.get_options, pb.Empty, pb.DevicePluginOptions),
                "ListAndWatch": grpc.unary_stream_rpc_method_handler(
                    self.watch,
                    request_deserializer=pb.Empty.FromString,
                    response_serializer=_identity,
                ),
                "GetPreferredAllocation": _lenient_unary(
                    self.preferred,
                    pb.PreferredAllocationRequest,
                    pb.PreferredAllocationResponse.SerializeToString,
                ),
                "Allocate": _lenient_unary(self.answer, pb.AllocateRequest, _identity),
                "PreStartContainer": _lenient_unary(
                    self.pre_start,
                    pb.PreStartContainerRequest,
                    pb.PreStartContainerResponse.SerializeToString,
                ),
            },
        )

    async def get_options(self, request: pb.Empty, context: Context) -> pb.DevicePluginOptions:
        # Called once, inside the kubelet's Register handler: it must be fast and never fail.
        self.options_requested()
        return self.options

    async def watch(self, request: pb.Empty, context: Context) -> AsyncIterator[bytes]:
        # Closed with this stream, so that the engine's generator ends when the kubelet's does.
        async with aclosing(self.list_and_watch()) as payloads:
            async for payload in payloads:
                yield payload

    async def answer(self, request: pb.AllocateRequest | Malformed, context: Context) -> bytes:
        started = time.perf_counter()
        code: grpc.StatusCode | None = None
        try:
            return await self.allocate(_containers(request))
        except Exception as exc:
            code = status_for(exc)
            await self._refuse("Allocate", context, exc, code)
        finally:
            error = None if code is None else code.name
            self.outcomes.allocation(self.resource, time.perf_counter() - started, error)

    async def preferred(
        self, request: pb.PreferredAllocationRequest | Malformed, context: Context
    ) -> pb.PreferredAllocationResponse:
        try:
            containers = parsed(request, "GetPreferredAllocation").container_requests
            return convert.preferred_response(
                [
                    await self.prefer(
                        dict.fromkeys(c.available_deviceIDs),
                        dict.fromkeys(c.must_include_deviceIDs),
                        c.allocation_size,
                    )
                    for c in containers
                ]
            )
        except Exception as exc:
            await self._refuse("GetPreferredAllocation", context, exc, status_for(exc))

    async def pre_start(
        self, request: pb.PreStartContainerRequest | Malformed, context: Context
    ) -> pb.PreStartContainerResponse:
        try:
            ids = tuple(parsed(request, "PreStartContainer").devices_ids)
            await self.pre_start_container(ids)
            return pb.PreStartContainerResponse()
        except Exception as exc:
            await self._refuse("PreStartContainer", context, exc, status_for(exc))

    async def _refuse(
        self, rpc: str, context: Context, exc: Exception, code: grpc.StatusCode
    ) -> NoReturn:
        await refuse(
            rpc, context, exc, code, resource=self.resource, on_refused=self.outcomes.rpc_error
        )


def _containers(request: pb.AllocateRequest | Malformed) -> list[tuple[str, ...]]:
    """Each container request's device IDs, in request order."""
    containers = parsed(request, "Allocate").container_requests
    if not containers:
        raise RequestError("AllocateRequest has no container requests")
    return [tuple(c.devices_ids) for c in containers]


def _lenient_unary(
    method: Callable[[Any, Context], Awaitable[Any]],
    request: type[Message],
    serialize: Callable[[Any], bytes],
) -> grpc.RpcMethodHandler[Any, Any]:
    """A unary call's handler whose requests may not parse (see ``lenient``)."""
    return grpc.unary_unary_rpc_method_handler(
        method, request_deserializer=lenient(request), response_serializer=serialize
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
