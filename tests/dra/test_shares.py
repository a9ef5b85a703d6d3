"""Issue 28, items 1 and 4: one description of shares for both APIs, and admin access.

The NVIDIA backend on fake NVML with gpushare-style memory units: the device plugin lists the
units as before; the DRA driver publishes each GPU once, with ``allowMultipleAllocations`` and a
memory capacity taken in units; claims are prepared through FakeKubelet's DRA side over real
gRPC (v1, which carries ``share_id``) and get the limits the device plugin gives the same share;
a claim past what the GPU has left is refused, naming it. Admin access gets the device nodes only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from devplugin_sdk._wire import dra_convert
from devplugin_sdk._wire.dra_model import PreparedClaim, PreparedDevice
from devplugin_sdk.api.dra.v1 import dra_pb2 as v1
from devplugin_sdk.api.dra.v1beta1 import dra_pb2 as v1beta1
from devplugin_sdk.backends.nvidia import MemorySharing, NvidiaConfig, NvmlPlugin, VgpuSharing
from devplugin_sdk.dra import device_name
from devplugin_sdk.dra.resources import RequestPolicy
from devplugin_sdk.errors import KubeApiError
from devplugin_sdk.kubelet.fake_dra import DraPod, PodPreparationError
from devplugin_sdk.testing import DraNode, FakeKubelet, MemoryApi, fake_nvml, serving
from devplugin_sdk.types import Quantity

DRIVER = "gpu.nvidia.com"
GiB = 2**30
SHARE_ENV = (
    "ALIYUN_COM_GPU_MEM_IDX",
    "ALIYUN_COM_GPU_MEM_DEV",
    "ALIYUN_COM_GPU_MEM_CONTAINER",
    "CUDA_DEVICE_MEMORY_LIMIT_0",
    "NVIDIA_VISIBLE_DEVICES",
)


def _config(tmp_path: Path, nvml: fake_nvml.FakeNVML, **changes: Any) -> NvidiaConfig:
    roots = nvml.write_host(tmp_path / "host")
    return NvidiaConfig(
        sysfs_root=roots.sysfs_root, dev_root=roots.dev_root, proc_root=roots.proc_root, **changes
    )


def _env(node: DraNode, uid: str) -> dict[str, str]:
    (device,) = node.spec(uid).devices
    return dict(e.split("=", 1) for e in device["containerEdits"].get("env", []))


def _spec(node: DraNode, uid: str) -> dict[str, Any]:
    (device,) = node.spec(uid).devices
    edits: dict[str, Any] = device["containerEdits"]
    return edits


async def test_gpushare_units_are_one_shared_gpu_in_dra_with_the_same_limits(
    tmp_path: Path,
) -> None:
    nvml = fake_nvml.dgx_a100_40gb()
    config = _config(tmp_path, nvml, memory=MemorySharing(unit="GiB"))
    api = MemoryApi(nodes=["node-1"])
    gpu0 = nvml.gpus[0].uuid
    name0 = device_name(gpu0)
    async with DraNode(*NvmlPlugin.build(config, nvml=nvml), driver=DRIVER, memory=api) as node:
        kubelet = node.kubelet
        await kubelet.wait_for(lambda: len(node.published()) == 8, what="8 GPUs published")
        published = node.published()
        assert set(published) == {device_name(g.uuid) for g in nvml.gpus}
        for device in published.values():
            assert device.allow_multiple_allocations
            assert device.capacity == {"memory": Quantity(40 * GiB)}
            # The unit is the device plugin's: whole GiB, up to the GPU; a claim that asks no
            # memory takes the whole GPU (issue 37: it was one unit).
            assert device.request_policies == {
                "memory": RequestPolicy(
                    default=Quantity(40 * GiB),
                    minimum=Quantity(GiB),
                    maximum=Quantity(40 * GiB),
                    step=Quantity(GiB),
                )
            }

        pods, share_ids = [], []
        for n in range(3):
            claim = api.allocate(
                "ml",
                f"share-{n}",
                {"gpu": [name0]},
                driver=DRIVER,
                pool="node-1",
                capacity={"gpu": {"memory": Quantity(10 * GiB)}},
                pods=[pod_uid := f"pod-{n}"],
            )
            (result,) = claim.results
            assert result.consumed == {"memory": Quantity(10 * GiB)}
            pod = node.pod(f"share-{n}", name=f"p{n}", namespace="ml", uid=pod_uid)
            prepared = await node.prepare(pod)
            (device,) = prepared.claims[f"share-{n}"]
            # v1 carries the share's ID back to the kubelet.
            assert device.share_id == result.share_id != ""
            share_ids.append(device.share_id)
            pods.append(pod)
            env = _env(node, claim.uid)
            assert env["CUDA_DEVICE_MEMORY_LIMIT_0"] == "10240m"
            assert env["ALIYUN_COM_GPU_MEM_CONTAINER"] == "10"
            assert env["ALIYUN_COM_GPU_MEM_DEV"] == "40"
            assert env["NVIDIA_VISIBLE_DEVICES"] == gpu0
        assert len(set(share_ids)) == 3

        # The scheduler would not allocate a fourth of 20 GiB: 10 GiB are left.
        with pytest.raises(KubeApiError, match="10Gi of 40Gi free"):
            api.allocate(
                "ml",
                "share-3",
                {"gpu": [name0]},
                driver=DRIVER,
                pool="node-1",
                capacity={"gpu": {"memory": Quantity(20 * GiB)}},
            )
        # A scheduler that saw another state would: the driver refuses that claim alone.
        claim = api.allocate(
            "ml",
            "share-3",
            {"gpu": [name0]},
            driver=DRIVER,
            pool="node-1",
            capacity={"gpu": {"memory": Quantity(20 * GiB)}},
            pods=["pod-3"],
            check=False,
        )
        pod = node.pod("share-3", name="p3", namespace="ml", uid="pod-3")
        with pytest.raises(PodPreparationError) as refused:
            await node.prepare(pod)
        message = str(refused.value)
        assert "ml/share-3" in message
        assert f"device {name0} has 10Gi of memory free (of 40Gi; held by ml/share-" in message
        assert "the allocation asks 20Gi of memory" in message
        assert not node.spec_path(claim).exists()

        # Unpreparing one share frees its units: 20 GiB fit now.
        await node.unprepare(pods[0])
        prepared = await node.prepare(pod)
        assert _env(node, claim.uid)["CUDA_DEVICE_MEMORY_LIMIT_0"] == "20480m"

    # The same configuration serves the device plugin as before: 320 units, and 10 of them get
    # the variables a 10 GiB share gets above.
    async with FakeKubelet() as kubelet:
        async with serving(*NvmlPlugin.build(config, nvml=nvml), settings=kubelet.settings()):
            await kubelet.wait_for(lambda: len(kubelet.devices("nvidia.com/gpu-memory")) == 320)
            got = await kubelet.allocate("nvidia.com/gpu-memory", 10)
            env = dict(got.allocation.env)
            assert env["CUDA_DEVICE_MEMORY_LIMIT_0"] == "10240m"
            assert env["ALIYUN_COM_GPU_MEM_CONTAINER"] == "10"
            assert env["ALIYUN_COM_GPU_MEM_DEV"] == "40"


async def test_shares_survive_a_driver_restart(tmp_path: Path) -> None:
    """What each claim holds is checkpointed: after a restart the same units are not given
    twice."""
    nvml = fake_nvml.dgx_a100_40gb()
    config = _config(tmp_path, nvml, memory=MemorySharing(unit="GiB"))
    api = MemoryApi(nodes=["node-1"])
    name0 = device_name(nvml.gpus[0].uuid)
    async with DraNode(*NvmlPlugin.build(config, nvml=nvml), driver=DRIVER, memory=api) as node:
        kubelet = node.kubelet

        def claim(n: int, gib: int) -> DraPod:
            api.allocate(
                "ml",
                f"c{n}",
                {"gpu": [name0]},
                driver=DRIVER,
                pool="node-1",
                capacity={"gpu": {"memory": Quantity(gib * GiB)}},
                pods=[f"pod-{n}"],
                check=False,
            )
            return node.pod(f"c{n}", name=f"p{n}", namespace="ml", uid=f"pod-{n}")

        await kubelet.wait_for(lambda: len(node.published()) == 8)
        await node.prepare(claim(0, 30))
        async with node.stopped():
            pass
        await kubelet.wait_for(lambda: len(kubelet.dra.successful_registrations(DRIVER)) == 2)
        with pytest.raises(PodPreparationError, match="has 10Gi of memory free"):
            await node.prepare(claim(1, 20))


async def test_time_slicing_replicas_and_vgpu_slices_are_shares_too(tmp_path: Path) -> None:
    """Replicas: a ``shares`` capacity of one per replica. Slices: the memory of one slice per
    claim, and the slice's HAMi-core limits."""
    nvml = fake_nvml.t4_pcie()
    api = MemoryApi(nodes=["node-1"])
    gpu0 = nvml.gpus[0].uuid
    for changes, capacity, policy in (
        (
            {"replicas": 4},
            {"shares": Quantity(4)},
            RequestPolicy(Quantity(1), minimum=Quantity(1), maximum=Quantity(4), step=Quantity(1)),
        ),
        (
            {"vgpu": VgpuSharing(2)},
            {"memory": Quantity(2 * ((15360 // 2) << 20))},
            RequestPolicy(Quantity(7680 << 20), valid_values=(Quantity(7680 << 20),)),
        ),
    ):
        config = _config(tmp_path, nvml, **changes)
        async with DraNode(NvmlPlugin(config, nvml=nvml), driver=DRIVER, memory=api) as node:
            await node.kubelet.wait_for(lambda: len(node.published()) == 4)
            device = node.published()[device_name(gpu0)]
            assert device.allow_multiple_allocations
            assert device.capacity == capacity
            assert dict(device.request_policies) == {next(iter(capacity)): policy}
            claim = api.allocate(
                "ml",
                "one",
                {"gpu": [device_name(gpu0)]},
                driver=DRIVER,
                pool="node-1",
                pods=["pod-1"],
            )
            await node.prepare(node.pod("one", name="p", namespace="ml", uid="pod-1"))
            env = _env(node, claim.uid)
            assert env["NVIDIA_VISIBLE_DEVICES"] == gpu0
            if "vgpu" in changes:
                assert env["CUDA_DEVICE_MEMORY_LIMIT_0"] == "7680m"
                assert env["CUDA_DEVICE_SM_LIMIT"] == "50"
            api.delete_claim("ml", "one")


def test_share_id_is_answered_on_v1_only() -> None:
    """The v1beta1 Device has no share_id: a kubelet speaking it never sees one."""
    result = {"uid-1": PreparedClaim((PreparedDevice(("r",), "p", "d", ("k/c=x",), "s-1"),))}
    on_v1 = dra_convert.prepared(dra_convert.prepare_response(v1, result))
    on_v1beta1 = dra_convert.prepared(dra_convert.prepare_response(v1beta1, result))
    assert on_v1["uid-1"].devices[0].share_id == "s-1"
    assert on_v1beta1["uid-1"].devices[0].share_id == ""
    assert "share_id" not in v1beta1.Device.DESCRIPTOR.fields_by_name


# ----------------------------------------------------------------------------- admin access


async def test_admin_access_gets_the_device_nodes_of_a_device_in_use_and_no_limits(
    tmp_path: Path,
) -> None:
    nvml = fake_nvml.dgx_a100_40gb()
    config = _config(tmp_path, nvml, memory=MemorySharing(unit="GiB"))
    api = MemoryApi(nodes=["node-1"])
    name0 = device_name(nvml.gpus[0].uuid)
    async with DraNode(*NvmlPlugin.build(config, nvml=nvml), driver=DRIVER, memory=api) as node:
        kubelet = node.kubelet

        def pod_of(claim: str, uid: str) -> DraPod:
            return node.pod(claim, name=claim, namespace="ml", uid=uid)

        await kubelet.wait_for(lambda: len(node.published()) == 8)
        # Every unit of GPU 0 is taken by one claim.
        api.allocate(
            "ml",
            "all",
            {"gpu": [name0]},
            driver=DRIVER,
            pool="node-1",
            pods=["u1"],
            capacity={"gpu": {"memory": Quantity(40 * GiB)}},
        )
        await node.prepare(pod_of("all", "u1"))
        # A monitor is still allocated and prepared: not exclusive, nothing consumed.
        monitor = api.allocate(
            "ml",
            "monitor",
            {"gpu": [name0]},
            driver=DRIVER,
            pool="node-1",
            pods=["u2"],
            admin_access=True,
        )
        (result,) = monitor.results
        assert result.admin_access
        assert not result.share_id
        assert not result.consumed
        await node.prepare(pod_of("monitor", "u2"))
        edits = _spec(node, monitor.uid)
        nodes = [n["path"] for n in edits["deviceNodes"]]
        assert "/dev/nvidia0" in nodes
        assert "/dev/nvidiactl" in nodes
        # No limits, no GPU list for the runtime to claim: the nodes only.
        assert "env" not in edits or not edits["env"]
        # And it holds nothing: the monitor leaves, the owner stays; a new share after the
        # owner leaves gets the units.
        await node.unprepare(pod_of("monitor", "u2"))
        await node.unprepare(pod_of("all", "u1"))
        api.delete_claim("ml", "all")
        api.allocate(
            "ml",
            "after",
            {"gpu": [name0]},
            driver=DRIVER,
            pool="node-1",
            pods=["u3"],
            capacity={"gpu": {"memory": Quantity(40 * GiB)}},
        )
        await node.prepare(pod_of("after", "u3"))


async def test_admin_access_to_an_exclusive_device_in_use(tmp_path: Path) -> None:
    nvml = fake_nvml.t4_pcie()
    config = _config(tmp_path, nvml)
    api = MemoryApi(nodes=["node-1"])
    name0 = device_name(nvml.gpus[0].uuid)
    async with DraNode(NvmlPlugin(config, nvml=nvml), driver=DRIVER, memory=api) as node:
        kubelet = node.kubelet

        def pod_of(claim: str, uid: str) -> DraPod:
            return node.pod(claim, name=claim, namespace="ml", uid=uid)

        await kubelet.wait_for(lambda: len(node.published()) == 4)
        api.allocate("ml", "job", {"gpu": [name0]}, driver=DRIVER, pool="node-1", pods=["a"])
        await node.prepare(pod_of("job", "a"))
        # Exclusive: a second claim is refused by the scheduler, and by the driver.
        with pytest.raises(KubeApiError, match="is allocated to ml/job"):
            api.allocate("ml", "two", {"gpu": [name0]}, driver=DRIVER, pool="node-1")
        api.allocate(
            "ml",
            "two",
            {"gpu": [name0]},
            driver=DRIVER,
            pool="node-1",
            pods=["b"],
            check=False,
        )
        with pytest.raises(PodPreparationError, match="already prepared for claim ml/job"):
            await node.prepare(pod_of("two", "b"))
        monitor = api.allocate(
            "ml",
            "monitor",
            {"gpu": [name0]},
            driver=DRIVER,
            pool="node-1",
            pods=["c"],
            admin_access=True,
        )
        await node.prepare(pod_of("monitor", "c"))
        edits = _spec(node, monitor.uid)
        assert "/dev/nvidia0" in [n["path"] for n in edits["deviceNodes"]]
        assert not edits.get("env")


async def test_without_consumable_capacity_a_shared_gpu_is_allocated_whole(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An API server before 1.36 drops allowMultipleAllocations: each GPU goes to one claim,
    which gets every unit of it."""
    nvml = fake_nvml.dgx_a100_40gb()
    config = _config(tmp_path, nvml, memory=MemorySharing(unit="GiB"))
    api = MemoryApi(nodes=["node-1"], consumable_capacity=False)
    name0 = device_name(nvml.gpus[0].uuid)
    async with DraNode(*NvmlPlugin.build(config, nvml=nvml), driver=DRIVER, memory=api) as node:
        kubelet = node.kubelet
        await kubelet.wait_for(lambda: len(node.published()) == 8)
        assert not node.published()[name0].allow_multiple_allocations
        claim = api.allocate(
            "ml", "whole", {"gpu": [name0]}, driver=DRIVER, pool="node-1", pods=["u1"]
        )
        assert not claim.results[0].share_id
        await node.prepare(node.pod("whole", name="p", namespace="ml", uid="u1"))
        assert _env(node, claim.uid)["CUDA_DEVICE_MEMORY_LIMIT_0"] == "40960m"
        with pytest.raises(KubeApiError, match="is allocated to ml/whole"):
            api.allocate("ml", "other", {"gpu": [name0]}, driver=DRIVER, pool="node-1")
    assert "dropped allowMultipleAllocations" in caplog.text
