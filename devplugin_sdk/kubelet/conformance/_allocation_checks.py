"""The device-plugin checks of admission: Allocate as the kubelet calls it (and as others may),
GetPreferredAllocation and PreStartContainer, judged by what the kubelet makes of the answers."""

from __future__ import annotations

import time
from collections.abc import Sequence

import grpc

from devplugin_sdk.kubelet.conformance._report import (
    BOTH,
    FAIL,
    WARN,
    Check,
    CheckFailed,
    CheckWarning,
    Skip,
    ms,
    plural,
)
from devplugin_sdk.kubelet.conformance._subject import Subject
from devplugin_sdk.kubelet.probe import PluginClient, PluginRpcError, ProbeError

__all__ = ["ALLOCATION_CHECKS", "UNKNOWN_ID"]

UNKNOWN_ID = "conformance-unknown-1"


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


async def _allocate_each(s: Subject) -> str:
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
        f"{plural(len(sample), 'device')}{shown}, one container response each, "
        f"slowest {ms(slowest)}"
    )


async def _allocate_all(s: Subject) -> str:
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
            f"Allocate of all {plural(len(ids), 'healthy device')} in one container is refused "
            f"({exc.details}); each device alone is allocated again, so the refusal is of the "
            "combination (the kubelet fails that pod's admission)"
        ) from None
    _judge_responses(label, responses)
    return (
        f"{plural(len(ids), 'device')} in one container request, one response in "
        f"{ms(time.perf_counter() - started)}"
    )


async def _allocate_multi(s: Subject) -> str:
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


async def _unknown_rejected(s: Subject) -> str:
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


async def _preferred(s: Subject) -> str:
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
    detail = f"{plural(len(cases), 'request')}"
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


async def _prestart(s: Subject) -> str:
    options = s.need_options()
    if not options.pre_start_required:
        raise Skip("not advertised (pre_start_required=false)")
    client = s.need_client()
    ids = s.healthy_ids()[:1]
    started = time.perf_counter()
    # The kubelet's deadline is 30 s and it calls before every container start.
    await client.pre_start_container(ids)
    return f"PreStartContainer({ids!r}) answered in {ms(time.perf_counter() - started)}"


ALLOCATION_CHECKS: tuple[Check[Subject], ...] = (
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
)
