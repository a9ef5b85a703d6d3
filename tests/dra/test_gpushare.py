"""Issue 37, items 9 and build 3-4: the gpushare configuration served once in DRA.

gpushare's configuration (memory units, and with ``countResourceName`` each GPU counted once)
makes two device-plugin resources of one GPU; in DRA they are one device: each GPU is published
once, shareable, its memory taken in units, and a claim that asks no capacity takes the whole
GPU. A claim holding memory gets the HAMi-style limit and the variables nvidia-container-toolkit's
``apply-cuda-memory-limits`` hook reads (``NVIDIA_GPU_MEMORY_REQUEST``/``_LIMIT``, whole MiB:
NVIDIA/nvidia-container-toolkit cmd/nvidia-cdi-hook/apply-cuda-memory-limits/
apply-cuda-memory-limits.go). Fake NVML (a DGX A100 40 GB), the loopback of MemoryApi and
FakeKubelet's DRA side over real gRPC.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from devplugin_sdk.backends.nvidia import MemorySharing, NvidiaConfig, NvmlPlugin
from devplugin_sdk.backends.nvidia.sharing import enforced
from devplugin_sdk.dra import device_name
from devplugin_sdk.dra.resources import RequestPolicy
from devplugin_sdk.errors import KubeApiError
from devplugin_sdk.kubelet.fake_dra import PodPreparationError
from devplugin_sdk.testing import DraNode, fake_nvml
from devplugin_sdk.types import Allocation, Quantity, Shareable

DRIVER = "gpu.nvidia.com"
GiB = 2**30
MEM, COUNT = "aliyun.com/gpu-mem", "aliyun.com/gpu-count"


def _config(tmp_path: Path, nvml: fake_nvml.FakeNVML, count: str | None) -> NvidiaConfig:
    roots = nvml.write_host(tmp_path / "host")
    return NvidiaConfig(
        sysfs_root=roots.sysfs_root,
        dev_root=roots.dev_root,
        proc_root=roots.proc_root,
        memory=MemorySharing(resource_name=MEM, unit="GiB", count_resource_name=count),
    )


def _env(node: DraNode, uid: str) -> dict[str, str]:
    (device,) = node.spec(uid).devices
    return dict(e.split("=", 1) for e in device["containerEdits"].get("env", []))


@pytest.mark.parametrize(
    ("count", "both"),
    [(COUNT, False), (None, False), (COUNT, True)],
    ids=["countResourceName", "memory only", "api both"],
)
async def test_gpushare_is_one_shareable_device_per_gpu_and_a_bare_claim_takes_it_whole(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, count: str | None, both: bool
) -> None:
    nvml = fake_nvml.dgx_a100_40gb()
    config = _config(tmp_path, nvml, count)
    gpu0, gpu1 = nvml.gpus[0].uuid, nvml.gpus[1].uuid
    name0, name1 = device_name(gpu0), device_name(gpu1)
    caplog.set_level(logging.WARNING, logger="devplugin_sdk")
    plugins = NvmlPlugin.build(config, nvml=nvml)
    options: dict[str, Any] = {"device_plugin_api": both}
    async with DraNode(*plugins, driver=DRIVER, **options) as node:
        await node.kubelet.wait_for(lambda: len(node.published()) == 8, what="8 GPUs")
        published = node.published()
        assert set(published) == {device_name(g.uuid) for g in nvml.gpus}
        for device in published.values():
            assert device.allow_multiple_allocations
            assert device.capacity == {"memory": Quantity(40 * GiB)}
            # A claim that asks no capacity takes the whole GPU: the default is all of it.
            assert device.request_policies == {
                "memory": RequestPolicy(
                    default=Quantity(40 * GiB),
                    minimum=Quantity(GiB),
                    maximum=Quantity(40 * GiB),
                    step=Quantity(GiB),
                )
            }
        errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert errors == []

        share_ids = []
        for n in range(3):
            claim = node.claim(
                f"share-{n}",
                [name0],
                pods=[f"pod-{n}"],
                namespace="ml",
                capacity={"devices": {"memory": Quantity(10 * GiB)}},
            )
            prepared = await node.prepare(node.pod(f"share-{n}", namespace="ml", uid=f"pod-{n}"))
            (device,) = prepared.claims[f"share-{n}"]
            share_ids.append(device.share_id)
            env = _env(node, claim.uid)
            assert env["NVIDIA_VISIBLE_DEVICES"] == gpu0
            assert env["CUDA_DEVICE_MEMORY_LIMIT_0"] == "10240m"
            assert env["NVIDIA_GPU_MEMORY_LIMIT"] == "10240"
            assert env["NVIDIA_GPU_MEMORY_REQUEST"] == "10240"
        assert len(set(share_ids)) == 3
        assert "" not in share_ids

        # A fourth of 20 GiB: the scheduler refuses it, and so does the driver.
        with pytest.raises(KubeApiError, match="10Gi of 40Gi free"):
            node.claim("share-3", [name0], namespace="ml", capacity=_gib(20))
        node.claim(
            "share-3", [name0], pods=["pod-3"], namespace="ml", capacity=_gib(20), check=False
        )
        with pytest.raises(PodPreparationError, match=f"device {name0} has 10Gi of memory free"):
            await node.prepare(node.pod("share-3", namespace="ml", uid="pod-3"))
        # A whole-GPU claim on GPU 0 while shares are held: refused by both.
        with pytest.raises(KubeApiError, match="free"):
            node.claim("whole-0", [name0], namespace="ml")
        node.claim("whole-0", [name0], pods=["pod-w0"], namespace="ml", check=False)
        with pytest.raises(PodPreparationError, match="the allocation asks 40Gi of memory"):
            await node.prepare(node.pod("whole-0", namespace="ml", uid="pod-w0"))

        # A whole-GPU claim (no capacity asked) on GPU 1 gets all of it.
        whole = node.claim("whole", [name1], pods=["pod-w"], namespace="ml")
        (result,) = whole.results
        assert result.consumed == {"memory": Quantity(40 * GiB)}
        await node.prepare(node.pod("whole", namespace="ml", uid="pod-w"))
        env = _env(node, whole.uid)
        assert env["NVIDIA_VISIBLE_DEVICES"] == gpu1
        assert env["CUDA_DEVICE_MEMORY_LIMIT_0"] == "40960m"
        assert env["NVIDIA_GPU_MEMORY_LIMIT"] == "40960"
        # Shares of GPU 1 are refused while it is held, by the scheduler and by the driver.
        with pytest.raises(KubeApiError, match="0 of 40Gi free"):
            node.claim("late", [name1], namespace="ml", capacity=_gib(1))
        node.claim("late", [name1], pods=["pod-l"], namespace="ml", capacity=_gib(1), check=False)
        with pytest.raises(PodPreparationError, match="has 0 of memory free"):
            await node.prepare(node.pod("late", namespace="ml", uid="pod-l"))


def _gib(n: int) -> dict[str, dict[str, Quantity]]:
    return {"devices": {"memory": Quantity(n * GiB)}}


def test_the_toolkit_variables_are_set_only_for_one_limit_per_container() -> None:
    one = Allocation(env={"CUDA_DEVICE_MEMORY_LIMIT_0": "7680m", "NVIDIA_VISIBLE_DEVICES": "a"})
    equal = Allocation(
        env={"CUDA_DEVICE_MEMORY_LIMIT_0": "1024m", "CUDA_DEVICE_MEMORY_LIMIT_1": "1024m"}
    )
    unequal = Allocation(
        env={"CUDA_DEVICE_MEMORY_LIMIT_0": "1024m", "CUDA_DEVICE_MEMORY_LIMIT_1": "2048m"}
    )

    assert enforced(one).env["NVIDIA_GPU_MEMORY_LIMIT"] == "7680"
    assert enforced(one).env["NVIDIA_GPU_MEMORY_REQUEST"] == "7680"
    assert enforced(equal).env["NVIDIA_GPU_MEMORY_LIMIT"] == "1024"
    # The hook sets one limit for every GPU of the container: two amounts cannot be said.
    assert enforced(unequal) == unequal
    assert enforced(Allocation(env={"NVIDIA_VISIBLE_DEVICES": "a"})).env == {
        "NVIDIA_VISIBLE_DEVICES": "a"
    }


def test_whole_by_default_cannot_be_capped() -> None:
    assert Shareable("memory", GiB, whole_by_default=True).whole_by_default
    with pytest.raises(ValueError, match="whole_by_default needs most=None"):
        Shareable("memory", GiB, most=2, whole_by_default=True)
