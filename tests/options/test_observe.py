"""The observer hook and plugin status that metrics and /healthz are built on."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from sdk_helpers import RESOURCE, widgets

from devplugin_sdk import Allocation, Device, Health
from devplugin_sdk.testing import AdmissionError, FakeKubelet, StaticPlugin
from devplugin_sdk.testing import serving as _serving


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[object, ...]] = []

    def registered(self, resource: str, seconds: float) -> None:
        self.events.append(("registered", resource))

    def reregistering(self, resource: str, reason: str) -> None:
        self.events.append(("reregistering", resource, reason))

    def list_sent(self, resource: str, healthy: int, unhealthy: int) -> None:
        self.events.append(("list_sent", resource, healthy, unhealthy))

    def allocation(self, resource: str, seconds: float, error: str | None) -> None:
        self.events.append(("allocation", resource, error))


class _Refusing(StaticPlugin):
    refuse = False

    async def allocate(self, devices: Sequence[Device]) -> Allocation:
        if self.refuse:
            raise RuntimeError("boom")
        return await super().allocate(devices)


async def test_observer_sees_registrations_lists_and_allocations(kubelet: FakeKubelet) -> None:
    recorder = Recorder()
    plugin = _Refusing(RESOURCE, widgets(2))
    async with _serving(plugin, settings=kubelet.settings(), observer=recorder):
        await kubelet.wait_for_allocatable(RESOURCE, 2)
        plugin.set_health("w1", Health.UNHEALTHY)
        await kubelet.wait_for_allocatable(RESOURCE, 1)
        kubelet.release(await kubelet.allocate(RESOURCE, 1))
        plugin.refuse = True
        with pytest.raises(AdmissionError, match="boom"):
            await kubelet.allocate(RESOURCE, 1, pod="p2")
        await kubelet.restart()
        await kubelet.wait_for_registrations(RESOURCE, 2)
        await kubelet.wait_for_allocatable(RESOURCE, 1)
    assert ("registered", RESOURCE) in recorder.events
    assert ("list_sent", RESOURCE, 2, 0) in recorder.events
    assert ("list_sent", RESOURCE, 1, 1) in recorder.events
    assert ("allocation", RESOURCE, None) in recorder.events
    assert ("allocation", RESOURCE, "INTERNAL") in recorder.events
    assert any(e[0] == "reregistering" and "kubelet restart" in str(e[2]) for e in recorder.events)


async def test_status_reports_registration_and_device_counts(kubelet: FakeKubelet) -> None:
    plugin = StaticPlugin(RESOURCE, widgets(3))
    async with _serving(plugin, settings=kubelet.settings()) as running:
        await kubelet.wait_for_allocatable(RESOURCE, 3)
        plugin.set_health("w0", Health.UNHEALTHY)
        await kubelet.wait_for_allocatable(RESOURCE, 2)
        (status,) = running.statuses()
        assert status.resource == RESOURCE
        assert status.registered
        assert status.streams == 1
        assert status.pending_seconds == 0
        assert status.devices == {"Healthy": 2, "Unhealthy": 1}
        await kubelet.stop()
        await kubelet.wait_for(
            lambda: not running.statuses()[0].registered, what="unregistered status"
        )


def test_pending_time_keeps_growing_while_the_kubelets_stream_lags_behind_changes() -> None:
    """The kubelet's stream that never sends looks stuck even if the devices keep changing: the
    pending time counts from the oldest version it has not sent, not from the newest change.
    Another client's stream, however far behind, never counts."""
    from devplugin_sdk._engine.served import pending_seconds
    from devplugin_sdk._engine.state import DeviceState
    from devplugin_sdk._engine.streams import Streams

    now = [100.0]
    state = DeviceState(RESOURCE, clock=lambda: now[0])
    streams = Streams(RESOURCE, on_change=lambda: None)
    state.set_devices(widgets(2))  # version 1, at 100
    other = streams.opened()  # a client's stream (devplugin probe --watch), never reads
    streams.expect_kubelet()  # a registration starts
    streams.options_requested()  # the kubelet dials back
    kubelet = streams.opened()
    assert streams.kubelet == kubelet
    now[0] = 110.0
    assert pending_seconds(state, streams) == 10.0  # the kubelet's has sent nothing since 100
    state.set_devices(widgets(3))  # version 2, at 110
    now[0] = 130.0
    assert pending_seconds(state, streams) == 30.0  # still counted from 100, not from 110
    streams.sent(kubelet, state.version)
    assert pending_seconds(state, streams) == 0.0  # the other stream sent nothing: no matter
    streams.ended(kubelet)
    assert pending_seconds(state, streams) == 0.0
    assert streams.kubelet is None
    assert streams.lost_since is not None
    streams.ended(other)
