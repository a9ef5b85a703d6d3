"""Fuzzing the plugin's RPC handlers: generated and malformed requests never crash or hang it.

One plugin is served for the whole module by a FakeKubelet on an event loop in a background
thread (``anyio.from_thread``); hypothesis drives a plain synchronous gRPC client against its
socket, each call with a deadline. Every request gets either a valid answer or a status with
a message; after all of it the plugin is still registered and serving.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar, cast

import anyio.from_thread
import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from devplugin_sdk import Device, DeviceNode, Health, replicate
from devplugin_sdk.api import constants
from devplugin_sdk.api.deviceplugin.v1beta1 import deviceplugin_pb2 as pb
from devplugin_sdk.api.deviceplugin.v1beta1 import deviceplugin_pb2_grpc as pb_grpc
from devplugin_sdk.testing import FakeKubelet, StaticPlugin, serving

RESOURCE = "fuzz.example.com/dev"
DEADLINE = 5.0  # seconds; a handler that hangs fails the test with DEADLINE_EXCEEDED

PHYSICAL = [
    Device(f"g{i}", numa_nodes=(i % 2,), device_nodes=(DeviceNode(f"/dev/g{i}"),)) for i in range(6)
]
# Six physical devices, two shares each, one of them discovered unhealthy.
DEVICES = [*replicate(PHYSICAL, 2), Device("bad0", health=Health.UNHEALTHY)]
KNOWN = [d.id for d in DEVICES]
NODES = {d.id: [n.host_path for n in d.device_nodes] for d in DEVICES}

pytestmark = pytest.mark.timeout(60)

T = TypeVar("T")


class FuzzPlugin(StaticPlugin):
    """Offers every optional hook; its preference is deliberately unreliable."""

    async def preferred_allocation(
        self, available: Sequence[Device], must_include: Sequence[Device], size: int
    ) -> Sequence[str]:
        # Unknown IDs, repeats and too many: the SDK must still answer validly.
        ids = [d.id for d in reversed(available)]
        return ["no-such-device", *ids, *ids[:2]]

    async def pre_start_container(self, devices: Sequence[Device]) -> None:
        return None


@dataclass
class Served:
    """What the module's tests share: the kubelet's view and a client stub."""

    kubelet: FakeKubelet
    portal: anyio.from_thread.BlockingPortal
    stub: pb_grpc.DevicePluginStub
    channel: grpc.Channel


@asynccontextmanager
async def _serve() -> AsyncIterator[FakeKubelet]:
    async with (
        FakeKubelet() as kubelet,
        serving(FuzzPlugin(RESOURCE, DEVICES), settings=kubelet.settings()),
    ):
        await kubelet.wait_for_allocatable(RESOURCE, len(DEVICES) - 1)
        yield kubelet


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    with (
        anyio.from_thread.start_blocking_portal(backend="asyncio") as portal,
        portal.wrap_async_context_manager(_serve()) as kubelet,
    ):
        socket_path = Path(kubelet.directory) / "fuzz.example.com_dev.sock"
        with grpc.insecure_channel(f"unix:{socket_path}") as channel:
            yield Served(kubelet, portal, pb_grpc.DevicePluginStub(channel), channel)


def still_serving(served: Served) -> None:
    """The plugin kept its registration and answers a valid Allocate."""
    kubelet = served.kubelet
    assert served.portal.call(kubelet.is_registered, RESOURCE)
    assert served.portal.call(kubelet.allocatable, RESOURCE) == len(DEVICES) - 1
    request = pb.AllocateRequest(
        container_requests=[pb.ContainerAllocateRequest(devices_ids=["g0::0"])]
    )
    response = served.stub.Allocate(request, timeout=DEADLINE)
    assert [d.host_path for d in response.container_responses[0].devices] == ["/dev/g0"]


def status(exc: grpc.RpcError) -> tuple[grpc.StatusCode, str]:
    """Code and message of a failed synchronous call (its error is also its ``grpc.Call``)."""
    call = cast(grpc.Call, exc)
    return call.code(), call.details() or ""


def outcome(call: Callable[[], T]) -> tuple[T | None, grpc.StatusCode, str]:
    """Run one RPC: its response and OK, or None and the error's status and message."""
    try:
        return call(), grpc.StatusCode.OK, ""
    except grpc.RpcError as exc:
        return (None, *status(exc))


def assert_refused(exc: grpc.RpcError, code: grpc.StatusCode, *fragments: str) -> None:
    got, details = status(exc)
    assert got is code, details
    assert details.strip()
    for fragment in fragments:
        assert fragment in details


# Unknown IDs stay short and few: see the note on large unknown-ID lists in the report.
unknown_ids = st.text(alphabet=st.characters(codec="utf-8"), min_size=0, max_size=12).filter(
    lambda s: s not in KNOWN
)
device_ids = st.one_of(st.sampled_from(KNOWN), unknown_ids)
id_lists = st.lists(
    st.one_of(st.sampled_from(KNOWN), st.sampled_from(KNOWN), unknown_ids), max_size=10
)
sizes = st.one_of(st.integers(-3, len(KNOWN) + 3), st.integers(-(2**31), 2**31 - 1))
fuzz_settings = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def problem_of(ids: Sequence[str]) -> str | None:
    """What the SDK must refuse in one container's ID list, or None if it is valid."""
    if not ids:
        return "has no device IDs"
    if any(n > 1 for n in Counter(ids).values()):
        return "repeats device IDs"
    if any(i not in KNOWN for i in ids):
        return "unknown device IDs"
    return None


@fuzz_settings
@given(containers=st.lists(id_lists, max_size=4))
def test_allocate_answers_every_generated_request_validly_or_with_a_message(
    served: Served, containers: list[list[str]]
) -> None:
    request = pb.AllocateRequest(
        container_requests=[pb.ContainerAllocateRequest(devices_ids=ids) for ids in containers]
    )
    problems = [p for p in map(problem_of, containers) if p is not None]
    response, code, details = outcome(lambda: served.stub.Allocate(request, timeout=DEADLINE))
    if response is None:
        assert code is grpc.StatusCode.INVALID_ARGUMENT, details
        assert (problems[0] if problems else "has no container requests") in details
        return
    assert containers
    assert not problems
    assert len(response.container_responses) == len(containers)
    for ids, answer in zip(containers, response.container_responses, strict=True):
        nodes = list(dict.fromkeys(node for i in ids for node in NODES[i]))
        assert [d.host_path for d in answer.devices] == nodes


@fuzz_settings
@given(
    requests=st.lists(
        st.tuples(st.lists(device_ids, max_size=14), st.lists(device_ids, max_size=6), sizes),
        max_size=3,
    )
)
def test_preferred_allocation_always_answers_a_valid_choice(
    served: Served, requests: list[tuple[list[str], list[str], int]]
) -> None:
    message = pb.PreferredAllocationRequest(
        container_requests=[
            pb.ContainerPreferredAllocationRequest(
                available_deviceIDs=available, must_include_deviceIDs=must, allocation_size=size
            )
            for available, must, size in requests
        ]
    )
    response = served.stub.GetPreferredAllocation(message, timeout=DEADLINE)
    assert len(response.container_responses) == len(requests)
    for (available, must, size), answer in zip(requests, response.container_responses, strict=True):
        chosen = list(answer.deviceIDs)
        candidates = {i for i in [*available, *must] if i in KNOWN}
        known_must = list(dict.fromkeys(i for i in must if i in KNOWN))
        assert len(chosen) == len(set(chosen))
        assert set(chosen) <= candidates
        assert len(chosen) == (min(size, len(candidates)) if size > 0 else 0)
        # Every must-include device is in the answer, or, when they alone exceed the size,
        # the answer is made of them only.
        if len(known_must) <= size:
            assert set(known_must) <= set(chosen)
        else:
            assert set(chosen) <= set(known_must)


@fuzz_settings
@given(ids=id_lists)
def test_pre_start_container_answers_every_generated_request(
    served: Served, ids: list[str]
) -> None:
    problem = problem_of(ids)
    try:
        served.stub.PreStartContainer(
            pb.PreStartContainerRequest(devices_ids=ids), timeout=DEADLINE
        )
    except grpc.RpcError as exc:
        assert problem is not None
        assert_refused(exc, grpc.StatusCode.INVALID_ARGUMENT, problem)
        return
    assert problem is None


def test_empty_requests_are_refused_or_answered_empty(served: Served) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        served.stub.Allocate(pb.AllocateRequest(), timeout=DEADLINE)
    assert_refused(caught.value, grpc.StatusCode.INVALID_ARGUMENT, "no container requests")
    with pytest.raises(grpc.RpcError) as caught:
        served.stub.Allocate(
            pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest()]), timeout=DEADLINE
        )
    assert_refused(
        caught.value, grpc.StatusCode.INVALID_ARGUMENT, "container request 0 has no device IDs"
    )
    with pytest.raises(grpc.RpcError) as caught:
        served.stub.PreStartContainer(pb.PreStartContainerRequest(), timeout=DEADLINE)
    assert_refused(caught.value, grpc.StatusCode.INVALID_ARGUMENT, "no device IDs")
    empty = served.stub.GetPreferredAllocation(pb.PreferredAllocationRequest(), timeout=DEADLINE)
    assert list(empty.container_responses) == []
    options = served.stub.GetDevicePluginOptions(pb.Empty(), timeout=DEADLINE)
    assert options.pre_start_required
    assert options.get_preferred_allocation_available
    still_serving(served)


def test_must_include_larger_than_the_size_is_cut_to_the_size(served: Served) -> None:
    must = ["g3::1", "g1::0", "g5::0", "g2::1"]
    request = pb.ContainerPreferredAllocationRequest(
        available_deviceIDs=KNOWN, must_include_deviceIDs=must, allocation_size=2
    )
    response = served.stub.GetPreferredAllocation(
        pb.PreferredAllocationRequest(container_requests=[request]), timeout=DEADLINE
    )
    assert list(response.container_responses[0].deviceIDs) == ["g3::1", "g1::0"]


def test_duplicate_ids_in_a_huge_request_are_refused_with_a_short_message(served: Served) -> None:
    request = pb.AllocateRequest(
        container_requests=[pb.ContainerAllocateRequest(devices_ids=["g0::0", "g1::1"] * 50_000)]
    )
    with pytest.raises(grpc.RpcError) as caught:
        served.stub.Allocate(request, timeout=DEADLINE)
    assert_refused(
        caught.value, grpc.StatusCode.INVALID_ARGUMENT, "repeats device IDs: g0::0, g1::1"
    )
    still_serving(served)


def test_huge_preference_requests_are_answered(served: Served) -> None:
    request = pb.ContainerPreferredAllocationRequest(
        available_deviceIDs=[*KNOWN, *(f"x{i}" for i in range(20_000))],
        must_include_deviceIDs=["g4::0"],
        allocation_size=3,
    )
    response = served.stub.GetPreferredAllocation(
        pb.PreferredAllocationRequest(container_requests=[request] * 3), timeout=DEADLINE
    )
    for answer in response.container_responses:
        assert answer.deviceIDs[0] == "g4::0"
        assert len(set(answer.deviceIDs)) == 3
    still_serving(served)


def test_a_request_over_the_message_limit_is_refused_by_grpc(served: Served) -> None:
    request = pb.AllocateRequest(
        container_requests=[pb.ContainerAllocateRequest(devices_ids=["g0::0"] * 600_000)]
    )
    assert request.ByteSize() > constants.MAX_MESSAGE_BYTES  # the server's receive limit
    with pytest.raises(grpc.RpcError) as caught:
        served.stub.Allocate(request, timeout=DEADLINE)
    # The status is grpc's own: its code, not its wording, is what a caller can rely on.
    assert_refused(caught.value, grpc.StatusCode.RESOURCE_EXHAUSTED)
    still_serving(served)


@pytest.mark.parametrize(
    "method",
    ["Allocate", "PreStartContainer", "GetPreferredAllocation", "GetDevicePluginOptions"],
)
@pytest.mark.parametrize("payload", [b"\xff\xff\xff\xff", b"\x0a\x05abc", b"\x12"])
def test_bytes_that_are_no_protobuf_get_a_status_with_a_message(
    served: Served, method: str, payload: bytes
) -> None:
    call: grpc.UnaryUnaryMultiCallable[bytes, bytes] = served.channel.unary_unary(
        f"/v1beta1.DevicePlugin/{method}"
    )
    response, code, details = outcome(lambda: call(payload, timeout=DEADLINE))
    # Some of these bytes happen to parse (protobuf skips unknown fields); the rest must get
    # a status with a message at once, not a hang.
    if response is None:
        assert code is not grpc.StatusCode.DEADLINE_EXCEEDED
        assert details.strip()
    still_serving(served)


def test_an_unknown_method_is_unimplemented(served: Served) -> None:
    call: grpc.UnaryUnaryMultiCallable[bytes, bytes] = served.channel.unary_unary(
        "/v1beta1.DevicePlugin/Deallocate"
    )
    with pytest.raises(grpc.RpcError) as caught:
        call(b"", timeout=DEADLINE)
    assert_refused(caught.value, grpc.StatusCode.UNIMPLEMENTED)
    still_serving(served)
