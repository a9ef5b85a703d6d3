"""Issue 28, item 2: MIG through DRA. A MIG-configured fake GPU is published as the GPU plus its
MIG devices, all consuming one counter set of the GPU's, the counter set in a slice of its own
(Kubernetes >= 1.35); the scheduler (MemoryApi) and the driver give either the GPU or its
partitions, never both. Also: MemoryApi validates counters and request policies as the API
server does, and the new fields survive the real client on the wire."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from kube_apiserver import FakeApiServer

from devplugin_sdk.backends.nvidia import NvidiaConfig, NvmlPlugin
from devplugin_sdk.dra import ResourceSlice, SliceDevice, device_name, kube_api
from devplugin_sdk.dra.resources import CounterConsumption, CounterSet, RequestPolicy
from devplugin_sdk.errors import KubeApiError
from devplugin_sdk.kubelet.fake_dra import DraPod, PodPreparationError
from devplugin_sdk.testing import DraNode, FakeKubelet, MemoryApi, fake_nvml, serving
from devplugin_sdk.types import Quantity

DRIVER = "gpu.nvidia.com"
MiB = 2**20


def _visible(node: DraNode, uid: str) -> str:
    (device,) = node.spec(uid).devices
    env = dict(e.split("=", 1) for e in device["containerEdits"]["env"])
    return env["NVIDIA_VISIBLE_DEVICES"]


async def test_a_mig_gpu_is_published_with_its_partitions_sharing_counters(tmp_path: Path) -> None:
    nvml = fake_nvml.a100_mig([("3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"), None])
    roots = nvml.write_host(tmp_path / "host")
    config = NvidiaConfig(
        sysfs_root=roots.sysfs_root,
        dev_root=roots.dev_root,
        proc_root=roots.proc_root,
        mig_strategy="mixed",
    )
    api = MemoryApi(nodes=["node-1"])
    mig_gpu, plain_gpu = nvml.gpus
    whole = device_name(mig_gpu.uuid)
    migs = {m.uuid: device_name(m.uuid) for m in mig_gpu.migs}
    big = device_name(mig_gpu.migs[0].uuid)  # the 3g.40gb
    async with DraNode(*NvmlPlugin.build(config, nvml=nvml), driver=DRIVER, memory=api) as node:
        kubelet = node.kubelet

        def pod_of(claim: str, uid: str) -> DraPod:
            return node.pod(claim, name=claim, namespace="ml", uid=uid)

        await kubelet.wait_for(
            lambda: len(node.published()) == 6, what="the GPUs and MIG devices published"
        )
        slices = api.pool(DRIVER, "node-1")
        # 1.35: a slice holds devices or counter sets, never both.
        assert all(not (s.devices and s.shared_counters) for s in slices)
        (counters,) = [c for s in slices for c in s.shared_counters]
        assert counters == CounterSet(whole, {"memory": Quantity(81920 * MiB)})
        devices = {d.name: d for s in slices for d in s.devices}
        assert set(devices) == {whole, device_name(plain_gpu.uuid), *migs.values()}
        assert devices[whole].consumes_counters == (
            CounterConsumption(whole, {"memory": Quantity(81920 * MiB)}),
        )
        for mig in mig_gpu.migs:
            assert devices[migs[mig.uuid]].consumes_counters == (
                CounterConsumption(whole, {"memory": Quantity(mig.memory_mib * MiB)}),
            )
        assert devices[device_name(plain_gpu.uuid)].consumes_counters == ()

        # The partitions fit together; the GPU does not fit beside one.
        a = api.allocate("ml", "a", {"mig": [big]}, driver=DRIVER, pool="node-1", pods=["a"])
        api.allocate(
            "ml",
            "b",
            {"mig": [migs[mig_gpu.migs[2].uuid]]},
            driver=DRIVER,
            pool="node-1",
            pods=["b"],
        )
        with pytest.raises(KubeApiError, match=f"counter {whole}/memory has"):
            api.allocate("ml", "w", {"gpu": [whole]}, driver=DRIVER, pool="node-1")
        await node.prepare(pod_of("a", "a"))
        assert _visible(node, a.uid) == mig_gpu.migs[0].uuid

        # A scheduler that allocated the GPU anyway: the driver refuses that claim.
        api.allocate(
            "ml",
            "w",
            {"gpu": [whole]},
            driver=DRIVER,
            pool="node-1",
            pods=["w"],
            check=False,
        )
        with pytest.raises(
            PodPreparationError,
            match=f"device {whole} is already prepared through {big}, which it overlaps, "
            "for claim ml/a",
        ):
            await node.prepare(pod_of("w", "w"))

        # Once the partitions are free, the whole GPU is allocated and prepared; then no
        # partition can be.
        await node.unprepare(pod_of("a", "a"))
        api.delete_claim("ml", "a")
        api.delete_claim("ml", "b")
        w = api.allocate("ml", "w", {"gpu": [whole]}, driver=DRIVER, pool="node-1", pods=["w"])
        await node.prepare(pod_of("w", "w"))
        assert _visible(node, w.uid) == mig_gpu.uuid
        with pytest.raises(KubeApiError, match="counter"):
            api.allocate("ml", "c", {"mig": [big]}, driver=DRIVER, pool="node-1")

    # The device plugin's side is as before: the MIG devices by profile, the plain GPU.
    async with FakeKubelet() as kubelet:
        async with serving(*NvmlPlugin.build(config, nvml=nvml), settings=kubelet.settings()):
            listed = {
                "nvidia.com/gpu": [plain_gpu.uuid],
                "nvidia.com/mig-1g.10gb": [m.uuid for m in mig_gpu.migs[2:]],
                "nvidia.com/mig-2g.20gb": [mig_gpu.migs[1].uuid],
                "nvidia.com/mig-3g.40gb": [mig_gpu.migs[0].uuid],
            }
            await kubelet.wait_for(
                lambda: all(sorted(kubelet.devices(r)) == sorted(ids) for r, ids in listed.items()),
                what="the device plugin's lists",
            )


def _slice(devices: tuple[SliceDevice, ...] = (), counters: tuple[CounterSet, ...] = ()) -> Any:
    return ResourceSlice("", DRIVER, "node-1", "node-1", 1, 1, devices, shared_counters=counters)


ONE = {"memory": Quantity(1)}


@pytest.mark.parametrize(
    ("bad", "problem"),
    [
        (
            _slice((SliceDevice("a"),), (CounterSet("c", ONE),)),
            "devices and sharedCounters in one slice",
        ),
        (_slice(counters=tuple(CounterSet(f"c{i}", ONE) for i in range(9))), "at most 8"),
        (_slice(counters=(CounterSet("Bad_Name", ONE),)), "sharedCounters[0].name"),
        (
            _slice(
                (
                    SliceDevice(
                        "a",
                        consumes_counters=tuple(CounterConsumption(f"c{i}", ONE) for i in range(3)),
                    ),
                )
            ),
            "consumesCounters: at most 2",
        ),
        (
            _slice(
                tuple(
                    SliceDevice(f"d{i}", consumes_counters=(CounterConsumption("c", ONE),))
                    for i in range(65)
                )
            ),
            "65 devices: at most 64 per slice",
        ),
        (
            _slice(
                (
                    SliceDevice(
                        "a", capacity=ONE, request_policies={"memory": RequestPolicy(Quantity(1))}
                    ),
                )
            ),
            "requestPolicy needs allowMultipleAllocations",
        ),
        (
            _slice(
                (
                    SliceDevice(
                        "a",
                        capacity={"memory": Quantity(10)},
                        allow_multiple_allocations=True,
                        request_policies={
                            "memory": RequestPolicy(
                                Quantity(3),
                                minimum=Quantity(2),
                                maximum=Quantity(9),
                                step=Quantity(2),
                            )
                        },
                    ),
                )
            ),
            "default is not a multiple of step from min",
        ),
        (
            _slice(
                (
                    SliceDevice(
                        "a",
                        capacity={"memory": Quantity(10)},
                        allow_multiple_allocations=True,
                        request_policies={
                            "memory": RequestPolicy(
                                Quantity(5), valid_values=tuple(Quantity(i) for i in range(11))
                            )
                        },
                    ),
                )
            ),
            "validValues: at most 10",
        ),
    ],
)
async def test_memory_api_refuses_what_the_api_server_refuses(bad: Any, problem: str) -> None:
    api = MemoryApi(nodes=["node-1"])
    with pytest.raises(KubeApiError, match="is invalid") as refused:
        await api.create_slice(bad)
    assert problem in str(refused.value)


def test_request_policies_round_as_the_scheduler_does() -> None:
    capacity = Quantity(40)
    ranged = RequestPolicy(Quantity(4), minimum=Quantity(4), maximum=Quantity(20), step=Quantity(4))
    assert ranged.consumed(None, capacity) == Quantity(4)
    assert ranged.consumed(Quantity(1), capacity) == Quantity(4)  # below min: min
    assert ranged.consumed(Quantity(5), capacity) == Quantity(8)  # up to min + n * step
    assert ranged.consumed(Quantity(21), capacity) is None  # past max
    listed = RequestPolicy(Quantity(2), valid_values=(Quantity(2), Quantity(6)))
    assert listed.consumed(Quantity(3), capacity) == Quantity(6)
    assert listed.consumed(Quantity(7), capacity) is None


async def test_shares_and_counters_survive_the_real_client(tmp_path: Path) -> None:
    memory = MemoryApi(nodes=["node-1"])
    shared = SliceDevice(
        "gpu-0",
        {"index": 0},
        {"memory": Quantity(40 * 2**30)},
        allow_multiple_allocations=True,
        request_policies={
            "memory": RequestPolicy(
                Quantity(2**30),
                minimum=Quantity(2**30),
                maximum=Quantity(40 * 2**30),
                step=Quantity(2**30),
            )
        },
    )
    part = SliceDevice(
        "mig-0", consumes_counters=(CounterConsumption("gpu-1", {"memory": Quantity(10)}),)
    )
    async with FakeApiServer(memory).serving() as server:
        api = kube_api(server.kubeconfig(tmp_path / "kubeconfig"))
        try:
            counters = await api.create_slice(
                _slice(counters=(CounterSet("gpu-1", {"memory": Quantity(80)}),))
            )
            assert counters.shared_counters == (CounterSet("gpu-1", {"memory": Quantity(80)}),)
            assert counters.devices == ()
            made = await api.create_slice(_slice((shared, part)))
            assert made.devices == (shared, part)
            memory.allocate(
                "ns",
                "c",
                {"r": ["gpu-0"]},
                driver=DRIVER,
                pool="node-1",
                capacity={"r": {"memory": Quantity(3 * 2**30)}},
            )
            (result,) = (await api.read_claim("ns", "c")).results
            assert result.share_id
            assert result.consumed == {"memory": Quantity(3 * 2**30)}
            memory.allocate(
                "ns", "m", {"r": ["mig-0"]}, driver=DRIVER, pool="node-1", admin_access=True
            )
            (result,) = (await api.read_claim("ns", "m")).results
            assert result.admin_access
        finally:
            await api.aclose()


async def test_without_partitionable_devices_the_gpu_beside_its_mig_devices_is_withdrawn(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An API server before 1.36 drops counters silently (DRAPartitionableDevices off): the
    driver notices and publishes the MIG devices alone, so the scheduler cannot give both."""
    nvml = fake_nvml.a100_mig([("3g.40gb", "1g.10gb"), None])
    roots = nvml.write_host(tmp_path / "host")
    config = NvidiaConfig(
        sysfs_root=roots.sysfs_root,
        dev_root=roots.dev_root,
        proc_root=roots.proc_root,
        mig_strategy="mixed",
    )
    api = MemoryApi(nodes=["node-1"], partitionable_devices=False)
    mig_gpu, plain_gpu = nvml.gpus
    expected = {device_name(plain_gpu.uuid), *(device_name(m.uuid) for m in mig_gpu.migs)}
    async with DraNode(*NvmlPlugin.build(config, nvml=nvml), driver=DRIVER, memory=api) as node:
        await node.kubelet.wait_for(
            lambda: set(node.published()) == expected, what="the MIG devices without their GPU"
        )
        assert not any(s.shared_counters for s in api.pool(DRIVER, "node-1"))
    assert "dropped the devices' counters" in caplog.text
