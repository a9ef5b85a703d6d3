"""ListAndWatch: full list on connect and on change, health pushed and polled, limits."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import anyio
import grpc
import pytest
from sdk_helpers import RESOURCE, widgets

from devplugin_sdk import Device, DevicePlugin, Health
from devplugin_sdk.api.deviceplugin.v1beta1 import deviceplugin_pb2 as pb
from devplugin_sdk.api.deviceplugin.v1beta1 import deviceplugin_pb2_grpc as pb_grpc
from devplugin_sdk.testing import FakeKubelet, StaticPlugin, serving


async def test_pushed_unhealthy_device_stays_listed_and_recovers(kubelet: FakeKubelet) -> None:
    """An Unhealthy device keeps its place in capacity and comes back to Healthy."""
    plugin = StaticPlugin(RESOURCE, widgets(3))
    async with serving(plugin, settings=kubelet.settings()):
        await kubelet.wait_for_allocatable(RESOURCE, 3)
        plugin.set_health("w1", Health.UNHEALTHY, "test fault")
        await kubelet.wait_for_health(RESOURCE, "w1", "Unhealthy")
        assert (kubelet.capacity(RESOURCE), kubelet.allocatable(RESOURCE)) == (3, 2)
        plugin.set_health("w1", Health.HEALTHY)
        await kubelet.wait_for_health(RESOURCE, "w1", "Healthy")
        assert kubelet.allocatable(RESOURCE) == 3


async def test_a_parent_event_marks_every_share(kubelet: FakeKubelet) -> None:
    """A health event for a parent applies to all devices that name it as parent."""
    from devplugin_sdk import replicate

    plugin = StaticPlugin(RESOURCE, replicate(widgets(2), 3))
    async with serving(plugin, settings=kubelet.settings()):
        await kubelet.wait_for_allocatable(RESOURCE, 6)
        plugin.set_health("w0", Health.UNHEALTHY)
        await kubelet.wait_for_allocatable(RESOURCE, 3)
        assert {d.id for d in kubelet.devices(RESOURCE).values() if not d.healthy} == {
            "w0::0",
            "w0::1",
            "w0::2",
        }


async def test_rescan_adds_and_removes_devices(kubelet: FakeKubelet) -> None:
    plugin = StaticPlugin(RESOURCE, widgets(2))
    async with serving(plugin, settings=kubelet.settings()):
        await kubelet.wait_for_allocatable(RESOURCE, 2)
        plugin.set_devices(widgets(5))
        await kubelet.wait_for_allocatable(RESOURCE, 5)
        plugin.set_devices(widgets(1))
        await kubelet.wait_for_allocatable(RESOURCE, 1)
        assert set(kubelet.devices(RESOURCE)) == {"w0"}


async def test_unchanged_lists_are_not_resent(kubelet: FakeKubelet) -> None:
    """Every message costs the kubelet a checkpoint write: no message without a change."""
    plugin = StaticPlugin(RESOURCE, widgets(2))
    async with serving(plugin, settings=kubelet.settings()):
        await kubelet.wait_for_allocatable(RESOURCE, 2)
        before = kubelet.messages(RESOURCE)
        plugin.set_devices(widgets(2))  # same devices
        plugin.set_health("w0", Health.HEALTHY)  # already healthy
        # Both handled (the plugin's tasks all wait again); a message either caused is on its way.
        await anyio.wait_all_tasks_blocked()
        plugin.set_health("w1", Health.UNHEALTHY)  # a change: its message comes after any such
        await kubelet.wait_for_health(RESOURCE, "w1", "Unhealthy")
        assert kubelet.messages(RESOURCE) == before + 1


class _Polled(DevicePlugin):
    resource_name = RESOURCE

    def __init__(self) -> None:
        super().__init__()
        self.bad: set[str] = set()
        self.polls = 0

    async def discover(self) -> Sequence[Device]:
        return widgets(3)

    async def check_health(self, devices: Sequence[Device]) -> Mapping[str, Health]:
        self.polls += 1
        return {d.id: Health.UNHEALTHY if d.id in self.bad else Health.HEALTHY for d in devices}


async def test_polled_health_is_reported_and_recovers(kubelet: FakeKubelet) -> None:
    plugin = _Polled()
    async with serving(plugin, settings=kubelet.settings(health_interval=0.05)):
        await kubelet.wait_for_allocatable(RESOURCE, 3)
        plugin.bad = {"w2"}
        await kubelet.wait_for_health(RESOURCE, "w2", "Unhealthy")
        plugin.bad = set()
        await kubelet.wait_for_health(RESOURCE, "w2", "Healthy")


async def test_failing_health_check_keeps_the_plugin_serving(
    kubelet: FakeKubelet, caplog: pytest.LogCaptureFixture
) -> None:
    class Flaky(_Polled):
        async def check_health(self, devices: Sequence[Device]) -> Mapping[str, Health]:
            self.polls += 1
            raise RuntimeError("sensor read failed")

    plugin = Flaky()
    async with serving(plugin, settings=kubelet.settings(health_interval=0.02)):
        await kubelet.wait_for_allocatable(RESOURCE, 3)
        await kubelet.wait_for(lambda: plugin.polls >= 3, what="three polls")
        assert kubelet.allocatable(RESOURCE) == 3
    assert "check_health failed" in caplog.text


async def test_a_failing_watch_is_restarted(
    kubelet: FakeKubelet, caplog: pytest.LogCaptureFixture
) -> None:
    class Crashy(StaticPlugin):
        runs = 0

        async def watch(self):  # type: ignore[no-untyped-def,override]
            type(self).runs += 1
            if type(self).runs == 1:
                raise RuntimeError("event source lost")
            async for event in super().watch():
                yield event

    plugin = Crashy(RESOURCE, widgets(2))
    async with serving(plugin, settings=kubelet.settings()):
        await kubelet.wait_for_allocatable(RESOURCE, 2)
        await kubelet.wait_for(lambda: Crashy.runs >= 2, what="watch restarted")
        plugin.set_health("w0", Health.UNHEALTHY)
        await kubelet.wait_for_allocatable(RESOURCE, 1)
    assert "event source lost" in caplog.text


async def test_concurrent_streams_all_get_every_change(kubelet: FakeKubelet) -> None:
    """Several ListAndWatch streams at once (v1.32 duplicates): all get the full list."""
    plugin = StaticPlugin(RESOURCE, widgets(2))
    async with serving(plugin, settings=kubelet.settings()):
        await kubelet.wait_for_allocatable(RESOURCE, 2)
        async with grpc.aio.insecure_channel(
            f"unix:{kubelet.directory / 'acme.com_widget.sock'}"
        ) as channel:
            stub = pb_grpc.DevicePluginStub(channel)
            streams = [stub.ListAndWatch(pb.Empty()) for _ in range(2)]
            for stream in streams:
                first = await stream.read()
                assert [d.ID for d in first.devices] == ["w0", "w1"]
            plugin.set_health("w1", Health.UNHEALTHY)
            for stream in streams:
                update = await stream.read()
                assert [(d.ID, d.health) for d in update.devices] == [
                    ("w0", "Healthy"),
                    ("w1", "Unhealthy"),
                ]
            for stream in streams:
                stream.cancel()
        # The kubelet's own stream survived the other clients leaving.
        assert kubelet.is_registered(RESOURCE)


async def test_topology_is_sent_only_when_known(kubelet: FakeKubelet) -> None:
    devices = [Device("a", numa_nodes=(1,)), Device("b")]
    async with serving(StaticPlugin(RESOURCE, devices), settings=kubelet.settings()):
        await kubelet.wait_for_allocatable(RESOURCE, 2)
        seen = kubelet.devices(RESOURCE)
        assert seen["a"].numa_nodes == (1,)
        assert seen["b"].numa_nodes == ()


async def test_refuses_to_send_a_list_over_the_kubelets_4mib_limit(
    kubelet: FakeKubelet, caplog: pytest.LogCaptureFixture
) -> None:
    """A message the kubelet would reject is not sent; the log says why and what to do."""
    plugin = StaticPlugin(RESOURCE, widgets(2))
    huge = [Device(f"{'x' * 60}-{i:06d}") for i in range(60_000)]  # about 5 MB encoded
    caplog.set_level(logging.ERROR, "devplugin_sdk")
    async with serving(plugin, settings=kubelet.settings()):
        await kubelet.wait_for_allocatable(RESOURCE, 2)
        plugin.set_devices(huge)
        await kubelet.wait_for(
            lambda: "not sending a ListAndWatch message" in caplog.text, what="the error log"
        )
        assert kubelet.allocatable(RESOURCE) == 2  # the kubelet kept the last valid list
        assert kubelet.is_registered(RESOURCE)  # and the stream is still open
        plugin.set_devices(widgets(3))
        await kubelet.wait_for_allocatable(RESOURCE, 3)
    assert "split it into several resources" in caplog.text


async def test_duplicate_ids_from_discover_are_refused_at_start(kubelet: FakeKubelet) -> None:
    from devplugin_sdk import BackendError

    with pytest.raises(BackendError, match="duplicate ID 'w0'"):
        async with serving(
            StaticPlugin(RESOURCE, [*widgets(1), *widgets(1)]), settings=kubelet.settings()
        ):
            await anyio.sleep_forever()  # discover() refuses them: the block never runs
