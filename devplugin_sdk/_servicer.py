"""The v1beta1 DevicePlugin service of one plugin: calls its hooks, maps errors to gRPC status.

This is the one place where SDK errors become status codes. Handlers are registered as generic
handlers so that ListAndWatch can send the state's pre-encoded bytes without re-serialising. The
servicer is built from what it uses (the plugin, its device state, its stream bookkeeping, the
event sink and two timeouts) and knows nothing of registration.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import anyio
import grpc
from google.protobuf.message import DecodeError

from devplugin_sdk import _convert
from devplugin_sdk._events import Events
from devplugin_sdk._logging import printable
from devplugin_sdk._state import DeviceState, Snapshot
from devplugin_sdk._streams import Streams
from devplugin_sdk.api import constants
from devplugin_sdk.api.deviceplugin.v1beta1 import deviceplugin_pb2 as pb
from devplugin_sdk.errors import AllocationError, BackendError, UnknownDeviceError, summarize_ids
from devplugin_sdk.types import Device, Health

if TYPE_CHECKING:
    from devplugin_sdk.plugin import DevicePlugin

log = logging.getLogger("devplugin_sdk")

T = TypeVar("T")

SERVICE = "v1beta1.DevicePlugin"


class _RequestError(Exception):
    """A malformed request: answered with INVALID_ARGUMENT."""


def _identity(payload: bytes) -> bytes:
    return payload


class _Malformed:
    """Stands in for a request whose bytes did not parse (answered INVALID_ARGUMENT)."""

    def __init__(self, error: Exception) -> None:
        self.error = error


def _refuse_malformed(rpc: str, request: _Malformed) -> NoReturn:
    raise _RequestError(f"{rpc}: the request is not a valid protobuf message: {request.error}")


def _lenient(message: Any) -> Callable[[bytes], Any]:
    """A deserializer that turns undecodable bytes into ``_Malformed`` instead of raising
    (grpcio would answer UNKNOWN)."""

    def parse(data: bytes) -> Any:
        try:
            return message.FromString(data)
        except DecodeError as exc:
            return _Malformed(exc)

    return parse


def status_for(exc: BaseException) -> grpc.StatusCode:
    """The gRPC status code for an exception raised while serving a request."""
    if isinstance(exc, (UnknownDeviceError, _RequestError)):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(exc, AllocationError):
        return grpc.StatusCode.FAILED_PRECONDITION
    if isinstance(exc, TimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED
    if isinstance(exc, BackendError):
        return grpc.StatusCode.UNAVAILABLE
    return grpc.StatusCode.INTERNAL


class DevicePluginServicer:
    """Serves one plugin's RPCs.

    Args:
        plugin: The plugin whose hooks answer the RPCs.
        state: Its device state (ListAndWatch reads it; requests are checked against it).
        streams: Where ListAndWatch streams are recorded.
        events: Where RPC outcomes are reported.
        hook_timeout: Bound on ``allocate`` and ``preferred_allocation``.
        prestart_timeout: Bound on ``pre_start_container``.
    """

    def __init__(
        self,
        plugin: DevicePlugin,
        state: DeviceState,
        streams: Streams,
        events: Events,
        *,
        hook_timeout: float,
        prestart_timeout: float,
    ) -> None:
        self.plugin = plugin
        self.state = state
        self.streams = streams
        self.events = events
        self.resource = plugin.resource_name
        self.hook_timeout = hook_timeout
        self.prestart_timeout = prestart_timeout
        self.pre_start_required = plugin.overrides("pre_start_container")
        self.preferred_allocation = plugin.overrides("preferred_allocation")
        self._options = _convert.options(
            pre_start_required=self.pre_start_required,
            preferred_allocation=self.preferred_allocation,
        )
        self._too_big_version = -1
        self._in_flight = 0
        self._idle = anyio.Event()
        self._idle.set()

    async def stop(self, server: grpc.aio.Server, grace: float) -> None:
        """Let in-flight calls finish, end every ListAndWatch stream cleanly, stop ``server``.

        The kubelet closes its connection when the stream ends, which would cancel an Allocate
        still running on it: calls get the grace first. ``grace`` bounds the whole stop.
        """
        with anyio.CancelScope(shield=True):
            deadline = anyio.current_time() + grace
            with anyio.move_on_after(grace):
                while self._in_flight:
                    await self._idle.wait()
            self.state.close()
            await server.stop(max(deadline - anyio.current_time(), 0.0))
            self.state.reopen()

    def handler(self) -> grpc.GenericRpcHandler:
        """The generic handler to add to a grpc.aio server."""
        return grpc.method_handlers_generic_handler(
            SERVICE,
            {
                "GetDevicePluginOptions": grpc.unary_unary_rpc_method_handler(
                    self.get_options,
                    request_deserializer=pb.Empty.FromString,
                    response_serializer=pb.DevicePluginOptions.SerializeToString,
                ),
                "ListAndWatch": grpc.unary_stream_rpc_method_handler(
                    self.list_and_watch,
                    request_deserializer=pb.Empty.FromString,
                    response_serializer=_identity,
                ),
                "GetPreferredAllocation": grpc.unary_unary_rpc_method_handler(
                    self.get_preferred_allocation,
                    request_deserializer=_lenient(pb.PreferredAllocationRequest),
                    response_serializer=pb.PreferredAllocationResponse.SerializeToString,
                ),
                "Allocate": grpc.unary_unary_rpc_method_handler(
                    self.allocate,
                    request_deserializer=_lenient(pb.AllocateRequest),
                    response_serializer=pb.AllocateResponse.SerializeToString,
                ),
                "PreStartContainer": grpc.unary_unary_rpc_method_handler(
                    self.pre_start_container,
                    request_deserializer=_lenient(pb.PreStartContainerRequest),
                    response_serializer=pb.PreStartContainerResponse.SerializeToString,
                ),
            },
        )

    # ------------------------------------------------------------------ RPCs

    async def get_options(
        self, request: pb.Empty, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.DevicePluginOptions:
        # Called once, inside the kubelet's Register handler: it must be fast and never fail.
        # The kubelet then opens ListAndWatch on the same connection: its stream comes next.
        self.streams.options_requested()
        return self._options

    async def list_and_watch(
        self, request: pb.Empty, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[bytes]:
        stream_id = self.streams.opened()
        seen = -1
        try:
            while not self.state.closed:
                snapshot = self.state.snapshot()
                if snapshot.version != seen:
                    seen = snapshot.version
                    if len(snapshot.payload) > constants.MAX_MESSAGE_BYTES:
                        self._log_too_big(
                            snapshot.version, len(snapshot.payload), len(snapshot.devices)
                        )
                    else:
                        yield snapshot.payload
                        self._sent(stream_id, snapshot)
                        continue
                await self.state.wait_changed(seen)
        finally:
            # Reached on a clean end (we closed the state) and on kubelet cancellation alike.
            self.streams.ended(stream_id)

    def _sent(self, stream_id: int, snapshot: Snapshot) -> None:
        self.streams.sent(stream_id, snapshot.version)
        healthy = snapshot.healthy_count
        self.events.list_sent(self.resource, healthy, len(snapshot.devices) - healthy)
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "%s: sent %d devices (%d healthy)",
                self.resource,
                len(snapshot.devices),
                healthy,
                extra={"resource": self.resource},
            )

    async def allocate(
        self, request: pb.AllocateRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.AllocateResponse:
        started = time.perf_counter()

        async def serve() -> pb.AllocateResponse:
            if not request.container_requests:
                raise _RequestError("AllocateRequest has no container requests")
            responses = []
            for index, container in enumerate(request.container_requests):
                devices = self._devices(container.devices_ids, f"container request {index}")
                for device in devices:
                    if self.state.health_of(device.id) is not Health.HEALTHY:
                        # The kubelet may legitimately re-send held devices (init containers,
                        # re-allocation); refusing would fail a pod that already owns them.
                        log.warning(
                            "%s: allocating unhealthy device %s",
                            self.resource,
                            device.id,
                            extra={"resource": self.resource, "device": device.id},
                        )
                allocation = await self._bounded(
                    self.plugin.allocate(devices), self.hook_timeout, "allocate"
                )
                responses.append(_convert.allocation_to_response(allocation))
            return pb.AllocateResponse(container_responses=responses)

        failure: list[grpc.StatusCode] = []
        try:
            return await self._guard("Allocate", context, serve(), failure, request)
        finally:
            error = failure[0].name if failure else None
            self.events.allocation(self.resource, time.perf_counter() - started, error)

    async def get_preferred_allocation(
        self, request: pb.PreferredAllocationRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.PreferredAllocationResponse:
        async def serve() -> pb.PreferredAllocationResponse:
            return _convert.preferred_response(
                [await self._prefer(c) for c in request.container_requests]
            )

        return await self._guard("GetPreferredAllocation", context, serve(), request=request)

    async def pre_start_container(
        self, request: pb.PreStartContainerRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.PreStartContainerResponse:
        async def serve() -> pb.PreStartContainerResponse:
            devices = self._devices(request.devices_ids, "PreStartContainerRequest")
            if self.pre_start_required:
                await self._bounded(
                    self.plugin.pre_start_container(devices),
                    self.prestart_timeout,
                    "pre_start_container",
                )
            return pb.PreStartContainerResponse()

        return await self._guard("PreStartContainer", context, serve(), request=request)

    # ------------------------------------------------------------------ helpers

    def _devices(self, ids: Sequence[str], where: str) -> list[Device]:
        if not ids:
            raise _RequestError(f"{where} has no device IDs")
        duplicates = sorted(i for i, n in Counter(ids).items() if n > 1)
        if duplicates:
            raise _RequestError(f"{where} repeats device IDs: {', '.join(duplicates)}")
        return self.state.lookup(ids)

    async def _prefer(self, request: pb.ContainerPreferredAllocationRequest) -> list[str]:
        """A valid preference whatever the hook does: must-include, hook's choice, the rest."""
        size = request.allocation_size
        known = {d.id: d for d in self.state.devices}
        available = [i for i in dict.fromkeys(request.available_deviceIDs) if i in known]
        must = [i for i in dict.fromkeys(request.must_include_deviceIDs) if i in known]
        dropped = (
            set(request.available_deviceIDs) | set(request.must_include_deviceIDs)
        ) - known.keys()
        if dropped:
            log.warning(
                "%s: GetPreferredAllocation named unknown devices %s; ignoring them",
                self.resource,
                printable(summarize_ids(dropped)),
                extra={"resource": self.resource},
            )
        if size <= 0:
            return []
        available_set = set(available)
        must = [i for i in must if i in available_set] + [i for i in must if i not in available_set]
        if len(must) >= size:
            return must[:size] if len(must) > size else must
        choice: list[str] = []
        if self.preferred_allocation:
            try:
                answer = await self._bounded(
                    self.plugin.preferred_allocation(
                        [known[i] for i in available], [known[i] for i in must], size
                    ),
                    self.hook_timeout,
                    "preferred_allocation",
                )
                choice = [str(i) for i in answer]
            except Exception as exc:
                # The kubelet fails the pod on any GetPreferredAllocation error: fall back.
                log.warning(
                    "%s: preferred_allocation failed (%s: %s); answering with a default choice",
                    self.resource,
                    type(exc).__name__,
                    exc,
                    extra={"resource": self.resource},
                )
        result = list(must)
        chosen = set(result)
        for candidate in [*choice, *available]:
            if len(result) >= size:
                break
            if candidate in available_set and candidate not in chosen:
                result.append(candidate)
                chosen.add(candidate)
        return result

    async def _bounded(self, awaitable: Awaitable[T], timeout: float, hook: str) -> T:
        with anyio.move_on_after(timeout) as scope:
            return await awaitable
        if scope.cancelled_caught:
            raise TimeoutError(f"{self.resource}: {hook} did not finish within {timeout:g}s")
        raise AssertionError("unreachable")  # pragma: no cover

    async def _guard(
        self,
        rpc: str,
        context: grpc.aio.ServicerContext[Any, Any],
        work: Coroutine[Any, Any, T],
        failure: list[grpc.StatusCode] | None = None,
        request: object = None,
    ) -> T:
        self._in_flight += 1
        if self._in_flight == 1:
            self._idle = anyio.Event()
        try:
            if isinstance(request, _Malformed):
                work.close()  # never started
                _refuse_malformed(rpc, request)
            return await work
        except Exception as exc:
            code = status_for(exc)
            # Errors quote the request (unknown or repeated device IDs): no raw control
            # characters from a peer reach the log or the kubelet's events.
            message = printable(str(exc) or type(exc).__name__)
            if code is grpc.StatusCode.INTERNAL:
                message = f"{self.resource}: {type(exc).__name__}: {message}"
                log.exception(
                    "%s: %s failed", self.resource, rpc, extra={"resource": self.resource}
                )
            else:
                log.warning(
                    "%s: %s refused: %s",
                    self.resource,
                    rpc,
                    message,
                    extra={"resource": self.resource},
                )
            if rpc != "Allocate":
                self.events.rpc_error(self.resource, rpc, code.name)
            if failure is not None:
                failure.append(code)
            await context.abort(code, message)
            raise  # pragma: no cover - abort raises
        finally:
            self._in_flight -= 1
            if not self._in_flight:
                self._idle.set()

    def _log_too_big(self, version: int, size: int, count: int) -> None:
        if version == self._too_big_version:
            return
        self._too_big_version = version
        log.error(
            "%s: not sending a ListAndWatch message of %d bytes (%d devices): the kubelet rejects "
            "messages over %d bytes and would drop the resource; split it into several resources",
            self.resource,
            size,
            count,
            constants.MAX_MESSAGE_BYTES,
            extra={"resource": self.resource},
        )
