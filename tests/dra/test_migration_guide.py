"""docs/dra.md "Moving a node from the device plugin to DRA and back", step by step against
FakeKubelet (both its device manager and its DRA side, real gRPC) and MemoryApi: what happens to
running pods at each step is what the guide says."""

from __future__ import annotations

import pytest
from dra_helpers import DRIVER
from sdk_helpers import RESOURCE, widgets

from devplugin_sdk.testing import (
    AdmissionError,
    DraNode,
    FakeKubelet,
    MemoryApi,
    PodPreparationError,
    StaticPlugin,
    serving,
)

NODE = "node-1"


def pool(api: MemoryApi) -> list[str]:
    return sorted(d.name for s in api.pool(DRIVER, NODE) for d in s.devices)


async def test_one_node_from_device_plugin_to_dra_and_back() -> None:
    api = MemoryApi(nodes=[NODE])
    async with FakeKubelet(dra_api=api) as kubelet:
        kubelet.dra.wiping_delay = 0.05
        plugin = StaticPlugin(RESOURCE, widgets(3))

        # Step 0, api: devicePlugin. A running pod holds one widget.
        async with serving(plugin, settings=kubelet.settings()):
            await kubelet.wait_for_allocatable(RESOURCE, 3)
            pod_a = await kubelet.allocate(RESOURCE, 1, pod="pod-a")
            (held,) = kubelet.allocated(RESOURCE)

        # Step 1, api: both, DRA gets the free widgets only: the running pod keeps its widget
        # (the device plugin still lists it, its container restarts), new pods use claims.
        free = sorted({"w0", "w1", "w2"} - {held})
        async with DraNode(
            plugin,
            driver=DRIVER,
            kubelet=kubelet,
            device_plugin_api=True,
            devices=lambda resource, device: device.id in free,
        ) as node:
            await kubelet.wait_for(lambda: pool(api) == free, what="DRA gets the free widgets")
            await kubelet.wait_for(
                lambda: set(kubelet.devices(RESOURCE)) == {held}, what="the plugin keeps its one"
            )
            await kubelet.start_container(pod_a)  # a restart of the running pod still works
            with pytest.raises(AdmissionError):
                await kubelet.allocate(RESOURCE, 1, pod="pod-late")  # nothing twice
            pod_b = node.pod("b", name="pod-b")
            node.claim("b", {"w": [free[0]]}, pods=[pod_b])
            await node.prepare(pod_b)

        # Step 2, the old pod ended: api: dra. The device plugin's resource goes unhealthy (the
        # kubelet keeps its capacity for its grace period, allocatable 0), every widget is in
        # the pool, and the claim prepared in step 1 is still prepared (the checkpoint).
        kubelet.release(pod_a)
        async with DraNode(plugin, driver=DRIVER, kubelet=kubelet) as node:
            await kubelet.wait_for(lambda: pool(api) == ["w0", "w1", "w2"], what="every widget")
            await kubelet.wait_for(lambda: kubelet.allocatable(RESOURCE) == 0, what="DP gone")
            assert not kubelet.is_registered(RESOURCE)
            again = await node.prepare(pod_b)  # the same answer, no work redone
            assert again.cdi_ids("b")
            pod_c = node.pod("c", name="pod-c")
            node.claim("c", {"w": [held]}, pods=[pod_c])
            await node.prepare(pod_c)
            # Back: first the pods with claims end (their claims are unprepared) ...
            await node.unprepare(pod_b)
            api.deallocate("default", "b")

        # ... a pod whose claim is still prepared when DRA stops cannot end cleanly: the
        # kubelet cannot unprepare it until the driver serves again (it stays Terminating).
        async with serving(plugin, settings=kubelet.settings()):
            await kubelet.wait_for_allocatable(RESOURCE, 3)
            with pytest.raises(PodPreparationError, match="not registered"):
                await kubelet.dra.unprepare(pod_c)
            await kubelet.wait_for(lambda: not api.pool(DRIVER, NODE), what="slices wiped")
            # Step 3, api: devicePlugin again: every widget is allocatable, the pool is gone;
            # nothing stops the device plugin from handing out the widget pod-c still uses.
            pod_d = await kubelet.allocate(RESOURCE, 3, pod="pod-d")
            assert held in kubelet.allocated(RESOURCE)
            kubelet.release(pod_d)

        # Which is why the guide says: drain the claims first (api: both keeps DRA serving).
        async with DraNode(plugin, driver=DRIVER, kubelet=kubelet) as node:
            await node.unprepare(pod_c)
            assert kubelet.dra.prepared_claims() == []
