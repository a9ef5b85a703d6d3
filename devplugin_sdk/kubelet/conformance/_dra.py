"""The DRA suite (``DRA_CHECKS``, ``check_dra_socket``): a DRA kubelet plugin's registration
and its DRAPlugin services, judged as the kubelet's DRA manager uses them; only claims that do not
exist are sent, so a plugin in service is not disturbed."""

from __future__ import annotations

import os
import sys
import time
import uuid
from pathlib import Path

import anyio
import grpc

from devplugin_sdk import _names
from devplugin_sdk._limits import Limits
from devplugin_sdk._wire import client as _client
from devplugin_sdk._wire import watcher_registration
from devplugin_sdk._wire.dra_health import DraHealthClient
from devplugin_sdk._wire.dra_model import ClaimRef
from devplugin_sdk._wire.dra_service import DraClient
from devplugin_sdk._wire.server import is_live_socket
from devplugin_sdk._wire.watcher_registration import PluginInfo
from devplugin_sdk.api import constants
from devplugin_sdk.kubelet.conformance._report import (
    BOTH,
    FAIL,
    Check,
    CheckFailed,
    CheckWarning,
    ConformanceReport,
    OnResult,
    Skip,
    emitter,
    ms,
    run_check,
)

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup

__all__ = ["DRA_CHECKS", "check_dra_socket"]

#: The services a kubelet speaks, most recent first (pkg/kubelet/cm/dra/plugin).
_KUBELET_DRA_SERVICES = (constants.DRA_SERVICE_V1, constants.DRA_SERVICE_V1BETA1)
_HEALTH_SERVICES = (constants.DRA_HEALTH_SERVICE_V1, constants.DRA_HEALTH_SERVICE_V1ALPHA1)
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
        timings.append(f"{service} {ms(time.perf_counter() - started)}")
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


async def _dra_health_stream(s: _DraSubject) -> str:
    if s.info is None or not s.services:
        raise Skip("needs GetInfo's service list (dra-registration failed)")
    listed = [v for v in s.info.supported_versions if v in _HEALTH_SERVICES]
    if not listed:
        raise CheckWarning(
            "no DRAResourceHealth service listed: pods' allocatedResourcesStatus shows no device "
            "health, and a 1.34.0/1.34.1 kubelet's idle connection can deadlock"
        )
    channel = await s.channel()
    said = []
    for service in listed:
        started = time.perf_counter()
        stream = DraHealthClient(channel, service).watch()
        try:
            with anyio.fail_after(s.limits.fast_within):
                first = await stream.__anext__()
        except TimeoutError:
            raise CheckFailed(
                f"{service}: no message within {s.limits.fast_within:g} s of opening the stream"
            ) from None
        except StopAsyncIteration:
            raise CheckFailed(f"{service}: the stream ended without a message") from None
        except grpc.aio.AioRpcError as exc:
            raise CheckFailed(f"{service}: {exc.code().name}: {exc.details()}") from None
        finally:
            await stream.aclose()  # type: ignore[attr-defined]
        unknown = [d.device for d in first if d.health == "UNKNOWN"]
        said.append(
            f"{service} {len(first)} devices in {ms(time.perf_counter() - started)}"
            + (f" ({len(unknown)} UNKNOWN)" if unknown else "")
        )
    return "first message: " + ", ".join(said)


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
        "dra-health-stream",
        "each listed DRAResourceHealth service streams every device's health at once",
        _dra_health_stream,
        BOTH,
        "pkg/kubelet/cm/dra/plugin opens NodeWatchResources (v1 preferred over v1alpha1) after "
        "registration and retries it every 5 s; healthinfo.go reads a device unheard of for 30 s "
        "as Unknown (fail: a listed service that does not stream; warn: none listed)",
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
    emit = emitter(report, on_result)
    subject = _DraSubject(Path(path), limits)
    try:
        for check in DRA_CHECKS:
            emit(await run_check(check, subject, None))
    finally:
        with anyio.CancelScope(shield=True):
            await subject.close()
    return report
