"""Shutdown: in-flight calls finish within the grace, streams end cleanly, sockets go."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import anyio
from sdk_helpers import RESOURCE, widgets

from devplugin_sdk import Allocation, Device
from devplugin_sdk.testing import ContainerAllocation, FakeKubelet, StaticPlugin, serving


class _Slow(StaticPlugin):
    """An Allocate that takes 0.3 s of work, and says when it starts and if it was cancelled."""

    def __init__(self, resource_name: str, devices: Iterable[Device]) -> None:
        super().__init__(resource_name, devices)
        self.started = anyio.Event()
        self.cancelled = False

    async def allocate(self, devices: Sequence[Device]) -> Allocation:
        self.started.set()
        try:
            await anyio.sleep(0.3)  # the work in flight, not a wait
        except BaseException:
            self.cancelled = True
            raise
        return await super().allocate(devices)


async def test_an_allocate_in_flight_finishes_before_the_streams_end(kubelet: FakeKubelet) -> None:
    """The kubelet drops its connection when the stream ends: calls get stop_grace first."""
    results: list[ContainerAllocation] = []
    plugin = _Slow(RESOURCE, widgets(2))
    async with anyio.create_task_group() as tg:
        async with serving(plugin, settings=kubelet.settings(stop_grace=2.0)):
            await kubelet.wait_for_allocatable(RESOURCE, 2)

            async def allocate() -> None:
                results.append(await kubelet.allocate(RESOURCE, 1))

            tg.start_soon(allocate)
            with anyio.fail_after(5):
                await plugin.started.wait()  # the Allocate is now running in the plugin
    assert not plugin.cancelled
    assert len(results) == 1
    assert not (kubelet.directory / "acme.com_widget.sock").exists()
    await kubelet.wait_for_allocatable(RESOURCE, 0)  # a clean end of the stream


async def test_a_removed_plugins_on_stop_runs_once(kubelet: FakeKubelet) -> None:
    stops: list[str] = []

    class Tidy(StaticPlugin):
        async def on_stop(self) -> None:
            stops.append(self.resource_name)

    async with serving(Tidy(RESOURCE, widgets(1)), settings=kubelet.settings()):
        await kubelet.wait_for_allocatable(RESOURCE, 1)
        await kubelet.restart()  # a kubelet restart is not a stop
        await kubelet.wait_for_registrations(RESOURCE, 2)
    assert stops == [RESOURCE]
