"""Backends that raise, hang or answer nonsense in every hook: the plugin keeps serving.

Errors in RPC hooks reach the kubelet as a status whose message carries the backend's; errors
in background hooks (discovery on rescan, polled health, the event source) are logged with
their message while the previous state stays in force.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Mapping, Sequence

import anyio
import pytest

from devplugin_sdk import (
    Allocation,
    AllocationError,
    BackendError,
    Device,
    DeviceNode,
    Health,
    RescanEvent,
)
from devplugin_sdk.testing import (
    AdmissionError,
    ContainerStartError,
    FakeKubelet,
    StaticPlugin,
    serving,
)
from devplugin_sdk.types import HealthEvent

RESOURCE = "reliability.example.com/dev"

pytestmark = pytest.mark.timeout(60)


def widgets(count: int = 4) -> list[Device]:
    return [Device(f"d{i}", device_nodes=(DeviceNode(f"/dev/d{i}"),)) for i in range(count)]


class FaultyPlugin(StaticPlugin):
    """Every hook raises ``failure`` (or hangs) while its name is in ``failing``."""

    def __init__(self, devices: Sequence[Device] | None = None) -> None:
        super().__init__(RESOURCE, widgets() if devices is None else devices)
        self.failing: set[str] = set()
        self.hanging: set[str] = set()
        self.failure: Exception = BackendError("the widget driver is gone")
        self.calls: dict[str, int] = {}
        self.raised: dict[str, int] = {}
        self._called = anyio.Event()
        self.polled: Mapping[str, Health] = {}

    async def _hook(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1
        failing = name in self.failing
        if failing:
            self.raised[name] = self.raised.get(name, 0) + 1
        self._called.set()
        self._called = anyio.Event()
        if name in self.hanging:
            await anyio.sleep_forever()
        if failing:
            raise self.failure

    async def wait_called(self, name: str, times: int = 1) -> None:
        with anyio.fail_after(10):
            while self.calls.get(name, 0) < times:
                await self._called.wait()

    async def wait_raised(self, name: str, times: int = 1) -> None:
        with anyio.fail_after(10):
            while self.raised.get(name, 0) < times:
                await self._called.wait()

    async def discover(self) -> Sequence[Device]:
        await self._hook("discover")
        return await super().discover()

    async def check_health(self, devices: Sequence[Device]) -> Mapping[str, Health]:
        await self._hook("check_health")
        return self.polled

    async def watch(self) -> AsyncIterator[HealthEvent | RescanEvent]:
        await self._hook("watch")
        async for event in super().watch():
            yield event

    async def allocate(self, devices: Sequence[Device]) -> Allocation:
        await self._hook("allocate")
        return Allocation.merge(devices)

    async def preferred_allocation(
        self, available: Sequence[Device], must_include: Sequence[Device], size: int
    ) -> Sequence[str]:
        await self._hook("preferred_allocation")
        return [d.id for d in available][:size]

    async def pre_start_container(self, devices: Sequence[Device]) -> None:
        await self._hook("pre_start_container")


@pytest.mark.parametrize(
    ("failure", "code"),
    [
        (AllocationError("widget d0 is reserved"), "FailedPrecondition"),
        (BackendError("the widget driver is gone"), "Unavailable"),
        (RuntimeError("unexpected firmware state"), "Internal"),
        (KeyError("d9"), "Internal"),
    ],
)
async def test_allocate_raising_fails_admission_with_its_message_and_serving_goes_on(
    failure: Exception, code: str
) -> None:
    plugin = FaultyPlugin()
    plugin.failure = failure
    async with FakeKubelet() as kubelet, serving(plugin, settings=kubelet.settings()):
        await kubelet.wait_for_allocatable(RESOURCE, 4)
        plugin.failing = {"allocate"}
        for _ in range(3):
            with pytest.raises(AdmissionError) as caught:
                await kubelet.allocate(RESOURCE, 1)
            assert f"code = {code}" in caught.value.reason
            assert str(failure) in caught.value.reason
        plugin.failing = set()
        got = await kubelet.allocate(RESOURCE, 2)
        assert len(got.allocation.device_nodes) == 2
        assert kubelet.is_registered(RESOURCE)
        assert len(kubelet.successful_registrations(RESOURCE)) == 1


async def test_allocate_returning_no_allocation_is_an_internal_error_with_a_message() -> None:
    class Broken(FaultyPlugin):
        async def allocate(self, devices: Sequence[Device]) -> Allocation:
            return None  # type: ignore[return-value]

    async with FakeKubelet() as kubelet, serving(Broken(), settings=kubelet.settings()):
        await kubelet.wait_for_allocatable(RESOURCE, 4)
        with pytest.raises(AdmissionError, match=r"code = Internal desc = .+") as caught:
            await kubelet.allocate(RESOURCE, 1)
        assert RESOURCE in caught.value.reason
        assert kubelet.is_registered(RESOURCE)


async def test_hanging_hooks_are_cut_off_with_a_message_and_serving_goes_on() -> None:
    plugin = FaultyPlugin()
    plugin.hanging = {"allocate", "pre_start_container", "preferred_allocation"}
    settings_overrides = {"hook_timeout": 0.2, "prestart_timeout": 0.2}
    async with FakeKubelet() as kubelet:
        async with serving(plugin, settings=kubelet.settings(**settings_overrides)):
            await kubelet.wait_for_allocatable(RESOURCE, 4)
            with pytest.raises(AdmissionError, match="DeadlineExceeded") as caught:
                await kubelet.allocate(RESOURCE, 1)
            assert "allocate did not finish within 0.2s" in caught.value.reason
            plugin.hanging = {"pre_start_container", "preferred_allocation"}
            # A hanging preference falls back to a valid choice; a hanging PreStart fails
            # the container start, not the plugin.
            with pytest.raises(ContainerStartError, match="pre_start_container did not finish"):
                await kubelet.allocate(RESOURCE, 2)
            plugin.hanging = set()
            got = await kubelet.allocate(RESOURCE, 1)
            assert len(got.device_ids) == 1


async def test_preferred_allocation_raising_falls_back_to_a_valid_choice(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="devplugin_sdk")
    plugin = FaultyPlugin()
    plugin.failing = {"preferred_allocation"}
    async with FakeKubelet() as kubelet, serving(plugin, settings=kubelet.settings()):
        await kubelet.wait_for_allocatable(RESOURCE, 4)
        got = await kubelet.allocate(RESOURCE, 3)
        assert got.preferred is not None
        assert len(set(got.preferred)) == 3
        assert set(got.preferred) <= {"d0", "d1", "d2", "d3"}
        assert plugin.raised["preferred_allocation"] == 1
    assert "preferred_allocation failed (BackendError: the widget driver is gone)" in caplog.text


async def test_pre_start_container_raising_fails_the_container_start_with_its_message() -> None:
    plugin = FaultyPlugin()
    plugin.failure = AllocationError("widget firmware is being flashed")
    plugin.failing = {"pre_start_container"}
    async with FakeKubelet() as kubelet, serving(plugin, settings=kubelet.settings()):
        await kubelet.wait_for_allocatable(RESOURCE, 4)
        with pytest.raises(ContainerStartError, match="widget firmware is being flashed"):
            await kubelet.allocate(RESOURCE, 1)
        plugin.failing = set()
        got = await kubelet.allocate(RESOURCE, 1)
        await kubelet.start_container(got)


async def test_check_health_raising_is_logged_and_health_stays_as_it_was(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.ERROR, logger="devplugin_sdk")
    plugin = FaultyPlugin()
    plugin.failing = {"check_health"}
    async with FakeKubelet() as kubelet, serving(plugin, settings=kubelet.settings()):
        await kubelet.wait_for_allocatable(RESOURCE, 4)
        await plugin.wait_raised("check_health", times=2)
        assert kubelet.allocatable(RESOURCE) == 4
        assert "check_health failed; health unchanged" in caplog.text
        assert "the widget driver is gone" in caplog.text
        # Polling goes on: once the backend answers again, its answer applies.
        plugin.polled = {"d2": Health.UNHEALTHY}
        plugin.failing = set()
        await kubelet.wait_for_health(RESOURCE, "d2", "Unhealthy")
        assert kubelet.allocatable(RESOURCE) == 3


async def test_watch_raising_is_logged_and_restarted_and_its_events_flow_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.ERROR, logger="devplugin_sdk")
    plugin = FaultyPlugin()
    plugin.failing = {"watch"}
    async with FakeKubelet() as kubelet, serving(plugin, settings=kubelet.settings()):
        await kubelet.wait_for_allocatable(RESOURCE, 4)
        await plugin.wait_raised("watch")
        plugin.failing = set()
        assert "watch() failed; restarting it" in caplog.text
        assert "the widget driver is gone" in caplog.text
        # The restarted event source delivers pushed health.
        plugin.set_health("d1", Health.UNHEALTHY, "Xid 79")
        await kubelet.wait_for_health(RESOURCE, "d1", "Unhealthy", timeout=10)
        got = await kubelet.allocate(RESOURCE, 3)
        assert "d1" not in got.device_ids


async def test_discover_raising_on_rescan_keeps_the_previous_devices(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.ERROR, logger="devplugin_sdk")
    plugin = FaultyPlugin()
    async with FakeKubelet() as kubelet, serving(plugin, settings=kubelet.settings()):
        await kubelet.wait_for_allocatable(RESOURCE, 4)
        plugin.failing = {"discover"}
        plugin.set_devices(widgets(2))
        await plugin.wait_raised("discover")
        plugin.push(RescanEvent("again"))
        await plugin.wait_raised("discover", times=2)
        assert set(kubelet.devices(RESOURCE)) == {"d0", "d1", "d2", "d3"}
        assert "rediscovery failed; keeping the previous devices" in caplog.text
        plugin.failing = set()
        plugin.push(RescanEvent("the driver is back"))
        await kubelet.wait_for(lambda: set(kubelet.devices(RESOURCE)) == {"d0", "d1"})
        assert kubelet.is_registered(RESOURCE)


async def test_discover_returning_duplicate_ids_on_rescan_keeps_the_previous_devices(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.ERROR, logger="devplugin_sdk")
    plugin = FaultyPlugin()
    async with FakeKubelet() as kubelet, serving(plugin, settings=kubelet.settings()):
        await kubelet.wait_for_allocatable(RESOURCE, 4)
        plugin.set_devices([*widgets(2), Device("d1")])
        # Events are handled in order: once the next rescan starts, the bad one is done.
        plugin.push(RescanEvent("probe"))
        await plugin.wait_called("discover", times=3)
        assert "discover() returned duplicate ID 'd1'" in caplog.text
        assert set(kubelet.devices(RESOURCE)) == {"d0", "d1", "d2", "d3"}
        assert kubelet.allocatable(RESOURCE) == 4


async def test_discover_raising_at_start_stops_serving_with_the_backends_error() -> None:
    plugin = FaultyPlugin()
    plugin.failing = {"discover"}
    async with FakeKubelet() as kubelet:
        with pytest.raises(BackendError, match="the widget driver is gone"):
            async with serving(plugin, settings=kubelet.settings()):
                await anyio.sleep_forever()
        assert kubelet.registrations == []


async def test_every_hook_failing_at_once_leaves_the_plugin_registered_across_a_restart(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.ERROR, logger="devplugin_sdk")
    plugin = FaultyPlugin()
    async with FakeKubelet() as kubelet, serving(plugin, settings=kubelet.settings()):
        await kubelet.wait_for_allocatable(RESOURCE, 4)
        plugin.failing = {
            "discover",
            "check_health",
            "allocate",
            "preferred_allocation",
            "pre_start_container",
        }
        plugin.push(RescanEvent("driver reload"))
        await plugin.wait_raised("discover")
        await plugin.wait_raised("check_health")
        with pytest.raises(AdmissionError, match="the widget driver is gone"):
            await kubelet.allocate(RESOURCE, 1)
        await kubelet.restart()
        await kubelet.wait_for_registrations(RESOURCE, 2)
        await kubelet.wait_for_allocatable(RESOURCE, 4)
        plugin.failing = set()
        got = await kubelet.allocate(RESOURCE, 4)
        assert sorted(got.device_ids) == ["d0", "d1", "d2", "d3"]
