"""``devplugin conformance``: named checks that judge a device plugin as the kubelet would.

Each check is a small async function that returns what it saw or raises ``CheckFailed`` (the
kubelet breaks or misbehaves: a pod fails admission, the resource drops out),
``CheckWarning`` (the kubelet copes, but what the plugin meant is lost) or ``Skip``; each
``Check`` cites the kubelet code its levels come from (``kubelet``, functions of
``pkg/kubelet/cm/devicemanager``). The suite talks to the plugin through ``probe.PluginClient``,
as the kubelet would. ``check_socket`` tests a plugin on its socket; ``check_register_dir``
plays the kubelet (``FakeKubelet``) on a directory, tests what registers, then restarts it.
"""

from __future__ import annotations

import os
import sys
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Generic, Literal, Protocol, TypeVar

import anyio
import anyio.abc
import grpc

from devplugin_sdk import _names
from devplugin_sdk._limits import Limits
from devplugin_sdk._wire import client as _client
from devplugin_sdk._wire import watcher_registration
from devplugin_sdk._wire.dra_model import ClaimRef
from devplugin_sdk._wire.dra_service import DraClient
from devplugin_sdk._wire.server import is_live_socket
from devplugin_sdk._wire.watcher_registration import PluginInfo
from devplugin_sdk.api import constants
from devplugin_sdk.kubelet.fake import FakeKubelet, Registration

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup

from devplugin_sdk.kubelet.probe import (
    DeviceList,
    ListStream,
    PluginClient,
    PluginOptions,
    PluginRpcError,
    ProbeError,
)

__all__ = [
    "CHECKS",
    "DRA_CHECKS",
    "RESTART_CHECK",
    "RESTART_KUBELET",
    "Check",
    "CheckFailed",
    "CheckResult",
    "CheckWarning",
    "ConformanceError",
    "ConformanceReport",
    "Limits",
    "Skip",
    "check_dra_socket",
    "check_register_dir",
    "check_socket",
]

Status = Literal["pass", "warn", "fail", "skip"]
Level = Literal["warn", "fail"]
OnResult = Callable[["CheckResult"], None]

UNKNOWN_ID = "conformance-unknown-1"
# The API's comment on Device.ID; the kubelet itself does not enforce it.
MAX_ID_LENGTH = 63
# Conformance reads ListAndWatch with a larger limit than the kubelet's so that it can report
# the size of an oversized message instead of only the kubelet's RESOURCE_EXHAUSTED.
_MEASURE_LIMIT = 64 * 1024 * 1024


class CheckFailed(Exception):
    """Raised by a check: the kubelet breaks or misbehaves with it; the message says how."""


class CheckWarning(Exception):
    """Raised by a check: the kubelet copes, but the plugin's intent is lost; the message says
    how."""


class Skip(Exception):
    """Raised by a check that does not apply (an option not advertised, no devices)."""


class ConformanceError(Exception):
    """The suite cannot run (e.g. a live kubelet already serves the register directory)."""


@dataclass(frozen=True, slots=True)
class CheckResult:
    """The outcome of one check.

    Attributes:
        name: The check's name, e.g. ``"unknown-ids-rejected"``.
        status: ``"pass"``, ``"warn"``, ``"fail"`` or ``"skip"``.
        detail: What was seen (with any note), or why it warned, failed or was skipped.
        resource: The resource tested, in ``--register-dir`` mode.
    """

    name: str
    status: Status
    detail: str
    resource: str | None = None

    def line(self) -> str:
        """``PASS  options-fast  answered in 0.4 ms``."""
        return f"{self.status.upper():<4}  {self.name}  {self.detail}"

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "status": self.status,
            "detail": self.detail,
            "resource": self.resource,
        }


@dataclass
class ConformanceReport:
    """Every result of a run, in order.

    Attributes:
        mode: ``"socket"``, ``"register-dir"`` or ``"dra"``.
        target: The socket or directory tested.
        results: The check results.
    """

    mode: str
    target: str
    results: list[CheckResult] = field(default_factory=list)

    def count(self, status: Status) -> int:
        return sum(1 for r in self.results if r.status == status)

    def succeeded(self, *, strict: bool = False) -> bool:
        """No check failed (nor, with ``strict``, warned), and at least one ran to a verdict."""
        bad = self.count("fail") + (self.count("warn") if strict else 0)
        return bad == 0 and self.count("pass") + self.count("warn") > 0

    @property
    def ok(self) -> bool:
        """The verdict without ``strict``: no check failed (warnings allowed)."""
        return self.succeeded()

    def summary(self) -> str:
        """``N passed, M failed`` (with the warned and skipped checks, when any)."""
        warned = self.count("warn")
        text = f"{self.count('pass')} passed, " + (f"{warned} warned, " if warned else "")
        text += f"{self.count('fail')} failed"
        skipped = self.count("skip")
        return f"{text}, {skipped} skipped" if skipped else text

    def to_json(self, *, strict: bool = False) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "target": self.target,
            "results": [r.to_json() for r in self.results],
            "passed": self.count("pass"),
            "warned": self.count("warn"),
            "failed": self.count("fail"),
            "skipped": self.count("skip"),
            "strict": strict,
            "ok": self.succeeded(strict=strict),
        }


# ------------------------------------------------------------------------------------------ subject


class _Subject:
    """The plugin under test and the connections and streams the checks share."""

    def __init__(self, path: Path, limits: Limits) -> None:
        self.path = path
        self.limits = limits
        self.client: PluginClient | None = None
        self.options: PluginOptions | None = None
        self.first: DeviceList | None = None
        self.primary: ListStream | None = None
        self.primary_end: str | None = None
        self.updates = 0
        self.largest = 0
        self.registration: Registration | None = None
        self._clients: list[PluginClient] = []
        self._streams: list[ListStream] = []
        self._tg: anyio.abc.TaskGroup | None = None

    async def __aenter__(self) -> _Subject:
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        assert self._tg is not None
        # Stop the background reader first: a grpc read interrupted by a local cancel of its
        # call raises CancelledError, which must not look like a cancellation of the task.
        self._tg.cancel_scope.cancel()
        try:
            return await self._tg.__aexit__(exc_type, exc, tb)
        finally:
            with anyio.CancelScope(shield=True):
                await self.close_connections()

    async def connect(self) -> PluginClient:
        """A new connection to the plugin, closed at the end of the run."""
        client = await PluginClient.connect(
            self.path,
            timeout=self.limits.timeout,
            rpc_timeout=self.limits.timeout,
            max_receive_bytes=_MEASURE_LIMIT,
        )
        self._clients.append(client)
        return client

    def keep_open(self, stream: ListStream) -> None:
        self._streams.append(stream)

    async def close_connections(self) -> None:
        for stream in self._streams:
            stream.cancel()
        for client in self._clients:
            await client.close()
        self._clients.clear()
        self._streams.clear()

    def start_draining(self, stream: ListStream) -> None:
        """Read the primary stream in the background, recording updates and its end."""
        assert self._tg is not None
        self.primary = stream
        self.keep_open(stream)
        self._tg.start_soon(self._drain, stream)

    async def _drain(self, stream: ListStream) -> None:
        try:
            async for devices in stream:
                self.updates += 1
                self.largest = max(self.largest, devices.size)
        except ProbeError as exc:
            self.primary_end = str(exc)

    def need_client(self) -> PluginClient:
        if self.client is None:
            raise Skip("needs a connection (dial failed)")
        return self.client

    def need_options(self) -> PluginOptions:
        if self.options is None:
            raise Skip("needs the plugin's options (options-fast failed)")
        return self.options

    def need_list(self) -> DeviceList:
        if self.first is None:
            raise Skip("needs the first device list (list-prompt failed)")
        return self.first

    def healthy_ids(self, at_least: int = 1) -> list[str]:
        ids = list(dict.fromkeys(d.id for d in self.need_list().healthy))
        if len(ids) < at_least:
            raise Skip(
                f"needs {at_least} healthy device{'s' if at_least > 1 else ''}, "
                f"the plugin lists {len(ids)}"
            )
        return ids


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def _ms(seconds: float) -> str:
    if seconds >= 1.0:
        return f"{seconds:.2f} s"
    return f"{seconds * 1000:.1f} ms"


def _flags(options: PluginOptions) -> str:
    return (
        f"pre_start_required={str(options.pre_start_required).lower()}, "
        f"get_preferred_allocation_available={str(options.preferred_allocation).lower()}"
    )


# ------------------------------------------------------------------------------------------ checks


class _Limited(Protocol):
    limits: Limits


SubjectT = TypeVar("SubjectT", bound=_Limited)


@dataclass(frozen=True, slots=True)
class Check(Generic[SubjectT]):
    """A named check (of a device plugin, or of a DRA plugin for ``DRA_CHECKS``).

    Attributes:
        name: The name printed on its line.
        rule: The rule it checks, one sentence.
        run: The check: returns a detail line, or raises ``CheckFailed``, ``CheckWarning`` or
            ``Skip``.
        levels: The levels it can give besides pass and skip.
        kubelet: What the kubelet does that the levels come from, naming its functions
            (``dm/`` is ``pkg/kubelet/cm/devicemanager/``, as in the protocol reference).
        register_only: Runs only in ``--register-dir`` mode.
    """

    name: str
    rule: str
    run: Callable[[SubjectT], Awaitable[str]]
    levels: tuple[Level, ...]
    kubelet: str
    register_only: bool = False


async def _dial(s: _Subject) -> str:
    # The kubelet dials once per registration, blocking, with a 10 s timeout.
    s.client = await s.connect()
    return f"connected in {_ms(s.client.connect_seconds)}"


async def _options_fast(s: _Subject) -> str:
    client = s.need_client()
    started = time.perf_counter()
    options = await client.options()
    elapsed = time.perf_counter() - started
    s.options = options
    if elapsed > s.limits.fast_within:
        # The kubelet calls it inside Register, with no deadline: registration waits on it.
        raise CheckWarning(
            f"answered in {_ms(elapsed)}, over {_ms(s.limits.fast_within)}; the kubelet calls it "
            "inside Register and the plugin's registration waits for it"
        )
    return f"answered in {_ms(elapsed)} ({_flags(options)})"


async def _registration_valid(s: _Subject) -> str:
    reg = s.registration
    if reg is None:
        raise Skip("no registration recorded")
    problems: list[str] = []
    if reg.error is not None:
        problems.append(f"the kubelet rejected it: {reg.error}")
    if reg.version != constants.VERSION:
        problems.append(f"version {reg.version!r} is not {constants.VERSION!r}")
    name_problem = _names.resource_name_problem(reg.resource_name)
    if name_problem is not None:
        problems.append(f"resource name {reg.resource_name!r} is invalid: {name_problem}")
    if problems:
        raise CheckFailed("; ".join(problems))
    try:
        # Only files directly in the directory are wiped at kubelet start (restart detection);
        # the kubelet itself joins any endpoint onto the directory and dials it.
        _names.validate_socket_name(reg.endpoint)
    except ValueError as exc:
        problems.append(
            f"endpoint must be a bare socket file name in the directory: {exc}; the kubelet "
            "dials it, but never deletes it when it restarts"
        )
    if s.options is not None and (
        reg.pre_start_required != s.options.pre_start_required
        or reg.preferred_allocation != s.options.preferred_allocation
    ):
        # The kubelet reads no RegisterRequest.options: GetDevicePluginOptions is what it uses.
        problems.append(
            "RegisterRequest.options (pre_start_required="
            f"{str(reg.pre_start_required).lower()}, get_preferred_allocation_available="
            f"{str(reg.preferred_allocation).lower()}) differ from GetDevicePluginOptions "
            f"({_flags(s.options)}), which is all the kubelet reads"
        )
    if problems:
        raise CheckWarning("; ".join(problems))
    return f"{reg.resource_name} registered {reg.version} with endpoint {reg.endpoint!r}"


async def _list_prompt(s: _Subject) -> str:
    client = s.need_client()
    stream = client.list_and_watch()
    try:
        devices = await stream.next(timeout=s.limits.timeout)
    except TimeoutError:
        stream.cancel()
        raise CheckFailed(
            f"no ListAndWatch message within {s.limits.timeout:g} s; the plugin must send the "
            "full device list as soon as the stream opens (capacity stays 0 until it does)"
        ) from None
    elapsed = time.perf_counter() - stream.opened_at
    s.first = devices
    s.largest = devices.size
    s.start_draining(stream)
    if elapsed > s.limits.fast_within:
        raise CheckWarning(
            f"first message after {_ms(elapsed)}, over {_ms(s.limits.fast_within)}; pods "
            "admitted before it fail with UnexpectedAdmissionError"
        )
    return (
        f"first message after {_ms(elapsed)}: {_n(len(devices.devices), 'device')} "
        f"({len(devices.healthy)} healthy)"
    )


async def _list_size(s: _Subject) -> str:
    first = s.need_list()
    size = max(first.size, s.largest)
    if size > constants.MAX_MESSAGE_BYTES:
        # grpc-go's default receive limit, which the kubelet never raises.
        raise CheckFailed(
            f"a ListAndWatch message is {size} bytes, over the kubelet's 4 MiB receive limit "
            f"({constants.MAX_MESSAGE_BYTES} bytes): the kubelet ends the stream and drops the "
            "resource; split the devices over several resources"
        )
    return f"{first.size} bytes for {_n(len(first.devices), 'device')} (limit 4 MiB)"


async def _ids_unique_valid(s: _Subject) -> str:
    devices = s.need_list().devices
    counts = Counter(d.id for d in devices)
    duplicates = [(i, n) for i, n in counts.items() if n > 1]
    if duplicates:
        device_id, n = duplicates[0]
        # The kubelet does not reject duplicates: it may count one ID twice in capacity.
        raise CheckFailed(
            f"ID {device_id!r} is listed {n} times ({len(duplicates)} duplicated IDs); "
            "IDs must be unique within the resource"
        )
    # The kubelet checks nothing else about IDs; they show in pod status and podresources.
    for device in devices:
        if not device.id:
            raise CheckWarning("a device has an empty ID")
        if not device.id.isprintable():
            raise CheckWarning(f"ID {device.id!r} is not printable")
        if len(device.id) > MAX_ID_LENGTH:
            raise CheckWarning(
                f"ID {device.id[:24]!r}... is {len(device.id)} characters; the API limits IDs "
                f"to {MAX_ID_LENGTH} (the kubelet does not check it)"
            )
    if not devices:
        return "no devices listed (an empty list is valid)"
    return f"{_n(len(devices), 'unique printable ID')}"


async def _health_values(s: _Subject) -> str:
    devices = s.need_list().devices
    for device in devices:
        if device.health not in (constants.HEALTHY, constants.UNHEALTHY):
            # The kubelet compares with the exact string "Healthy"; anything else is unhealthy.
            raise CheckFailed(
                f"device {device.id!r} has health {device.health!r}; only exactly 'Healthy' or "
                "'Unhealthy' (the kubelet treats every other value as unhealthy)"
            )
    healthy = sum(1 for d in devices if d.healthy)
    return f"{healthy} Healthy, {len(devices) - healthy} Unhealthy"


async def _topology_valid(s: _Subject) -> str:
    devices = s.need_list().devices
    # The kubelet stores topology as given; a node that is not a machine's never aligns.
    for device in devices:
        if any(n < 0 for n in device.numa_nodes):
            raise CheckWarning(
                f"device {device.id!r} reports NUMA nodes {list(device.numa_nodes)}; NUMA IDs "
                "are >= 0 (omit topology when unknown): the kubelet never aligns it"
            )
        if len(set(device.numa_nodes)) != len(device.numa_nodes):
            raise CheckWarning(
                f"device {device.id!r} repeats a NUMA node: {list(device.numa_nodes)}"
            )
    with_topology = sum(1 for d in devices if d.numa_nodes)
    return f"{with_topology} of {len(devices)} devices report NUMA nodes"


async def _one_response(client: PluginClient, device_ids: Sequence[str]) -> None:
    """Allocate as the kubelet calls it: one container request, whose response it reads."""
    label = f"Allocate({[list(device_ids)]!r:.80})"
    try:
        responses = await client.allocate(device_ids)
    except ProbeError as exc:
        # Any error fails the pod's admission (UnexpectedAdmissionError).
        raise CheckFailed(f"{label}: {exc}") from None
    _judge_responses(label, responses)


def _judge_responses(label: str, responses: Sequence[object]) -> None:
    """What the kubelet makes of the container responses to one container request."""
    if not responses:
        raise CheckFailed(
            f"{label} answered no container response; the kubelet fails the pod with 'no "
            "containers return in allocation response'"
        )
    if len(responses) > 1:
        raise CheckWarning(
            f"{label} answered {len(responses)} container responses for 1 container request; "
            "the kubelet reads only the first"
        )


async def _allocate_each(s: _Subject) -> str:
    client = s.need_client()
    ids = s.healthy_ids()
    sample = ids[: s.limits.max_devices]
    slowest = 0.0
    for device_id in sample:
        started = time.perf_counter()
        await _one_response(client, [device_id])
        slowest = max(slowest, time.perf_counter() - started)
    shown = "" if len(sample) == len(ids) else f" (first {len(sample)} of {len(ids)})"
    return (
        f"{_n(len(sample), 'device')}{shown}, one container response each, slowest {_ms(slowest)}"
    )


async def _allocate_all(s: _Subject) -> str:
    client = s.need_client()
    ids = s.healthy_ids()
    started = time.perf_counter()
    # Also re-sends IDs already allocated above: Allocate must be idempotent.
    label = f"Allocate({[list(ids)]!r:.80})"
    try:
        responses = await client.allocate(ids)
    except ProbeError as exc:
        if (
            not isinstance(exc, PluginRpcError)
            or exc.code is not grpc.StatusCode.FAILED_PRECONDITION
            or not ids
        ):
            raise CheckFailed(f"{label}: {exc}") from None
        # AllocationError: the plugin refuses this container on purpose. A refusal of the
        # combination (GPU sharing rules, say) costs only such a pod; a refusal of IDs it
        # handed out before would fail init containers: check that one ID alone still goes.
        await _one_response(client, ids[:1])
        raise CheckWarning(
            f"Allocate of all {_n(len(ids), 'healthy device')} in one container is refused "
            f"({exc.details}); each device alone is allocated again, so the refusal is of the "
            "combination (the kubelet fails that pod's admission)"
        ) from None
    _judge_responses(label, responses)
    return (
        f"{_n(len(ids), 'device')} in one container request, one response in "
        f"{_ms(time.perf_counter() - started)}"
    )


async def _allocate_multi(s: _Subject) -> str:
    client = s.need_client()
    ids = s.healthy_ids(at_least=2)[:4]
    label = f"Allocate({[[i] for i in ids]!r:.80})"
    # The kubelet sends one container request per Allocate: other callers may send several.
    try:
        responses = await client.allocate(*[[i] for i in ids])
    except ProbeError as exc:
        raise CheckWarning(f"{label}: {exc} (the kubelet sends one container request)") from None
    if len(responses) != len(ids):
        raise CheckWarning(
            f"{label} answered {len(responses)} container responses for {len(ids)} "
            "container requests; the protocol wants one per request (the kubelet sends one)"
        )
    return f"{len(ids)} container requests, {len(ids)} container responses"


async def _unknown_rejected(s: _Subject) -> str:
    client = s.need_client()
    known = {d.id for d in s.need_list().devices}
    unknown = UNKNOWN_ID
    while unknown in known:
        unknown += "x"
    requests: list[list[str]] = [[unknown]]
    healthy = [d.id for d in s.need_list().healthy]
    if healthy:
        requests.append([healthy[0], unknown])
    codes = []
    for ids in requests:
        try:
            await client.allocate(ids)
        except PluginRpcError as exc:
            if exc.code is grpc.StatusCode.DEADLINE_EXCEEDED:
                raise CheckFailed(f"Allocate({ids!r}) did not answer: {exc.details}") from None
            codes.append(exc.code.name)
            continue
        except ProbeError:
            pass  # answered with a response: accepted
        others = f" next to known ID {ids[0]!r}" if len(ids) > 1 else ""
        # The kubelet only sends IDs it was listed: accepting others hides mistakes elsewhere.
        raise CheckWarning(f"Allocate accepted unknown ID {unknown!r}{others}")
    return f"Allocate rejected unknown IDs with {', '.join(dict.fromkeys(codes))}"


async def _preferred(s: _Subject) -> str:
    options = s.need_options()
    if not options.preferred_allocation:
        raise Skip("not advertised (get_preferred_allocation_available=false)")
    client = s.need_client()
    healthy = s.healthy_ids()
    n = len(healthy)
    cases: list[tuple[list[str], list[str], int]] = [(healthy, [], 1)]
    if n >= 2:
        cases.append((healthy, [healthy[-1]], 2))
    if n >= 3:
        # Leave the first device out of the candidates: naive plugins pick from their own list.
        cases.append((healthy[1:], [healthy[2]], 2))
    cases.append((healthy, [], n))
    warnings: list[str] = []
    empty = 0
    repeats = 0
    for available, must, size in cases:
        label = (
            f"GetPreferredAllocation(size={size}, must_include={must!r}, "
            f"{len(available)} available)"
        )
        try:
            answer = await client.preferred_allocation(available, must, size)
        except ProbeError as exc:
            # The kubelet fails the pod's admission on any GetPreferredAllocation error.
            raise CheckFailed(f"{label}: {exc}") from None
        if not answer:
            empty += 1  # no container response, or no IDs in it: the kubelet chooses
            continue
        repeats += len(set(answer)) != len(answer)
        warnings += _preferred_problems(label, answer, available, must, size)
    if warnings:
        more = f" (and {len(warnings) - 2} more)" if len(warnings) > 2 else ""
        raise CheckWarning(
            "; ".join(warnings[:2]) + more + "; the kubelet keeps only the available IDs and "
            "chooses the rest itself"
        )
    answered = len(cases) - empty
    detail = f"{_n(len(cases), 'request')}"
    if answered:
        detail += (
            f", {answered} answered with exactly the size asked, every must-include ID and "
            "only available IDs"
        )
    if empty:
        detail += (
            f"; note: {empty} got no preference (an empty answer: the kubelet chooses by itself)"
        )
    if repeats:
        detail += f"; note: {repeats} repeated IDs (the kubelet reads a set)"
    return detail


def _preferred_problems(
    label: str, answer: Sequence[str], available: Sequence[str], must: Sequence[str], size: int
) -> list[str]:
    """What of a preferred answer the kubelet would drop or fill up itself."""
    # The kubelet reads the answer as a set, keeps what is available, fills up the rest from
    # the candidates and takes a random subset of too many.
    chosen = list(dict.fromkeys(answer))
    outside = [i for i in chosen if i not in set(available)]
    missing = [i for i in must if i not in chosen]
    problems: list[str] = []
    if outside:
        problems.append(f"{label} returned {outside[0]!r}, which is not available")
    if missing:
        problems.append(f"{label} left out must-include ID {missing[0]!r}")
    if len(chosen) != size:
        problems.append(f"{label} returned {len(chosen)} IDs: {chosen!r:.80}")
    return problems


async def _prestart(s: _Subject) -> str:
    options = s.need_options()
    if not options.pre_start_required:
        raise Skip("not advertised (pre_start_required=false)")
    client = s.need_client()
    ids = s.healthy_ids()[:1]
    started = time.perf_counter()
    # The kubelet's deadline is 30 s and it calls before every container start.
    await client.pre_start_container(ids)
    return f"PreStartContainer({ids!r}) answered in {_ms(time.perf_counter() - started)}"


async def _second_stream(s: _Subject) -> str:
    s.need_list()
    client = await s.connect()
    stream = client.list_and_watch()
    s.keep_open(stream)
    try:
        devices = await stream.next(timeout=s.limits.timeout)
    except TimeoutError:
        raise CheckFailed(
            f"a second concurrent ListAndWatch stream got no message within "
            f"{s.limits.timeout:g} s; streams overlap after a re-registration and every one "
            "must get the full list"
        ) from None
    elapsed = time.perf_counter() - stream.opened_at
    return f"second stream got {_n(len(devices.devices), 'device')} after {_ms(elapsed)}"


async def _stream_stays_open(s: _Subject) -> str:
    s.need_list()
    if s.primary_end is not None:
        # Any end of the stream makes the kubelet mark every device unhealthy.
        raise CheckFailed(f"the first ListAndWatch stream ended: {s.primary_end}")
    assert s.primary is not None
    age = time.perf_counter() - s.primary.opened_at
    return f"first stream still open after {_ms(age)} and {_n(s.updates, 'update')}"


async def _survives_disconnect(s: _Subject) -> str:
    s.need_list()
    # Whether the first stream ended before is stream-stays-open's finding, not this one's.
    was_open = s.primary_end is None
    leaving = await PluginClient.connect(
        s.path, timeout=s.limits.timeout, max_receive_bytes=_MEASURE_LIMIT
    )
    try:
        stream = leaving.list_and_watch()
        await stream.next(timeout=s.limits.timeout)
    except TimeoutError:
        raise CheckFailed(
            f"a new ListAndWatch stream got no message within {s.limits.timeout:g} s"
        ) from None
    finally:
        # Closing the channel mid-stream: the plugin sees the RPC cancelled.
        await leaving.close()
    try:
        client = await s.connect()
        await client.options()
        again = client.list_and_watch()
        s.keep_open(again)
        await again.next(timeout=s.limits.timeout)
    except (ProbeError, TimeoutError) as exc:
        raise CheckFailed(
            f"after a client disconnected mid-stream the plugin stopped serving: "
            f"{exc or 'no ListAndWatch message'}"
        ) from None
    if was_open and s.primary_end is not None:
        raise CheckFailed(
            f"after another client disconnected, the first stream ended: {s.primary_end}"
        )
    return "still serving after a client disconnected mid-stream"


FAIL: tuple[Level, ...] = ("fail",)
WARN: tuple[Level, ...] = ("warn",)
BOTH: tuple[Level, ...] = ("fail", "warn")

CHECKS: tuple[Check[_Subject], ...] = (
    Check(
        "dial",
        "the socket accepts a gRPC connection within the kubelet's 10 s",
        _dial,
        FAIL,
        "dm/plugin/client.go:dial dials once per registration, blocking, for 10 s; a failed "
        "dial fails the Register call (failed to dial device plugin)",
    ),
    Check(
        "options-fast",
        "GetDevicePluginOptions answers, quickly",
        _options_fast,
        BOTH,
        "dm/manager.go:PluginConnected calls it inside Register (dm/plugin/handler.go:"
        "connectClient) with no deadline: an error fails the registration (fail); a slow "
        "answer only delays it (warn)",
    ),
    Check(
        "registration-valid",
        "Register sends v1beta1, a valid resource name, a bare socket name and the same options "
        "as GetDevicePluginOptions",
        _registration_valid,
        BOTH,
        "dm/plugin/server.go:Register refuses another version or an invalid resource name "
        "(fail); it joins any endpoint onto its directory and reads no RegisterRequest.options, "
        "and dm/manager.go:CleanupPluginDirectory skips subdirectories at kubelet start "
        "(warn: the plugin's restart signal and declared options are lost)",
        register_only=True,
    ),
    Check(
        "list-prompt",
        "ListAndWatch sends the full list, promptly",
        _list_prompt,
        BOTH,
        "dm/manager.go:genericDeviceUpdateCallback creates the resource from the first "
        "message; until then dm/manager.go:devicesToAllocate fails every pod asking for it "
        "(cannot allocate unregistered device): never (fail), late (warn)",
    ),
    Check(
        "list-size",
        "every ListAndWatch message fits the kubelet's 4 MiB limit",
        _list_size,
        FAIL,
        "dm/plugin/client.go:Run reads with grpc-go's 4 MiB limit: a larger message ends the "
        "stream and dm/manager.go:PluginDisconnected marks every device unhealthy",
    ),
    Check(
        "ids-unique-valid",
        "device IDs are unique, non-empty, printable, at most 63 chars",
        _ids_unique_valid,
        BOTH,
        "dm/manager.go:genericDeviceUpdateCallback keeps one entry per ID and may count a "
        "duplicate twice in capacity (fail); it checks nothing else about IDs, which end up in "
        "the checkpoint, podresources and pod status (warn)",
    ),
    Check(
        "health-values",
        "health is exactly Healthy or Unhealthy",
        _health_values,
        FAIL,
        "dm/manager.go:genericDeviceUpdateCallback counts a device as healthy only if its "
        "health is exactly 'Healthy': any other string takes it out of allocatable",
    ),
    Check(
        "topology-valid",
        "NUMA node IDs are >= 0 and not repeated",
        _topology_valid,
        WARN,
        "dm/manager.go:genericDeviceUpdateCallback stores topology as given and "
        "dm/manager.go:filterByAffinity matches it against the NUMA hint: a node ID the "
        "machine lacks never aligns (the Topology Manager's intent is lost)",
    ),
    Check(
        "allocate-each-device",
        "Allocate of each healthy device gets one container response",
        _allocate_each,
        BOTH,
        "dm/endpoint.go:allocate sends one container request; dm/manager.go:"
        "allocateContainerResources fails the pod on an error or on no container response "
        "(fail) and reads only the first of several (warn)",
    ),
    Check(
        "allocate-all-healthy",
        "Allocate of all healthy devices (some allocated before) gets one container response",
        _allocate_all,
        BOTH,
        "as allocate-each-device; the kubelet sends IDs again (init containers, re-allocation "
        "after a restart, dm/manager.go:devicesToAllocate), so Allocate must be idempotent "
        "(fail); a FAILED_PRECONDITION refusal of the whole set while each device alone is "
        "allocated again is a deliberate refusal of the combination, such as a sharing rule: "
        "the kubelet fails that pod only (warn)",
    ),
    Check(
        "allocate-multi-container",
        "Allocate with several container requests gets one response per request",
        _allocate_multi,
        WARN,
        "dm/endpoint.go:allocate always sends exactly one container request, so the kubelet "
        "never meets this; the protocol asks for one response per request",
    ),
    Check(
        "unknown-ids-rejected",
        "Allocate of unknown IDs fails with an error",
        _unknown_rejected,
        BOTH,
        "dm/manager.go:devicesToAllocate sends only IDs the plugin listed, so accepting others "
        "costs the kubelet nothing (warn); Allocate has no deadline and admission is serial, so "
        "one that never answers blocks every pod of the node (fail)",
    ),
    Check(
        "preferred-allocation",
        "GetPreferredAllocation answers; with the size asked, every must-include ID, only "
        "available IDs",
        _preferred,
        BOTH,
        "dm/manager.go:callGetPreferredAllocationIfAvailable fails the pod's admission on an "
        "error (fail); it reads an empty answer as no preference, and dm/manager.go:"
        "devicesToAllocate keeps only the available IDs of an answer and fills up the rest "
        "(warn: the plugin's choice is lost)",
    ),
    Check(
        "prestart-answers",
        "PreStartContainer answers when required",
        _prestart,
        FAIL,
        "dm/manager.go:callPreStartContainerIfNeeded calls it before every container start "
        "with a 30 s deadline; an error fails the container's creation",
    ),
    Check(
        "second-stream",
        "a second concurrent ListAndWatch stream is served",
        _second_stream,
        FAIL,
        "dm/plugin/handler.go:runClient opens a stream per registration, and two overlap "
        "after a re-registration (v1.32): a stream without a list leaves the resource stale",
    ),
    Check(
        "stream-stays-open",
        "the plugin never ends a ListAndWatch stream",
        _stream_stays_open,
        FAIL,
        "dm/plugin/client.go:Run takes any end of the stream as the plugin gone: "
        "dm/manager.go:PluginDisconnected marks every device unhealthy and nothing redials",
    ),
    Check(
        "survives-disconnect",
        "the plugin keeps serving after a client disconnects mid-stream",
        _survives_disconnect,
        FAIL,
        "dm/plugin/server.go:Stop cancels every stream when the kubelet stops or restarts; a "
        "plugin that stops serving then cannot register again",
    ),
)

RESTART_CHECK = "reregisters-after-restart"
#: The kubelet behaviour behind the restart check of ``--register-dir`` (fail only).
RESTART_KUBELET = (
    "dm/manager.go:Start runs dm/manager.go:CleanupPluginDirectory, which deletes every plugin "
    "socket, and creates kubelet.sock again; only a new Register brings a resource back"
)


# ------------------------------------------------------------------------------------------ running


async def _run_check(
    check: Check[SubjectT], subject: SubjectT, resource: str | None
) -> CheckResult:
    # Bounds a check that makes many calls; each call has its own deadline too.
    bound = max(subject.limits.timeout, 1.0) * 3
    scope = anyio.CancelScope(deadline=anyio.current_time() + bound)
    try:
        with scope:
            detail = await check.run(subject)
        if scope.cancelled_caught:
            return CheckResult(check.name, "fail", f"did not finish within {bound:g} s", resource)
    except CheckFailed as exc:
        return CheckResult(check.name, "fail", str(exc), resource)
    except CheckWarning as exc:
        return CheckResult(check.name, "warn", str(exc), resource)
    except Skip as exc:
        return CheckResult(check.name, "skip", str(exc), resource)
    except ProbeError as exc:
        return CheckResult(check.name, "fail", str(exc), resource)
    except TimeoutError:
        detail = f"the plugin did not answer within {subject.limits.timeout:g} s"
        return CheckResult(check.name, "fail", detail, resource)
    except Exception as exc:
        return CheckResult(
            check.name, "fail", f"unexpected error: {type(exc).__name__}: {exc}", resource
        )
    return CheckResult(check.name, "pass", detail, resource)


async def _run_suite(
    subject: _Subject, emit: OnResult, *, resource: str | None = None, register: bool = False
) -> None:
    for check in CHECKS:
        if check.register_only and not register:
            continue
        emit(await _run_check(check, subject, resource))


def _emitter(report: ConformanceReport, on_result: OnResult | None) -> OnResult:
    def emit(result: CheckResult) -> None:
        report.results.append(result)
        if on_result is not None:
            on_result(result)

    return emit


async def check_socket(
    path: str | os.PathLike[str],
    limits: Limits | None = None,
    on_result: OnResult | None = None,
) -> ConformanceReport:
    """Run the suite against a plugin serving on ``path`` (registered elsewhere or not).

    Args:
        path: The plugin's unix socket.
        limits: Thresholds and timeouts.
        on_result: Called with each result as soon as it is known (for streaming output).

    Returns:
        The report; ``report.ok`` is the verdict.
    """
    limits = limits or Limits()
    report = ConformanceReport("socket", str(path))
    async with _Subject(Path(path), limits) as subject:
        await _run_suite(subject, _emitter(report, on_result))
    return report


async def check_register_dir(
    directory: str | os.PathLike[str],
    limits: Limits | None = None,
    on_result: OnResult | None = None,
    on_waiting: Callable[[Path], None] | None = None,
) -> ConformanceReport:
    """Act as the kubelet on ``directory``/kubelet.sock and test every plugin that registers.

    Waits for ``limits.expect`` resources to register (then ``limits.settle`` seconds for
    more), runs the suite against each plugin's socket, then restarts the kubelet (directory
    wiped, kubelet.sock recreated) and checks that each plugin registers again.

    Args:
        directory: The device-plugin directory to serve (created if missing; its files are
            deleted, as at kubelet start).
        limits: Thresholds and timeouts.
        on_result: Called with each result as soon as it is known.
        on_waiting: Called once kubelet.sock is served, before waiting for registrations.

    Raises:
        ConformanceError: a live server (a real kubelet?) already answers on kubelet.sock.
    """
    limits = limits or Limits()
    directory = Path(directory)
    socket_path = directory / constants.KUBELET_SOCKET_NAME
    if await anyio.to_thread.run_sync(is_live_socket, socket_path):
        raise ConformanceError(
            f"{socket_path} is served by a live process (a kubelet?); conformance "
            "--register-dir would wipe its directory. Use --socket for a plugin registered there."
        )
    report = ConformanceReport("register-dir", str(directory))
    emit = _emitter(report, on_result)

    async with FakeKubelet(directory=directory) as kubelet:
        if on_waiting is not None:
            on_waiting(kubelet.socket_path)

        def resources() -> list[str]:
            return list(dict.fromkeys(r.resource_name for r in kubelet.registrations))

        try:
            await kubelet.wait_for(
                lambda: len(resources()) >= limits.expect,
                timeout=limits.register_wait,
                what=f"{limits.expect} resource(s) to register",
            )
        except TimeoutError:
            emit(
                CheckResult(
                    "registration-valid",
                    "fail",
                    f"nothing registered on {kubelet.socket_path} within {limits.register_wait:g} s"
                    if not resources()
                    else f"only {len(resources())} resource(s) registered within "
                    f"{limits.register_wait:g} s: {', '.join(resources())}",
                )
            )
            return report
        if limits.settle > 0:
            await anyio.sleep(limits.settle)  # other resources of one process register together
        for resource in resources():
            records = [r for r in kubelet.registrations if r.resource_name == resource]
            # A transient failure (dial before serving) followed by success is judged by the
            # success; a plugin that never succeeded by its last attempt.
            record = next((r for r in reversed(records) if r.error is None), records[-1])
            path = _endpoint_path(kubelet.directory, record.endpoint)
            async with _Subject(path, limits) as subject:
                subject.registration = record
                await _run_suite(subject, emit, resource=resource, register=True)
        emit(await _restart_check(kubelet, resources(), limits))
    return report


def _endpoint_path(directory: Path, endpoint: str) -> Path:
    # The kubelet joins the endpoint onto its directory (filepath.Join) and checks nothing else.
    return Path(os.path.normpath(os.path.join(directory, endpoint.lstrip("/"))))


async def _restart_check(
    kubelet: FakeKubelet, resources: Sequence[str], limits: Limits
) -> CheckResult:
    """Restart the kubelet and time each resource's registration and first list."""
    before = {r: len(kubelet.successful_registrations(r)) for r in resources}
    await kubelet.restart()
    restarted = time.monotonic()
    messages = {r: kubelet.messages(r) for r in resources}
    registered: dict[str, float] = {}
    listed: dict[str, float] = {}

    def progress() -> bool:
        now = time.monotonic()
        for r in resources:
            done = kubelet.successful_registrations(r)
            if r not in registered and len(done) > before[r]:
                registered[r] = done[before[r]].at - restarted
            if r in registered and r not in listed and kubelet.messages(r) > messages[r]:
                listed[r] = now - restarted
        return len(listed) == len(resources)

    try:
        await kubelet.wait_for(progress, timeout=limits.restart_timeout, what="re-registration")
    except TimeoutError:
        late = [r for r in resources if r not in listed]
        detail = "; ".join(
            f"{r} did not register again" if r not in registered else f"{r} sent no list"
            for r in late
        )
        return CheckResult(
            RESTART_CHECK,
            "fail",
            f"{detail} within {limits.restart_timeout:g} s of a kubelet restart (directory "
            "wiped, kubelet.sock recreated); plugins must watch for it and register again",
        )
    parts = [
        f"{r}: registered {_ms(max(registered[r], 0.0))}, first list {_ms(listed[r])}"
        for r in resources
    ]
    return CheckResult(RESTART_CHECK, "pass", "after the kubelet restart " + "; ".join(parts))


# ------------------------------------------------------------------------------------------ DRA

#: The services a kubelet speaks, most recent first (pkg/kubelet/cm/dra/plugin).
_KUBELET_DRA_SERVICES = (constants.DRA_SERVICE_V1, constants.DRA_SERVICE_V1BETA1)
_CONFORMANCE_NAMESPACE = "devplugin-conformance"


class _DraSubject:
    """A DRA kubelet plugin under test: its registration socket (or its DRA socket alone)."""

    def __init__(self, path: Path, limits: Limits) -> None:
        self.path = path
        self.limits = limits
        self.info: PluginInfo | None = None
        self.endpoint: Path | None = None
        self.services: list[str] = []
        self._channel: grpc.aio.Channel | None = None

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()

    async def channel(self) -> grpc.aio.Channel:
        if self.endpoint is None:
            raise Skip("needs the DRA socket (dra-registration failed)")
        if self._channel is None:
            self._channel = grpc.aio.insecure_channel(f"unix:{self.endpoint}")
            if not await _client.ready(self._channel, self.limits.timeout):
                self._channel = None
                raise CheckFailed(
                    f"{self.endpoint} did not accept a connection within {self.limits.timeout:g} s"
                )
        return self._channel

    def need_services(self) -> list[str]:
        if not self.services:
            raise Skip("needs a DRA service the kubelet speaks (dra-registration failed)")
        return self.services


async def _dra_registration(s: _DraSubject) -> str:
    try:
        info = await watcher_registration.get_info(
            s.path, dial_timeout=s.limits.timeout, timeout=s.limits.fast_within
        )
    except TimeoutError:
        raise CheckFailed(
            f"{s.path} did not accept a connection within {s.limits.timeout:g} s"
        ) from None
    except grpc.aio.AioRpcError as exc:
        if exc.code() is grpc.StatusCode.UNIMPLEMENTED:
            # Not a registration socket: test it as the DRA socket itself.
            s.endpoint = s.path
            s.services = list(_KUBELET_DRA_SERVICES)
            raise Skip(
                f"{s.path} serves no registration service; testing it as the DRA socket"
            ) from None
        if exc.code() is grpc.StatusCode.DEADLINE_EXCEEDED:
            raise CheckFailed(
                f"GetInfo took over {s.limits.fast_within:g} s; the kubelet gives it 1 s and "
                "retries the registration with backoff"
            ) from None
        raise CheckFailed(f"GetInfo failed: {exc.code().name}: {exc.details()}") from None
    s.info = info
    problems = await _info_problems(info)
    if problems:
        raise CheckFailed("; ".join(problems))
    spoken = [v for v in info.supported_versions if v in _KUBELET_DRA_SERVICES]
    s.endpoint = Path(info.endpoint)
    s.services = spoken
    notes: list[str] = []
    if constants.DRA_SERVICE_V1 not in spoken:
        notes.append("no v1.DRAPlugin: kubelets from 1.34 fall back to v1beta1")
    elif spoken[0] != constants.DRA_SERVICE_V1:
        notes.append("v1beta1 is listed before v1: the kubelet takes the plugin's first choice")
    if constants.DRA_SERVICE_V1BETA1 not in spoken:
        notes.append("no v1beta1.DRAPlugin: kubelets 1.32 and 1.33 cannot use the driver")
    detail = f"{info.name}: endpoint {info.endpoint}, services {', '.join(spoken)}"
    if notes:
        raise CheckWarning(f"{detail}; {'; '.join(notes)}")
    return detail


async def _info_problems(info: PluginInfo) -> list[str]:
    """Why the kubelet would refuse ``info`` (or could not use the plugin)."""
    problems: list[str] = []
    if info.type != constants.PLUGIN_TYPE_DRA_PLUGIN:
        problems.append(f"type is {info.type!r}, not {constants.PLUGIN_TYPE_DRA_PLUGIN!r}")
    name_problem = _names.driver_name_problem(info.name)
    if name_problem is not None:
        problems.append(f"driver name {info.name!r} is invalid: {name_problem}")
    if not info.endpoint.startswith("/"):
        problems.append(f"endpoint {info.endpoint!r} is not an absolute socket path")
    elif not await anyio.to_thread.run_sync(is_live_socket, Path(info.endpoint)):
        problems.append(f"nothing accepts connections on the endpoint {info.endpoint}")
    spoken = [v for v in info.supported_versions if v in _KUBELET_DRA_SERVICES]
    if not spoken:
        problems.append(
            f"supported versions {list(info.supported_versions)} name no service a kubelet "
            f"speaks ({', '.join(_KUBELET_DRA_SERVICES)})"
        )
    return problems


def _unknown_claim() -> ClaimRef:
    return ClaimRef(_CONFORMANCE_NAMESPACE, str(uuid.uuid4()), f"absent-{uuid.uuid4().hex[:8]}")


async def _dra_services_answer(s: _DraSubject) -> str:
    channel = await s.channel()
    timings = []
    for service in s.need_services():
        started = time.perf_counter()
        try:
            got = await DraClient(channel, service).prepare([], timeout=s.limits.timeout)
        except grpc.aio.AioRpcError as exc:
            raise CheckFailed(
                f"{service} NodePrepareResources with no claims failed: {exc.code().name}: "
                f"{exc.details()}"
            ) from None
        if got:
            raise CheckFailed(f"{service} answered a request for no claims with {sorted(got)}")
        timings.append(f"{service} {_ms(time.perf_counter() - started)}")
    return "answered: " + ", ".join(timings)


async def _dra_prepare_unknown(s: _DraSubject) -> str:
    channel = await s.channel()
    for service in s.need_services():
        claim = _unknown_claim()
        try:
            got = await DraClient(channel, service).prepare([claim], timeout=s.limits.timeout)
        except grpc.aio.AioRpcError as exc:
            if exc.code() is grpc.StatusCode.DEADLINE_EXCEEDED:
                raise CheckFailed(
                    f"{service}: no answer within {s.limits.timeout:g} s (the kubelet waits 45 s "
                    "and fails the pod)"
                ) from None
            raise CheckWarning(
                f"{service}: a claim that cannot be read failed the whole call ({exc.code().name}: "
                f"{exc.details()}); the kubelet then fails every claim of the pod for the driver"
            ) from None
        if set(got) - {claim.uid}:
            raise CheckFailed(
                f"{service}: answered for claims it was not asked about: {sorted(got)}"
            )
        if claim.uid not in got:
            raise CheckFailed(
                f"{service}: no entry for the claim (the kubelet: NodePrepareResources left out "
                "1 claims)"
            )
        if not got[claim.uid].error:
            raise CheckFailed(
                f"{service}: prepared claim {claim} although it does not exist "
                f"({len(got[claim.uid].devices)} devices)"
            )
    return "a claim that does not exist gets its own error, in its own entry"


async def _dra_unprepare_unknown(s: _DraSubject) -> str:
    channel = await s.channel()
    for service in s.need_services():
        claim = _unknown_claim()
        try:
            got = await DraClient(channel, service).unprepare([claim], timeout=s.limits.timeout)
        except grpc.aio.AioRpcError as exc:
            raise CheckFailed(
                f"{service}: unpreparing a claim that was never prepared failed the call "
                f"({exc.code().name}: {exc.details()}); the kubelet retries it and the pod's "
                "cleanup never finishes"
            ) from None
        if claim.uid not in got:
            raise CheckFailed(
                f"{service}: no entry for the claim (the kubelet: NodeUnprepareResources left "
                "out 1 claims)"
            )
        if got[claim.uid]:
            raise CheckFailed(
                f"{service}: unpreparing a claim that was never prepared is an error "
                f"({got[claim.uid]}); it must succeed (the kubelet may ask again after restarts)"
            )
    return "a claim that was never prepared unprepares without error"


async def _dra_concurrent(s: _DraSubject) -> str:
    channel = await s.channel()
    (service, *_) = s.need_services()
    client = DraClient(channel, service)
    claims = [_unknown_claim() for _ in range(4)]
    answered = 0

    async def one(claim: ClaimRef) -> None:
        nonlocal answered
        await client.unprepare([claim], timeout=s.limits.timeout)
        answered += 1

    try:
        async with anyio.create_task_group() as tg:
            for claim in claims:
                tg.start_soon(one, claim)
    except BaseExceptionGroup as group:  # pragma: no cover - reported as the first error
        raise CheckFailed(f"concurrent calls failed: {group.exceptions[0]}") from None
    return f"{answered} concurrent calls answered"


DRA_CHECKS: tuple[Check[_DraSubject], ...] = (
    Check(
        "dra-registration",
        "GetInfo answers within 1 s: type DRAPlugin, a valid driver name, a live absolute "
        "endpoint and services the kubelet speaks (v1 first, v1beta1 too)",
        _dra_registration,
        BOTH,
        "pkg/kubelet/pluginmanager calls GetInfo with a 1 s deadline; pkg/kubelet/cm/dra/plugin "
        "DRAPluginManager.validateSupportedServices takes the first of the plugin's services it "
        "speaks (v1.DRAPlugin from 1.34, v1beta1.DRAPlugin in 1.32) and fails the registration "
        "when there is none (fail); a missing version only shuts out some kubelets (warn)",
    ),
    Check(
        "dra-services-answer",
        "every advertised service answers NodePrepareResources",
        _dra_services_answer,
        FAIL,
        "pkg/kubelet/cm/dra/plugin DRAPlugin.NodePrepareResources calls the chosen service with "
        "a 45 s deadline; UNIMPLEMENTED there fails every pod using the driver",
    ),
    Check(
        "dra-prepare-claims-alone",
        "a claim that cannot be prepared gets an error in its own entry, not a failed call",
        _dra_prepare_unknown,
        BOTH,
        "pkg/kubelet/cm/dra ManagerImpl.prepareResources fails the pod for a missing entry "
        "('left out N claims') or a reported success (fail); a whole-call error fails every "
        "claim of the batch (warn)",
    ),
    Check(
        "dra-unprepare-idempotent",
        "unpreparing a claim that was never prepared succeeds, in its own entry",
        _dra_unprepare_unknown,
        FAIL,
        "pkg/kubelet/cm/dra ManagerImpl.unprepareResources retries until every claim answers "
        "without error, also after kubelet restarts (kubeletplugin: 'it is not an error if this "
        "gets called for a ResourceClaim which is not currently prepared')",
    ),
    Check(
        "dra-concurrent-calls",
        "concurrent calls are all answered",
        _dra_concurrent,
        FAIL,
        "the kubelet's pod workers call the driver for several pods at once",
    ),
)


async def check_dra_socket(
    path: str | os.PathLike[str],
    limits: Limits | None = None,
    on_result: OnResult | None = None,
) -> ConformanceReport:
    """Run the DRA suite against a DRA kubelet plugin.

    Args:
        path: Its registration socket (in ``plugins_registry``), or its DRA socket.
        limits: Thresholds and timeouts (``fast_within`` is GetInfo's deadline).
        on_result: Called with each result as soon as it is known.

    Returns:
        The report; ``report.ok`` is the verdict. Only claims that do not exist are sent, so
        a plugin in service is not disturbed.
    """
    limits = limits or Limits()
    report = ConformanceReport("dra", str(path))
    emit = _emitter(report, on_result)
    subject = _DraSubject(Path(path), limits)
    try:
        for check in DRA_CHECKS:
            emit(await _run_check(check, subject, None))
    finally:
        with anyio.CancelScope(shield=True):
            await subject.close()
    return report
