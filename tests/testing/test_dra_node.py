"""The DRA test kit: ``DraNode``, the ``served_driver`` fixture and ``DaemonSetPod``, used as an
author uses them (public names only)."""

from __future__ import annotations

import anyio
import pytest

from devplugin_sdk import Device, DeviceNode
from devplugin_sdk.testing import DaemonSetPod, DraNode, FakeKubelet, StaticPlugin

DRIVER = "widget.acme.com"
RESOURCE = "acme.com/widget"


def widgets(count: int = 2) -> list[Device]:
    return [Device(f"w{i}", device_nodes=(DeviceNode(f"/dev/widget{i}"),)) for i in range(count)]


async def test_entering_gives_a_registered_driver_and_a_published_pool() -> None:
    async with DraNode(StaticPlugin(RESOURCE, widgets(3)), driver=DRIVER) as node:
        assert node.kubelet.dra.is_registered(DRIVER)
        assert node.api.pool_complete(DRIVER, node.node_name)
        assert sorted(node.published()) == ["w0", "w1", "w2"]
        assert node.status.driver == DRIVER
        assert node.options.cdi_dir.parent == node.kubelet.directory.parent


async def test_a_prepared_claim_yields_a_spec_that_spec_reads() -> None:
    async with DraNode(StaticPlugin(RESOURCE, widgets(2)), driver=DRIVER) as node:
        pod = node.pod("gpus")
        claim = node.claim("gpus", {"widgets": ["w1"]}, pods=[pod])
        prepared = await node.prepare(pod)
        assert prepared.cdi_ids("gpus") == [f"k8s.{DRIVER}/claim={claim.uid}-widgets"]
        spec = node.spec(claim)
        assert spec.path == node.spec_path(claim.uid)
        assert spec.path.parent == node.options.cdi_dir
        (device,) = spec.devices
        assert [n["path"] for n in device["containerEdits"]["deviceNodes"]] == ["/dev/widget1"]
        await node.unprepare(pod)
        assert not node.spec_path(claim).exists()
        with pytest.raises(FileNotFoundError):
            node.spec(claim)


async def test_a_pod_keeps_the_uid_it_is_given_and_a_list_is_one_request() -> None:
    async with DraNode(StaticPlugin(RESOURCE, widgets(2)), driver=DRIVER) as node:
        pod = node.pod("a", uid="pod-1")
        assert (pod.name, pod.uid, pod.claims) == ("pod-a", "pod-1", ("a",))
        claim = node.claim("a", ["w0"], pods=["pod-1"], request="one")
        assert claim.reserved_for == ("pod-1",)
        assert [(r.request, r.device) for r in claim.results] == [("one", "w0")]


async def test_stopped_restarts_the_driver_ready_with_the_same_kubelet() -> None:
    async with DraNode(StaticPlugin(RESOURCE, widgets(2)), driver=DRIVER) as node:
        first = node.running
        async with node.stopped():
            with pytest.raises(RuntimeError, match="no driver is running"):
                _ = node.running
        assert node.running is not first
        assert node.kubelet.dra.is_registered(DRIVER)
        assert sorted(node.published()) == ["w0", "w1"]


async def test_a_node_without_plugins_serves_daemonset_pods_with_their_own_uids() -> None:
    async with DraNode(driver=DRIVER) as node, anyio.create_task_group() as tg:
        settings = node.kubelet.settings()
        pods = [
            DaemonSetPod(
                StaticPlugin(RESOURCE, widgets(2)), settings=settings, api="dra", dra=node.options
            )
            for _ in range(2)
        ]
        assert pods[0].uid != pods[1].uid
        for pod in pods:
            await pod.start(tg)
        await node.ready()
        await node.kubelet.wait_for(
            lambda: len(node.kubelet.dra.successful_registrations(DRIVER)) == 2, what="both"
        )
        endpoints = {r.endpoint for r in node.kubelet.dra.successful_registrations(DRIVER)}
        assert all(any(p.uid in e for e in endpoints) for p in pods)
        await pods[0].stop()
        await pods[1].stop()


async def test_a_given_kubelet_is_used_and_left_running() -> None:
    async with FakeKubelet(dra_api=None) as kubelet:
        with pytest.raises(ValueError, match="needs a MemoryApi"):
            DraNode(driver=DRIVER, kubelet=kubelet)


# An author's test: the fixtures of the pytest plugin, nothing else.


@pytest.fixture
def device_plugin() -> StaticPlugin:
    return StaticPlugin(RESOURCE, widgets(2))


@pytest.fixture
def dra_driver() -> str:
    return DRIVER


async def test_served_driver_in_an_author_style_test(served_driver: DraNode) -> None:
    assert sorted(served_driver.published()) == ["w0", "w1"]
    pod = served_driver.pod("gpus")
    claim = served_driver.claim("gpus", {"widgets": ["w0"]}, pods=[pod])
    await served_driver.prepare(pod)
    assert served_driver.spec(claim).devices[0]["containerEdits"]["deviceNodes"]
    await served_driver.unprepare(pod)
    assert served_driver.kubelet.dra.prepared_claims() == []
