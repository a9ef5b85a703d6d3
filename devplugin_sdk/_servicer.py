"""The v1beta1 DevicePlugin service of one plugin: calls its hooks, maps errors to gRPC status.

This is the one place where SDK errors become status codes. Handlers are registered as generic
handlers so that ListAndWatch and Allocate can send pre-encoded bytes without re-serialising. The
servicer is built from what it uses (the plugin, its device state, its stream bookkeeping, the
event sink and two timeouts) and knows nothing of registration. Each gRPC server gets its own
``Serving`` (its handler and its streams), so that a server can stop while the next one serves.

The RPCs are the plugin's hot path (every pod admission waits on Allocate): what can be worked
out once is (the default ``allocate``'s answer for a set of IDs, until the devices change), and
a hook that completes without suspending costs one coroutine step, with no timeout machinery;
only a hook that really suspends runs under its bound.
"""

from __future__ import annotations

import asyncio
import logging
import time
import types
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Generator, Sequence
from functools import partial
from typing import Any, NoReturn, TypeVar

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
from devplugin_sdk.plugin import DevicePlugin
from devplugin_sdk.types import Allocation, Device, Health

log = logging.getLogger("devplugin_sdk")

T = TypeVar("T")
M = TypeVar("M")

SERVICE = "v1beta1.DevicePlugin"

#: Allocate answers of the default ``allocate`` kept per device version (one per distinct set
#: of IDs asked for); past it the cache starts again, so any request pattern stays bounded.
ALLOCATIONS_CACHED = 1024


class _RequestError(Exception):
    """A malformed request: answered with INVALID_ARGUMENT."""


def _identity(payload: bytes) -> bytes:
    return payload


class _Malformed:
    """Stands in for a request whose bytes did not parse (answered INVALID_ARGUMENT)."""

    def __init__(self, error: Exception) -> None:
        self.error = error


def _parsed(request: M | _Malformed, rpc: str) -> M:
    """The request, or INVALID_ARGUMENT when its bytes did not parse."""
    if isinstance(request, _Malformed):
        raise _RequestError(f"{rpc}: the request is not a valid protobuf message: {request.error}")
    return request


def _containers(request: pb.AllocateRequest | _Malformed) -> Sequence[Any]:
    containers = _parsed(request, "Allocate").container_requests
    if not containers:
        raise _RequestError("AllocateRequest has no container requests")
    return containers


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


class Serving:
    """What one gRPC server of a plugin serves: its handler, its calls and its streams.

    ``DevicePluginServicer.stop`` waits for this server's calls and ends this server's
    ListAndWatch streams, not another server's, so the next server can already serve (and the
    kubelet's new stream stay open) while this one stops.
    """

    def __init__(self, handler: Callable[[Serving], grpc.GenericRpcHandler]) -> None:
        self.ended = False
        self.in_flight = 0  # hooks suspended in a call on this server
        self.idle: anyio.Event | None = None  # set when in_flight drops to 0, if awaited
        self.handler = handler(self)

    def call_started(self) -> None:
        self.in_flight += 1

    def call_ended(self) -> None:
        self.in_flight -= 1
        if not self.in_flight and self.idle is not None:
            self.idle.set()


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
        # The default allocate is Allocation.merge of the devices: a pure function of them.
        # Asked of the class itself, not ``overrides`` (a wrapper such as CDI's reports its
        # wrapped plugin's hooks there, but its own allocate adds to theirs).
        self._default_allocate = type(plugin).allocate is DevicePlugin.allocate
        self._allocations: dict[tuple[str, ...], bytes] = {}
        self._allocations_version = -1
        self._options = _convert.options(
            pre_start_required=self.pre_start_required,
            preferred_allocation=self.preferred_allocation,
        )
        self._too_big_version = -1

    def serving(self) -> Serving:
        """A new server's share: the handler to add to it, and its streams (see ``stop``)."""
        return Serving(self._handler)

    async def stop(self, server: grpc.aio.Server, serving: Serving, grace: float) -> None:
        """Let in-flight calls finish, end ``serving``'s ListAndWatch streams cleanly, stop
        ``server``.

        The kubelet closes its connection when the stream ends, which would cancel an Allocate
        still running on it: calls get the grace first. ``grace`` bounds the whole stop.
        """
        with anyio.CancelScope(shield=True):
            deadline = anyio.current_time() + grace
            with anyio.move_on_after(grace):
                while serving.in_flight:
                    serving.idle = anyio.Event()
                    await serving.idle.wait()
            serving.ended = True
            self.state.wake()
            await server.stop(max(deadline - anyio.current_time(), 0.0))

    def _handler(self, serving: Serving) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(
            SERVICE,
            {
                "GetDevicePluginOptions": grpc.unary_unary_rpc_method_handler(
                    self.get_options,
                    request_deserializer=pb.Empty.FromString,
                    response_serializer=pb.DevicePluginOptions.SerializeToString,
                ),
                "ListAndWatch": grpc.unary_stream_rpc_method_handler(
                    partial(self.list_and_watch, serving=serving),
                    request_deserializer=pb.Empty.FromString,
                    response_serializer=_identity,
                ),
                "GetPreferredAllocation": grpc.unary_unary_rpc_method_handler(
                    partial(self.get_preferred_allocation, serving=serving),
                    request_deserializer=_lenient(pb.PreferredAllocationRequest),
                    response_serializer=pb.PreferredAllocationResponse.SerializeToString,
                ),
                "Allocate": grpc.unary_unary_rpc_method_handler(
                    partial(self.allocate, serving=serving),
                    request_deserializer=_lenient(pb.AllocateRequest),
                    response_serializer=_identity,
                ),
                "PreStartContainer": grpc.unary_unary_rpc_method_handler(
                    partial(self.pre_start_container, serving=serving),
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
        self,
        request: pb.Empty,
        context: grpc.aio.ServicerContext[Any, Any],
        *,
        serving: Serving,
    ) -> AsyncIterator[bytes]:
        stream_id = self.streams.opened()
        seen = -1
        try:
            while not serving.ended:
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
            # Reached on a clean end (our server stopping) and on kubelet cancellation alike.
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
        self,
        request: pb.AllocateRequest | _Malformed,
        context: grpc.aio.ServicerContext[Any, Any],
        *,
        serving: Serving,
    ) -> bytes:
        started = time.perf_counter()
        code: grpc.StatusCode | None = None
        try:
            if self._default_allocate:
                return self._allocate_merged(request)
            return await self._allocate_hooked(request, serving)
        except Exception as exc:
            code = status_for(exc)
            await self._refuse("Allocate", context, exc, code)
            raise  # pragma: no cover - abort raises
        finally:
            error = None if code is None else code.name
            self.events.allocation(self.resource, time.perf_counter() - started, error)

    def _allocate_merged(self, request: pb.AllocateRequest | _Malformed) -> bytes:
        """The default allocate's answer: cached encodings, nothing awaited."""
        containers = _containers(request)
        return b"".join([self._merged(c.devices_ids, index) for index, c in enumerate(containers)])

    async def _allocate_hooked(
        self, request: pb.AllocateRequest | _Malformed, serving: Serving
    ) -> bytes:
        entries = []
        for index, container in enumerate(_containers(request)):
            devices = self._devices(container.devices_ids, "container request", index)
            self._warn_unhealthy([d.id for d in devices])
            allocation = await self._hook(
                self.plugin.allocate(devices), self.hook_timeout, "allocate", serving
            )
            entries.append(_convert.allocate_entry(allocation))
        return b"".join(entries)

    def _merged(self, ids: Sequence[str], index: int) -> bytes:
        """The default allocate's answer for one container, encoded (cached per device version)."""
        if self._allocations_version != self.state.devices_version:
            self._allocations.clear()
            self._allocations_version = self.state.devices_version
        key = tuple(ids)
        entry = self._allocations.get(key)
        if entry is None:
            # Only valid requests are cached: a key found there names known, distinct devices.
            devices = self._devices(key, "container request", index)
            entry = _convert.allocate_entry(Allocation.merge(devices))
            if len(self._allocations) >= ALLOCATIONS_CACHED:
                self._allocations.clear()
            self._allocations[key] = entry
        self._warn_unhealthy(key)
        return entry

    def _warn_unhealthy(self, ids: Sequence[str]) -> None:
        for device_id in ids:
            if self.state.health_of(device_id) is not Health.HEALTHY:
                # The kubelet may legitimately re-send held devices (init containers,
                # re-allocation); refusing would fail a pod that already owns them.
                log.warning(
                    "%s: allocating unhealthy device %s",
                    self.resource,
                    device_id,
                    extra={"resource": self.resource, "device": device_id},
                )

    async def get_preferred_allocation(
        self,
        request: pb.PreferredAllocationRequest | _Malformed,
        context: grpc.aio.ServicerContext[Any, Any],
        *,
        serving: Serving,
    ) -> pb.PreferredAllocationResponse:
        try:
            return _convert.preferred_response(
                [
                    await self._prefer(c, serving)
                    for c in _parsed(request, "GetPreferredAllocation").container_requests
                ]
            )
        except Exception as exc:
            await self._refuse("GetPreferredAllocation", context, exc, status_for(exc))
            raise  # pragma: no cover - abort raises

    async def pre_start_container(
        self,
        request: pb.PreStartContainerRequest | _Malformed,
        context: grpc.aio.ServicerContext[Any, Any],
        *,
        serving: Serving,
    ) -> pb.PreStartContainerResponse:
        try:
            ids = _parsed(request, "PreStartContainer").devices_ids
            devices = self._devices(ids, "PreStartContainerRequest")
            if self.pre_start_required:
                await self._hook(
                    self.plugin.pre_start_container(devices),
                    self.prestart_timeout,
                    "pre_start_container",
                    serving,
                )
            return pb.PreStartContainerResponse()
        except Exception as exc:
            await self._refuse("PreStartContainer", context, exc, status_for(exc))
            raise  # pragma: no cover - abort raises

    # ------------------------------------------------------------------ helpers

    def _devices(self, ids: Sequence[str], where: str, index: int | None = None) -> list[Device]:
        if not ids or len(set(ids)) != len(ids):
            where = where if index is None else f"{where} {index}"
            if not ids:
                raise _RequestError(f"{where} has no device IDs")
            duplicates = sorted(i for i, n in Counter(ids).items() if n > 1)
            raise _RequestError(f"{where} repeats device IDs: {', '.join(duplicates)}")
        return self.state.lookup(ids)

    async def _prefer(
        self, request: pb.ContainerPreferredAllocationRequest, serving: Serving
    ) -> list[str]:
        """A valid preference whatever the hook does: must-include, hook's choice, the rest.

        A request can name every unit of a large resource (81,920 GPU memory units): each ID
        is walked as few times as possible, with the set operations done in C.
        """
        size = request.allocation_size
        known = self.state.by_id
        # Ordered and deduplicated; doubles as the set of what may be chosen.
        available = dict.fromkeys(request.available_deviceIDs)
        must = dict.fromkeys(request.must_include_deviceIDs)
        if not (available.keys() <= known.keys() and must.keys() <= known.keys()):
            dropped = (available.keys() | must.keys()) - known.keys()
            log.warning(
                "%s: GetPreferredAllocation named unknown devices %s; ignoring them",
                self.resource,
                printable(summarize_ids(dropped)),
                extra={"resource": self.resource},
            )
            for device_id in dropped:
                available.pop(device_id, None)
                must.pop(device_id, None)
        if size <= 0:
            return []
        # Must-include IDs the kubelet also offers come first (it sends them in both lists).
        result = [i for i in must if i in available] + [i for i in must if i not in available]
        if len(result) >= size:
            return result[:size]
        choice: Sequence[str] = ()
        if self.preferred_allocation:
            try:
                answer = await self._hook(
                    self.plugin.preferred_allocation(
                        list(map(known.__getitem__, available)),
                        list(map(known.__getitem__, result)),
                        size,
                    ),
                    self.hook_timeout,
                    "preferred_allocation",
                    serving,
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
        chosen = set(result)
        for candidates in (choice, available):
            for candidate in candidates:
                if candidate in available and candidate not in chosen:
                    result.append(candidate)
                    if len(result) >= size:
                        return result
                    chosen.add(candidate)
        return result

    async def _hook(
        self, awaitable: Awaitable[T], timeout: float, hook: str, serving: Serving
    ) -> T:
        """Await a plugin hook, bounded by ``timeout`` once it suspends.

        Most hooks finish without ever suspending (a merge, a lookup): the first step of the
        coroutine is run here and its result returned, with no timer armed. A hook that
        suspends is driven on under ``_deadline``.

        Raises:
            TimeoutError: the hook did not finish within ``timeout`` seconds.
        """
        if type(awaitable) is not types.CoroutineType:
            # Not a native coroutine (an ``async def`` hook always is): await it in one.
            return await self._hook(_awaited(awaitable), timeout, hook, serving)
        try:
            pending = awaitable.send(None)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]
        return await self._bounded(awaitable, pending, timeout, hook, serving)

    async def _bounded(
        self,
        coro: Coroutine[Any, Any, T],
        pending: Any,
        timeout: float,
        hook: str,
        serving: Serving,
    ) -> T:
        """Drive a suspended hook coroutine on until it ends or ``timeout`` passes.

        The bound is a native cancellation of this task, not an anyio cancel scope: the hook's
        first step ran outside any scope of ours, and may have entered scopes of its own
        (``anyio.to_thread.run_sync`` does) that a scope entered now would wrongly enclose. A
        cancellation that is not the bound's (the RPC cancelled by the kubelet, the server
        stopping) propagates unchanged. As with grpc.aio's own cancellations, a hook waiting
        in ``anyio.to_thread.run_sync`` gets the cancellation at the bound while its thread
        finishes on its own.
        """
        task = asyncio.current_task()
        assert task is not None  # grpc.aio runs every handler in a task
        cancelling = _cancelling(task)
        expired = False

        def expire() -> None:
            nonlocal expired
            expired = True
            task.cancel()

        timer = asyncio.get_running_loop().call_later(timeout, expire)
        serving.call_started()
        try:
            return await _resumed(coro, pending)
        except asyncio.CancelledError:
            if expired:
                expired = False
                if _uncancel(task) <= cancelling:
                    raise TimeoutError(
                        f"{self.resource}: {hook} did not finish within {timeout:g}s"
                    ) from None
            raise
        finally:
            timer.cancel()
            if expired:
                _uncancel(task)  # the hook swallowed the bound's cancellation: take it back
            serving.call_ended()

    async def _refuse(
        self,
        rpc: str,
        context: grpc.aio.ServicerContext[Any, Any],
        exc: Exception,
        code: grpc.StatusCode,
    ) -> NoReturn:
        """Log why a call failed and end it with ``code`` and the error's message."""
        # Errors quote the request (unknown or repeated device IDs): no raw control
        # characters from a peer reach the log or the kubelet's events.
        message = printable(str(exc) or type(exc).__name__)
        if code is grpc.StatusCode.INTERNAL:
            message = f"{self.resource}: {type(exc).__name__}: {message}"
            log.error(
                "%s: %s failed",
                self.resource,
                rpc,
                exc_info=exc,
                extra={"resource": self.resource},
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
        await context.abort(code, message)
        raise AssertionError("unreachable")  # pragma: no cover - abort raises

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


@types.coroutine
def _resumed(coro: Coroutine[Any, Any, T], pending: Any) -> Generator[Any, Any, T]:
    """Go on with ``coro`` after its first suspension (which yielded ``pending``), exactly as
    ``await coro`` would have: every value the task sends and every exception it throws
    (a cancellation) reaches the coroutine."""
    value = pending
    while True:
        try:
            sent = yield value
        except GeneratorExit:
            coro.close()
            raise
        except BaseException as exc:  # handed to the coroutine, as await does
            try:
                value = coro.throw(exc)
            except StopIteration as done:
                return done.value  # type: ignore[no-any-return]
        else:
            try:
                value = coro.send(sent)
            except StopIteration as done:
                return done.value  # type: ignore[no-any-return]


async def _awaited(awaitable: Awaitable[T]) -> T:
    return await awaitable


def _cancelling(task: asyncio.Task[Any]) -> int:
    # Task.cancelling/uncancel exist from Python 3.11: they tell our cancellation from others.
    cancelling = getattr(task, "cancelling", None)
    return 0 if cancelling is None else int(cancelling())


def _uncancel(task: asyncio.Task[Any]) -> int:
    uncancel = getattr(task, "uncancel", None)
    return 0 if uncancel is None else int(uncancel())
