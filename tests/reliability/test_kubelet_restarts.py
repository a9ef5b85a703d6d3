"""Kubelet restarts in long runs, flapping sockets, an absent kubelet, and a Register that hangs.

The plugin is served in the test's event loop against a FakeKubelet; every wait is on the
kubelet's state (``wait_for...``), never on time.
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path

import pytest

from devplugin_sdk import Allocation, Device, DeviceNode
from devplugin_sdk.testing import ContainerAllocation, FakeKubelet, StaticPlugin, serving

RESOURCE = "reliability.example.com/dev"

pytestmark = pytest.mark.timeout(60)


class CountingPlugin(StaticPlugin):
    """Static devices with a node each; records every Allocate the kubelet makes."""

    def __init__(self, count: int = 4) -> None:
        devices = [Device(f"d{i}", device_nodes=(DeviceNode(f"/dev/d{i}"),)) for i in range(count)]
        super().__init__(RESOURCE, devices)
        self.allocated: list[tuple[str, ...]] = []

    async def allocate(self, devices: Sequence[Device]) -> Allocation:
        self.allocated.append(tuple(sorted(d.id for d in devices)))
        return Allocation.merge(devices)


def nodes(allocation: ContainerAllocation) -> list[str]:
    return sorted(n.host_path for n in allocation.allocation.device_nodes)


async def test_two_hundred_restarts_in_a_row_each_recovered_and_no_allocation_lost() -> None:
    plugin = CountingPlugin()
    held: list[ContainerAllocation] = []
    admitted: list[ContainerAllocation] = []
    async with FakeKubelet() as kubelet, serving(plugin, settings=kubelet.settings()):
        await kubelet.wait_for_allocatable(RESOURCE, 4)
        for restart in range(1, 201):
            await kubelet.restart()
            await kubelet.wait_for_registrations(RESOURCE, restart + 1)
            await kubelet.wait_for_allocatable(RESOURCE, 4)
            got = await kubelet.allocate(RESOURCE, 1 + restart % 2)
            assert nodes(got) == [f"/dev/{i}" for i in got.device_ids]
            admitted.append(got)
            held.append(got)
            if len(held) > 1:  # keep one pod running across the next restart
                kubelet.release(held.pop(0))
        # The pod still running kept its devices through the last restart.
        assert kubelet.allocated(RESOURCE) == set(held[0].device_ids)
        assert kubelet.restarts == 200
        assert len(kubelet.successful_registrations(RESOURCE)) == 201
        assert kubelet.connections(RESOURCE) == 1
    # Every admission reached the plugin exactly once, with the devices the kubelet chose.
    assert plugin.allocated == [a.device_ids for a in admitted]


async def test_recovers_from_a_flapping_kubelet_socket() -> None:
    plugin = CountingPlugin()
    async with FakeKubelet() as kubelet, serving(plugin, settings=kubelet.settings()):
        await kubelet.wait_for_allocatable(RESOURCE, 4)
        for flap in range(30):
            # Down and up again without waiting for the plugin in between; every third time
            # the kubelet dies without cleanup and leaves a stale kubelet.sock behind.
            if flap % 3 == 2:
                await kubelet.crash()
            else:
                await kubelet.stop()
            await kubelet.start()
        await kubelet.wait_for_allocatable(RESOURCE, 4, timeout=10)
        await kubelet.wait_for(lambda: kubelet.connections(RESOURCE) == 1)
        got = await kubelet.allocate(RESOURCE, 3)
        assert nodes(got) == [f"/dev/{i}" for i in got.device_ids]
        assert kubelet.is_registered(RESOURCE)


async def test_waits_for_a_kubelet_absent_at_start_then_registers() -> None:
    plugin = CountingPlugin()
    # Unix socket paths are short: a directory under /tmp, not pytest's deep tmp_path.
    with tempfile.TemporaryDirectory(prefix="dpr-", dir="/tmp") as root:
        kubelet = FakeKubelet(Path(root) / "device-plugins")
        async with serving(plugin, settings=kubelet.settings()):
            # Not even the device-plugin directory exists yet.
            assert not kubelet.directory.exists()
            async with kubelet:
                await kubelet.wait_for_allocatable(RESOURCE, 4, timeout=10)
                assert len(kubelet.successful_registrations(RESOURCE)) == 1
                got = await kubelet.allocate(RESOURCE, 1)
                assert plugin.allocated == [got.device_ids]


async def test_register_hanging_past_its_deadline_is_retried_until_it_registers() -> None:
    plugin = CountingPlugin()
    # Register takes 0.3 s in the kubelet; the plugin gives up on each call after 0.1 s.
    async with FakeKubelet(register_delay=0.3) as kubelet:
        settings = kubelet.settings(register_timeout=0.1)
        async with serving(plugin, settings=settings):
            await kubelet.wait_for_allocatable(RESOURCE, 4, timeout=20)
            got = await kubelet.allocate(RESOURCE, 2)
            assert nodes(got) == [f"/dev/{i}" for i in got.device_ids]
            # The kubelet finally answers quickly again: later restarts recover as usual.
            kubelet.register_delay = 0.0
            await kubelet.restart()
            await kubelet.wait_for_allocatable(RESOURCE, 4, timeout=10)
            await kubelet.wait_for(lambda: kubelet.connections(RESOURCE) == 1)
