"""The v1beta1 DevicePlugin service of one plugin: what its RPCs do with the plugin's hooks.

The servicer is built from what it uses (the plugin, its device state, its stream bookkeeping,
the event sink and two timeouts) and knows nothing of registration or protobuf: ``rpc``'s handler
table decodes each request into plain values, calls the methods here, encodes what they return
and maps errors to gRPC statuses. Each gRPC server gets its own ``Serving`` (its handler and its
streams), so that a server can stop while the next one serves.

The RPCs are the plugin's hot path (every pod admission waits on Allocate): what can be worked
out once is (``answers``: the default ``allocate``'s encoded answer for a set of IDs, until the
devices change), and hooks are awaited through ``hooks``, where one that completes without
suspending costs one coroutine step. ``allocation.complete_preference`` makes any preference
valid.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import AsyncGenerator, Callable, Sequence
from functools import partial

import anyio
import grpc

from devplugin_sdk._engine.answers import MergedAnswers
from devplugin_sdk._engine.events import Events
from devplugin_sdk._engine.hooks import run_hook
from devplugin_sdk._engine.listing import Snapshot
from devplugin_sdk._engine.state import DeviceState
from devplugin_sdk._engine.streams import Streams
from devplugin_sdk._logging import printable
from devplugin_sdk._wire import convert, rpc
from devplugin_sdk._wire.rpc import RequestError
from devplugin_sdk.allocation import complete_preference
from devplugin_sdk.api import constants
from devplugin_sdk.errors import summarize_ids
from devplugin_sdk.plugin import DevicePlugin
from devplugin_sdk.types import Allocation, Device, Health

log = logging.getLogger("devplugin_sdk")


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
        # Not ``overrides("allocate")``: a wrapper such as CDI's reports its wrapped plugin's
        # hooks there, but its own allocate adds to theirs.
        self._default_allocate = plugin.allocate_is_merge
        self._answers = MergedAnswers(state)
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
        return rpc.handler(
            self.resource,
            pre_start_required=self.pre_start_required,
            preferred_allocation=self.preferred_allocation,
            # Asked inside the kubelet's Register handler; the kubelet then opens ListAndWatch
            # on the same connection: its stream comes next.
            options_requested=self.streams.options_requested,
            list_and_watch=partial(self.list_and_watch, serving),
            allocate=partial(self.allocate, serving=serving),
            prefer=partial(self.prefer, serving=serving),
            pre_start_container=partial(self.pre_start_container, serving=serving),
            outcomes=self.events,
        )

    # ------------------------------------------------------------------ RPCs

    async def list_and_watch(self, serving: Serving) -> AsyncGenerator[bytes, None]:
        """Encoded ListAndWatch messages: the devices now, then after each change, until
        ``serving``'s server stops."""
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

    async def allocate(self, containers: Sequence[tuple[str, ...]], *, serving: Serving) -> bytes:
        """The encoded Allocate answer for each container's device IDs, in request order."""
        if self._default_allocate:
            # The default allocate's answer: cached encodings, nothing awaited.
            return b"".join([self._merged(ids, index) for index, ids in enumerate(containers)])
        entries = []
        for index, ids in enumerate(containers):
            devices = self._devices(ids, "container request", index)
            self._warn_unhealthy(ids)
            allocation = await run_hook(
                self.plugin.allocate(devices), self.hook_timeout, self.resource, "allocate", serving
            )
            entries.append(convert.allocate_entry(allocation))
        return b"".join(entries)

    def _merged(self, key: tuple[str, ...], index: int) -> bytes:
        """The default allocate's answer for one container, encoded (kept per device version)."""
        entry = self._answers.get(key)
        if entry is None:
            # Only valid requests are kept: a key found there names known, distinct devices.
            devices = self._devices(key, "container request", index)
            entry = self._answers.put(key, convert.allocate_entry(Allocation.merge(devices)))
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

    async def prefer(
        self, available: dict[str, None], must: dict[str, None], size: int, *, serving: Serving
    ) -> list[str]:
        """A valid preference whatever the hook does: must-include, hook's choice, the rest.

        ``available`` and ``must`` are this call's own (``rpc.Prefer``): unknown IDs are
        dropped from them.
        """
        self._drop_unknown(available, must)
        choice: Sequence[str] = ()
        if self.preferred_allocation and len(must) < size:
            choice = await self._choice(available, must, size, serving)
        return complete_preference(available, must, size, choice)

    async def pre_start_container(self, ids: Sequence[str], *, serving: Serving) -> None:
        """Check the IDs; run the plugin's ``pre_start_container`` when it has one."""
        devices = self._devices(ids, "PreStartContainerRequest")
        if self.pre_start_required:
            await run_hook(
                self.plugin.pre_start_container(devices),
                self.prestart_timeout,
                self.resource,
                "pre_start_container",
                serving,
            )

    # ------------------------------------------------------------------ helpers

    def _devices(self, ids: Sequence[str], where: str, index: int | None = None) -> list[Device]:
        if not ids or len(set(ids)) != len(ids):
            where = where if index is None else f"{where} {index}"
            if not ids:
                raise RequestError(f"{where} has no device IDs")
            duplicates = sorted(i for i, n in Counter(ids).items() if n > 1)
            raise RequestError(f"{where} repeats device IDs: {', '.join(duplicates)}")
        return self.state.lookup(ids)

    def _drop_unknown(self, available: dict[str, None], must: dict[str, None]) -> None:
        known = self.state.by_id
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

    async def _choice(
        self, available: dict[str, None], must: dict[str, None], size: int, serving: Serving
    ) -> Sequence[str]:
        """The hook's choice, or none when it fails: the kubelet fails the pod on any error."""
        known = self.state.by_id
        # Must-include devices in the answer's order: those also offered first.
        must_first = sorted(must, key=lambda i: i not in available)
        try:
            answer = await run_hook(
                self.plugin.preferred_allocation(
                    list(map(known.__getitem__, available)),
                    list(map(known.__getitem__, must_first)),
                    size,
                ),
                self.hook_timeout,
                self.resource,
                "preferred_allocation",
                serving,
            )
            return [str(i) for i in answer]
        except Exception as exc:
            log.warning(
                "%s: preferred_allocation failed (%s: %s); answering with a default choice",
                self.resource,
                type(exc).__name__,
                exc,
                extra={"resource": self.resource},
            )
            return ()

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
