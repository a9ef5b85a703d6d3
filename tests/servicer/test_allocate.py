"""Allocate, GetPreferredAllocation and PreStartContainer: mapping, errors, fallbacks, bounds."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import anyio
import anyio.lowlevel
import grpc
import pytest
from sdk_helpers import RESOURCE, widgets

from devplugin_sdk import Allocation, AllocationError, Device, DeviceNode, Mount
from devplugin_sdk.api.deviceplugin.v1beta1 import deviceplugin_pb2 as pb
from devplugin_sdk.api.deviceplugin.v1beta1 import deviceplugin_pb2_grpc as pb_grpc
from devplugin_sdk.testing import (
    AdmissionError,
    ContainerStartError,
    FakeKubelet,
    StaticPlugin,
    serving,
)


def _rich(i: int) -> Device:
    return Device(
        f"w{i}",
        device_nodes=(
            DeviceNode(f"/dev/widget{i}"),
            DeviceNode("/dev/widgetctl", permissions="rwm"),
        ),
        mounts=(Mount("/opt/acme/lib", "/usr/lib/acme", read_only=True),),
        env={"ACME_VISIBLE": f"w{i}"},
        annotations={f"acme.com/w{i}": "1"},
        cdi_devices=(f"acme.com/widget=w{i}",),
    )


async def test_default_allocation_merges_what_devices_declare(kubelet: FakeKubelet) -> None:
    async with serving(
        StaticPlugin(RESOURCE, [_rich(i) for i in range(3)]), settings=kubelet.settings()
    ):
        await kubelet.wait_for_allocatable(RESOURCE, 3)
        got = await kubelet.allocate(RESOURCE, 2)
        a = got.allocation
        nodes = {(n.host_path, n.container_path, n.permissions) for n in a.device_nodes}
        assert nodes == {
            (f"/dev/widget{i[1:]}", f"/dev/widget{i[1:]}", "rw") for i in got.device_ids
        } | {("/dev/widgetctl", "/dev/widgetctl", "rwm")}
        assert a.mounts == (Mount("/opt/acme/lib", "/usr/lib/acme", read_only=True),)
        assert a.env["ACME_VISIBLE"] in got.device_ids
        assert set(a.annotations) == {f"acme.com/{i}" for i in got.device_ids}
        assert set(a.cdi_devices) == {f"acme.com/widget={i}" for i in got.device_ids}
        assert kubelet.allocatable(RESOURCE) == 3  # allocation does not change health


async def _stub(kubelet: FakeKubelet) -> tuple[grpc.aio.Channel, pb_grpc.DevicePluginAsyncStub]:
    channel = grpc.aio.insecure_channel(f"unix:{kubelet.directory / 'acme.com_widget.sock'}")
    return channel, pb_grpc.DevicePluginStub(channel)  # type: ignore[return-value]


async def test_unknown_ids_get_invalid_argument_naming_them(kubelet: FakeKubelet) -> None:
    async with serving(StaticPlugin(RESOURCE, widgets(2)), settings=kubelet.settings()):
        await kubelet.wait_for_allocatable(RESOURCE, 2)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await kubelet.call_allocate(RESOURCE, ["w0", "gpu-9", "nope"])
        assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details() == "acme.com/widget: unknown device IDs: gpu-9, nope"


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (pb.AllocateRequest(), "AllocateRequest has no container requests"),
        (
            pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest()]),
            "container request 0 has no device IDs",
        ),
        (
            pb.AllocateRequest(
                container_requests=[pb.ContainerAllocateRequest(devices_ids=["w0", "w0"])]
            ),
            "container request 0 repeats device IDs: w0",
        ),
    ],
)
async def test_malformed_requests_get_invalid_argument(
    kubelet: FakeKubelet, request_: pb.AllocateRequest, message: str
) -> None:
    async with serving(StaticPlugin(RESOURCE, widgets(2)), settings=kubelet.settings()):
        await kubelet.wait_for_allocatable(RESOURCE, 2)
        channel, stub = await _stub(kubelet)
        async with channel:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Allocate(request_)
        assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details() == message


async def test_one_container_response_per_container_request(kubelet: FakeKubelet) -> None:
    async with serving(StaticPlugin(RESOURCE, widgets(3)), settings=kubelet.settings()):
        await kubelet.wait_for_allocatable(RESOURCE, 3)
        channel, stub = await _stub(kubelet)
        async with channel:
            response = await stub.Allocate(
                pb.AllocateRequest(
                    container_requests=[
                        pb.ContainerAllocateRequest(devices_ids=["w2"]),
                        pb.ContainerAllocateRequest(devices_ids=["w0", "w1"]),
                    ]
                )
            )
        assert [[d.host_path for d in r.devices] for r in response.container_responses] == [
            ["/dev/widget2"],
            ["/dev/widget0", "/dev/widget1"],
        ]


class _Failing(StaticPlugin):
    mode = "crash"

    async def allocate(self, devices: Sequence[Device]) -> Allocation:
        if self.mode == "crash":
            raise RuntimeError("driver ioctl failed")
        if self.mode == "refuse":
            raise AllocationError("widget firmware is updating")
        if self.mode == "hang":
            await anyio.sleep(60)
        return await super().allocate(devices)


async def test_backend_exception_becomes_an_error_and_the_plugin_keeps_serving(
    kubelet: FakeKubelet,
) -> None:
    plugin = _Failing(RESOURCE, widgets(2))
    async with serving(plugin, settings=kubelet.settings(hook_timeout=0.2)):
        await kubelet.wait_for_allocatable(RESOURCE, 2)
        with pytest.raises(
            AdmissionError, match=r"code = Internal desc = .*RuntimeError: driver ioctl failed"
        ):
            await kubelet.allocate(RESOURCE, 1)
        plugin.mode = "refuse"
        with pytest.raises(
            AdmissionError, match="code = FailedPrecondition desc = widget firmware is updating"
        ):
            await kubelet.allocate(RESOURCE, 1)
        plugin.mode = "hang"
        with pytest.raises(
            AdmissionError, match=r"code = DeadlineExceeded desc = .*allocate did not finish"
        ):
            await kubelet.allocate(RESOURCE, 1)
        plugin.mode = "ok"
        got = await kubelet.allocate(RESOURCE, 2)
        assert len(got.device_ids) == 2
        assert kubelet.is_registered(RESOURCE)


class _Preferring(StaticPlugin):
    answer: Sequence[str] | Exception = ()
    calls: list[tuple[list[str], list[str], int]]

    async def preferred_allocation(
        self, available: Sequence[Device], must_include: Sequence[Device], size: int
    ) -> Sequence[str]:
        self.calls.append(([d.id for d in available], [d.id for d in must_include], size))
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


async def _prefer(
    kubelet: FakeKubelet, available: list[str], must: list[str], size: int
) -> list[str]:
    channel, stub = await _stub(kubelet)
    async with channel:
        response = await stub.GetPreferredAllocation(
            pb.PreferredAllocationRequest(
                container_requests=[
                    pb.ContainerPreferredAllocationRequest(
                        available_deviceIDs=available,
                        must_include_deviceIDs=must,
                        allocation_size=size,
                    )
                ]
            )
        )
    return list(response.container_responses[0].deviceIDs)


async def test_preferred_allocation_is_used_by_the_kubelet(kubelet: FakeKubelet) -> None:
    plugin = _Preferring(RESOURCE, widgets(4))
    plugin.calls = []
    plugin.answer = ["w3", "w1"]
    async with serving(plugin, settings=kubelet.settings()):
        await kubelet.wait_for_allocatable(RESOURCE, 4)
        got = await kubelet.allocate(RESOURCE, 2)
        assert got.device_ids == ("w1", "w3")
        assert got.preferred == ("w3", "w1")
        assert sorted(plugin.calls[0][0]) == ["w0", "w1", "w2", "w3"]


async def test_failing_preferred_allocation_falls_back_to_a_valid_choice(
    kubelet: FakeKubelet, caplog: pytest.LogCaptureFixture
) -> None:
    """The kubelet fails the pod on any error: answer must-include first, then available."""
    plugin = _Preferring(RESOURCE, widgets(4))
    plugin.calls = []
    plugin.answer = RuntimeError("topology unknown")
    async with serving(plugin, settings=kubelet.settings()):
        await kubelet.wait_for_allocatable(RESOURCE, 4)
        assert await _prefer(kubelet, ["w0", "w1", "w2", "w3"], ["w2"], 2) == ["w2", "w0"]
        got = await kubelet.allocate(RESOURCE, 3)
        assert len(got.device_ids) == 3
    assert "preferred_allocation failed (RuntimeError: topology unknown)" in caplog.text


async def test_preferred_answer_is_made_valid(kubelet: FakeKubelet) -> None:
    """Unknown, unavailable and duplicate IDs are dropped; must-include added; size honoured."""
    plugin = _Preferring(RESOURCE, widgets(5))
    plugin.calls = []
    plugin.answer = ["nope", "w4", "w4", "w0", "w1", "w3"]
    async with serving(plugin, settings=kubelet.settings()):
        await kubelet.wait_for_allocatable(RESOURCE, 5)
        assert await _prefer(kubelet, ["w0", "w1", "w2", "w3"], ["w2"], 3) == ["w2", "w0", "w1"]
        # must-include larger than the size, size 0, unknown IDs: still an answer, not an error
        assert await _prefer(kubelet, ["w0", "w1"], ["w0", "w1"], 1) == ["w0"]
        assert await _prefer(kubelet, ["w0"], [], 0) == []
        assert await _prefer(kubelet, ["x", "y"], [], 2) == []


async def test_hanging_preferred_allocation_is_bounded(kubelet: FakeKubelet) -> None:
    class Slow(_Preferring):
        async def preferred_allocation(
            self, available: Sequence[Device], must_include: Sequence[Device], size: int
        ) -> Sequence[str]:
            await anyio.sleep(60)
            return []

    plugin = Slow(RESOURCE, widgets(3))
    async with serving(plugin, settings=kubelet.settings(hook_timeout=0.1)):
        await kubelet.wait_for_allocatable(RESOURCE, 3)
        assert await _prefer(kubelet, ["w0", "w1", "w2"], [], 2) == ["w0", "w1"]


class _PreStart(StaticPlugin):
    seen: list[list[str]]
    delay = 0.0
    fail = False

    async def pre_start_container(self, devices: Sequence[Device]) -> None:
        self.seen.append(sorted(d.id for d in devices))
        await anyio.sleep(self.delay)
        if self.fail:
            raise AllocationError("widget reset failed")


async def test_prestart_is_called_on_every_container_start(kubelet: FakeKubelet) -> None:
    plugin = _PreStart(RESOURCE, widgets(3))
    plugin.seen = []
    async with serving(plugin, settings=kubelet.settings()):
        await kubelet.wait_for_allocatable(RESOURCE, 3)
        got = await kubelet.allocate(RESOURCE, 2)
        await kubelet.start_container(got)  # a container restart
        assert plugin.seen == [list(got.device_ids), list(got.device_ids)]


async def test_prestart_failure_and_hang_fail_container_start(kubelet: FakeKubelet) -> None:
    plugin = _PreStart(RESOURCE, widgets(3))
    plugin.seen = []
    async with serving(plugin, settings=kubelet.settings(prestart_timeout=0.2)):
        await kubelet.wait_for_allocatable(RESOURCE, 3)
        plugin.fail = True
        with pytest.raises(ContainerStartError, match="widget reset failed"):
            await kubelet.allocate(RESOURCE, 1)
        plugin.fail, plugin.delay = False, 60
        with pytest.raises(
            ContainerStartError, match=r"pre_start_container did not finish within 0.2s"
        ):
            await kubelet.allocate(RESOURCE, 1)


async def test_allocation_after_a_device_fails_skips_it(kubelet: FakeKubelet) -> None:
    """One failed device never breaks allocation of the others."""
    plugin = StaticPlugin(RESOURCE, widgets(3))
    async with serving(plugin, settings=kubelet.settings()):
        await kubelet.wait_for_allocatable(RESOURCE, 3)
        plugin.set_health("w1", "Unhealthy")
        await kubelet.wait_for_allocatable(RESOURCE, 2)
        got = await kubelet.allocate(RESOURCE, 2)
        assert got.device_ids == ("w0", "w2")
        with pytest.raises(AdmissionError, match="Requested: 1, Available: 0"):
            await kubelet.allocate(RESOURCE, 1)


async def test_thousands_of_unknown_ids_get_a_short_invalid_argument(kubelet: FakeKubelet) -> None:
    """An error status travels in metadata (about 16 KiB): the list of IDs is capped."""
    async with serving(StaticPlugin(RESOURCE, widgets(2)), settings=kubelet.settings()):
        await kubelet.wait_for_allocatable(RESOURCE, 2)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await kubelet.call_allocate(RESOURCE, [f"gpu-{i:04d}" for i in range(3000)])
        assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details().endswith("and 2990 more")
        assert "gpu-0000, gpu-0001" in info.value.details()


async def test_bytes_that_are_not_protobuf_get_invalid_argument(kubelet: FakeKubelet) -> None:
    async with serving(StaticPlugin(RESOURCE, widgets(2)), settings=kubelet.settings()):
        await kubelet.wait_for_allocatable(RESOURCE, 2)
        async with grpc.aio.insecure_channel(
            f"unix:{kubelet.directory / 'acme.com_widget.sock'}"
        ) as channel:
            raw = channel.unary_unary("/v1beta1.DevicePlugin/Allocate")
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await raw(b"\xff\xff\xff\xff")
        assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "not a valid protobuf message" in (info.value.details() or "")
        assert kubelet.is_registered(RESOURCE)


class _Suspending(StaticPlugin):
    """An ``allocate`` that suspends in the ways real backends do, recording what it saw."""

    how = "sleep"
    outcome: list[str]

    def __init__(self, resource_name: str, devices: Sequence[Device]) -> None:
        super().__init__(resource_name, devices)
        self.outcome = []
        self.release = threading.Event()

    async def allocate(self, devices: Sequence[Device]) -> Allocation:
        try:
            if self.how == "thread":
                # Enters a cancel scope of anyio's before it suspends.
                await anyio.to_thread.run_sync(lambda: None)
            elif self.how == "task group":
                async with anyio.create_task_group() as tg:
                    tg.start_soon(anyio.sleep, 0.01)
            elif self.how == "refuse after suspending":
                await anyio.lowlevel.checkpoint()
                self._refuse()
            elif self.how == "stuck thread":
                await anyio.to_thread.run_sync(self.release.wait)
            elif self.how == "hang":
                await anyio.sleep_forever()
            else:
                await anyio.sleep(0.01)
        except BaseException as exc:
            self.outcome.append(type(exc).__name__)
            raise
        self.outcome.append("done")
        return Allocation.merge(devices)

    def _refuse(self) -> None:
        raise AllocationError("widget busy")


@pytest.mark.parametrize("how", ["sleep", "thread", "task group"])
async def test_an_allocate_hook_that_suspends_is_awaited_to_its_answer(
    kubelet: FakeKubelet, how: str
) -> None:
    """Hooks that suspend (in a thread, a task group) finish as if awaited directly."""
    plugin = _Suspending(RESOURCE, widgets(2))
    plugin.how = how
    async with serving(plugin, settings=kubelet.settings()):
        await kubelet.wait_for_allocatable(RESOURCE, 2)
        for _ in range(3):
            allocation = await kubelet.call_allocate(RESOURCE, ["w1"])
            assert [n.host_path for n in allocation.device_nodes] == ["/dev/widget1"]
    assert plugin.outcome == ["done"] * 3


async def test_an_allocate_hook_failing_after_it_suspended_gets_its_status(
    kubelet: FakeKubelet,
) -> None:
    plugin = _Suspending(RESOURCE, widgets(2))
    plugin.how = "refuse after suspending"
    async with serving(plugin, settings=kubelet.settings()):
        await kubelet.wait_for_allocatable(RESOURCE, 2)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await kubelet.call_allocate(RESOURCE, ["w0"])
        assert info.value.code() is grpc.StatusCode.FAILED_PRECONDITION
        assert info.value.details() == "widget busy"
        assert plugin.outcome == ["AllocationError"]


@pytest.mark.parametrize("how", ["hang", "stuck thread"])
async def test_a_suspended_allocate_hook_is_cut_off_at_its_bound(
    kubelet: FakeKubelet, how: str
) -> None:
    """The bound cancels the hook where it waits (a thread it waits on included), and the
    plugin answers the next call."""
    plugin = _Suspending(RESOURCE, widgets(2))
    plugin.how = how
    try:
        async with serving(plugin, settings=kubelet.settings(hook_timeout=0.2)):
            await kubelet.wait_for_allocatable(RESOURCE, 2)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await kubelet.call_allocate(RESOURCE, ["w0"])
            assert info.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
            assert info.value.details() == "acme.com/widget: allocate did not finish within 0.2s"
            assert plugin.outcome == ["CancelledError"]
            plugin.how = "sleep"
            allocation = await kubelet.call_allocate(RESOURCE, ["w1"])
            assert [n.host_path for n in allocation.device_nodes] == ["/dev/widget1"]
    finally:
        plugin.release.set()


async def test_a_call_cancelled_by_the_kubelet_cancels_its_hook(kubelet: FakeKubelet) -> None:
    """The kubelet giving up (its deadline, its connection closing) reaches the hook as a
    cancellation, not as the hook's own timeout; serving goes on."""
    plugin = _Suspending(RESOURCE, widgets(2))
    plugin.how = "hang"
    async with serving(plugin, settings=kubelet.settings()):
        await kubelet.wait_for_allocatable(RESOURCE, 2)
        channel, stub = await _stub(kubelet)
        async with channel:
            request = pb.AllocateRequest(
                container_requests=[pb.ContainerAllocateRequest(devices_ids=["w0"])]
            )
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Allocate(request, timeout=0.2)
            assert info.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
            await kubelet.wait_for(lambda: plugin.outcome == ["CancelledError"], 5, "the hook")
            plugin.how = "sleep"
            allocation = await kubelet.call_allocate(RESOURCE, ["w1"])
            assert [n.host_path for n in allocation.device_nodes] == ["/dev/widget1"]


async def test_default_allocation_follows_a_rescan(kubelet: FakeKubelet) -> None:
    """The default allocate's answers are kept per set of IDs until a device changes."""
    plugin = StaticPlugin(RESOURCE, widgets(2))
    async with serving(plugin, settings=kubelet.settings()):
        await kubelet.wait_for_allocatable(RESOURCE, 2)
        before = await kubelet.call_allocate(RESOURCE, ["w0", "w1"])
        assert [n.host_path for n in before.device_nodes] == ["/dev/widget0", "/dev/widget1"]
        plugin.set_devices([Device("w0", device_nodes=(DeviceNode("/dev/widget-new"),))])
        await kubelet.wait_for(lambda: kubelet.capacity(RESOURCE) == 1, 5, "the rescan")
        after = await kubelet.call_allocate(RESOURCE, ["w0"])
        assert [n.host_path for n in after.device_nodes] == ["/dev/widget-new"]
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await kubelet.call_allocate(RESOURCE, ["w0", "w1"])
        assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details() == "acme.com/widget: unknown device IDs: w1"


async def test_allocating_an_unhealthy_device_is_answered_and_logged(
    kubelet: FakeKubelet, caplog: pytest.LogCaptureFixture
) -> None:
    plugin = StaticPlugin(RESOURCE, widgets(2))
    async with serving(plugin, settings=kubelet.settings()):
        await kubelet.wait_for_allocatable(RESOURCE, 2)
        await kubelet.call_allocate(RESOURCE, ["w1"])  # cached while w1 is healthy
        plugin.set_health("w1", "Unhealthy")
        await kubelet.wait_for_allocatable(RESOURCE, 1)
        allocation = await kubelet.call_allocate(RESOURCE, ["w1"])
        assert [n.host_path for n in allocation.device_nodes] == ["/dev/widget1"]
    assert "allocating unhealthy device w1" in caplog.text
