"""GPU sharing by memory units (gpushare's model) and by slices (HAMi's), on fake NVML machines.

Placement is checked both at the plugin (the hook, as the SDK calls it) and through FakeKubelet's
admission (GetPreferredAllocation, then Allocate), on an A100x8 40 GiB node.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import pytest

from devplugin_sdk._wire import convert
from devplugin_sdk.api import constants
from devplugin_sdk.backends.nvidia import (
    Interceptor,
    MemorySharing,
    NvidiaConfig,
    NvmlPlugin,
    VgpuSharing,
    from_config,
)
from devplugin_sdk.errors import AllocationError, ConfigError
from devplugin_sdk.testing import AdmissionError, FakeKubelet, fake_nvml, serving
from devplugin_sdk.testing.fake_nvml import FakeNVML
from devplugin_sdk.types import Device, Effect, Health, HealthEvent, HealthReport, Mount

MEM = "nvidia.com/gpu-memory"
GPU = "nvidia.com/gpu"
NEVER = 3600.0


def plugins_for(nvml: FakeNVML, tmp_path: Path, config: dict[str, Any]) -> list[NvmlPlugin]:
    """``from_config`` as ``devplugin run nvidia`` calls it, on the fake machine ``nvml``."""
    roots = nvml.write_host(tmp_path)
    with nvml.installed():
        plugins = from_config({**config, **roots.config()})
    return [p for p in plugins if isinstance(p, NvmlPlugin)]


def memory(**keys: Any) -> dict[str, Any]:
    return {"sharing": {"memory": keys}, "health": {"probeInterval": NEVER}}


def vgpu(**keys: Any) -> dict[str, Any]:
    return {"sharing": {"vgpu": {"slices": 4, **keys}}, "health": {"probeInterval": NEVER}}


def gpu_index(nvml: FakeNVML) -> dict[str, int]:
    return {g.uuid: g.index for g in nvml.gpus}


def units_of(devices: Sequence[Device], nvml: FakeNVML) -> dict[int, int]:
    """How many of ``devices`` each GPU index holds."""
    index = gpu_index(nvml)
    out: dict[int, int] = {}
    for device in devices:
        assert device.parent is not None
        out[index[device.parent]] = out.get(index[device.parent], 0) + 1
    return out


# ----------------------------------------------------------------------------- configuration


def test_the_memory_and_vgpu_keys_are_read_with_their_defaults() -> None:
    config = NvidiaConfig.from_mapping({"sharing": {"memory": {}}})
    assert config.memory == MemorySharing()
    assert config.memory.resource_name == MEM
    assert (config.memory.unit, config.memory.placement) == ("GiB", "binpack")
    assert config.memory.count_resource_name is None
    assert not config.memory.multi_gpu
    assert config.memory.interceptor is None

    config = NvidiaConfig.from_mapping({"sharing": {"vgpu": {"slices": 3, "interceptor": {}}}})
    assert config.vgpu == VgpuSharing(3, interceptor=Interceptor(Path("/usr/local/vgpu")))


def test_every_memory_key_is_read() -> None:
    config = NvidiaConfig.from_mapping(
        {
            "sharing": {
                "memory": {
                    "resourceName": "aliyun.com/gpu-mem",
                    "unit": "MiB",
                    "placement": "spread",
                    "countResourceName": "aliyun.com/gpu-count",
                    "multiGpu": True,
                    "interceptor": {"hostPath": "/opt/hami"},
                }
            }
        }
    )

    assert config.memory == MemorySharing(
        "aliyun.com/gpu-mem",
        "MiB",
        "spread",
        "aliyun.com/gpu-count",
        True,
        Interceptor("/opt/hami"),
    )


@pytest.mark.parametrize(
    ("config", "line"),
    [
        (
            {"sharing": {"memory": {}, "vgpu": {"slices": 2}}},
            "sharing.vgpu: cannot be combined with sharing.memory",
        ),
        (
            {"sharing": {"timeSlicing": {"replicas": 1}, "memory": {}}},
            "sharing.memory: cannot be combined with sharing.timeSlicing",
        ),
        (
            {"migStrategy": "single", "sharing": {"memory": {}}},
            "sharing.memory: needs migStrategy none or mixed",
        ),
        (
            {"migStrategy": "single", "sharing": {"vgpu": {"slices": 2}}},
            "sharing.vgpu: needs migStrategy none or mixed",
        ),
        ({"sharing": {"memory": {"unit": "KiB"}}}, "sharing.memory.unit: must be one of GiB, MiB"),
        (
            {"sharing": {"memory": {"placement": "first"}}},
            "sharing.memory.placement: must be one of binpack, spread",
        ),
        (
            {"sharing": {"memory": {"countResourceName": MEM}}},
            "sharing.memory.countResourceName: must differ from sharing.memory.resourceName",
        ),
        (
            {"sharing": {"memory": {"resourceName": "gpu-memory"}}},
            "sharing.memory.resourceName: invalid resource name",
        ),
        ({"sharing": {"memory": {"multiGpu": "yes"}}}, "sharing.memory.multiGpu: must be true"),
        (
            {"sharing": {"memory": {"units": "GiB"}}},
            "sharing.memory.units: unknown key; did you mean 'unit'?",
        ),
        ({"sharing": {"memory": 40}}, "sharing.memory: must be a mapping"),
        ({"sharing": {"vgpu": {}}}, "sharing.vgpu.slices: is required"),
        ({"sharing": {"vgpu": {"slices": 0}}}, "sharing.vgpu.slices: must be >= 1"),
        ({"sharing": {"vgpu": {"slices": 101}}}, "sharing.vgpu.slices: must be <= 100"),
        ({"sharing": {"vgpu": {"slices": 2, "coreLimit": 1}}}, "sharing.vgpu.coreLimit"),
        (
            {"sharing": {"vgpu": {"slices": 2, "interceptor": {"hostPath": "vgpu"}}}},
            "sharing.vgpu.interceptor.hostPath: must be an absolute path",
        ),
        (
            {"sharing": {"vgpu": {"slices": 2, "interceptor": {"path": "/x"}}}},
            "sharing.vgpu.interceptor.path: unknown key; expected one of hostPath",
        ),
    ],
)
def test_a_bad_sharing_config_names_the_dotted_key(config: dict[str, Any], line: str) -> None:
    with pytest.raises(ConfigError) as caught:
        NvidiaConfig.from_mapping(config)

    assert str(caught.value).startswith(line)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"replicas": 2, "memory": MemorySharing()}, "three ways to share"),
        ({"memory": MemorySharing(), "vgpu": VgpuSharing(2)}, "three ways to share"),
        ({"vgpu": VgpuSharing(2), "mig_strategy": "single"}, "none or mixed"),
    ],
)
def test_the_dataclasses_refuse_the_same_combinations(
    changes: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        NvidiaConfig(**changes)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: MemorySharing(unit="TiB"), "unit must be one of"),
        (lambda: MemorySharing(count_resource_name=MEM), "must differ"),
        (lambda: VgpuSharing(0), "between 1 and 100"),
        (lambda: Interceptor(Path("relative")), "must be absolute"),
    ],
)
def test_the_sharing_dataclasses_check_their_values(make: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make()


def test_a_plugin_must_serve_what_the_config_shares(tmp_path: Path) -> None:
    nvml = fake_nvml.t4_pcie()
    with pytest.raises(ValueError, match="does not match"):
        NvmlPlugin(NvidiaConfig(), nvml=nvml, serves="memory")
    with pytest.raises(ValueError, match="does not match"):
        NvmlPlugin(NvidiaConfig(memory=MemorySharing()), nvml=nvml, serves="gpus")
    with pytest.raises(ValueError, match="count_resource_name"):
        NvmlPlugin(NvidiaConfig(memory=MemorySharing()), nvml=nvml, serves="count")


# ----------------------------------------------------------------------------- the 4 MiB limit


async def test_mib_units_of_three_40_gb_gpus_are_refused_with_the_size(tmp_path: Path) -> None:
    nvml = FakeNVML(fake_nvml.dgx_a100_40gb().gpus[:3])

    with pytest.raises(ConfigError) as caught:
        plugins_for(nvml, tmp_path, memory(unit="MiB"))

    assert caught.value.key == "sharing.memory.unit"
    assert "122,880 devices on 3 GPUs" in caught.value.reason
    assert "over the kubelet's limit of 4,194,304 bytes (4 MiB); use GiB" in caught.value.reason
    # The size named is the list with every unit Unhealthy, as the SDK would encode it.
    [said] = re.findall(r"up to ([\d,]+) bytes", caught.value.reason)
    roots = nvml.write_host(tmp_path)
    config = NvidiaConfig(memory=MemorySharing(unit="MiB"), sysfs_root=roots.sysfs_root)
    devices = await NvmlPlugin(config, nvml=nvml).discover()
    encoded = sum(len(convert.list_and_watch_entry(d, Health.UNHEALTHY)) for d in devices)
    assert int(said.replace(",", "")) == encoded


async def test_mib_units_of_two_40_gb_gpus_fit_even_when_every_unit_is_unhealthy(
    tmp_path: Path,
) -> None:
    nvml = FakeNVML(fake_nvml.dgx_a100_40gb().gpus[:2])

    [plugin] = plugins_for(nvml, tmp_path, memory(unit="MiB"))
    devices = await plugin.discover()

    assert len(devices) == 81_920
    encoded = sum(len(convert.list_and_watch_entry(d, Health.UNHEALTHY)) for d in devices)
    assert encoded <= constants.MAX_MESSAGE_BYTES


# ----------------------------------------------------------------------------- discovery


async def test_each_gpu_is_advertised_as_its_memory_in_units_children_of_the_gpu(
    tmp_path: Path,
) -> None:
    nvml = fake_nvml.dgx_a100_40gb()
    [plugin] = plugins_for(nvml, tmp_path, memory())

    devices = await plugin.discover()

    assert plugin.resource_name == MEM
    assert len(devices) == 320
    assert units_of(devices, nvml) == dict.fromkeys(range(8), 40)
    first = nvml.gpus[5].uuid.removeprefix("GPU-").split("-")[0]
    unit = next(d for d in devices if d.id == f"{first}-39")
    assert unit.parent == nvml.gpus[5].uuid
    assert unit.numa_nodes == (7,)
    assert unit.device_nodes[0].host_path == "/dev/nvidia5"
    assert all(len(d.id) <= 14 for d in devices)


async def test_mib_units_and_a_count_resource_like_gpushare(tmp_path: Path) -> None:
    nvml = fake_nvml.t4_pcie()
    config = memory(
        resourceName="aliyun.com/gpu-mem", unit="MiB", countResourceName="aliyun.com/gpu-count"
    )
    mem, count = plugins_for(nvml, tmp_path, config)

    assert (mem.resource_name, count.resource_name) == (
        "aliyun.com/gpu-mem",
        "aliyun.com/gpu-count",
    )
    assert units_of(await mem.discover(), nvml) == dict.fromkeys(range(4), 15360)
    assert [d.id for d in await count.discover()] == [g.uuid for g in nvml.gpus]


async def test_two_gpus_sharing_a_first_uuid_group_use_their_whole_uuids(
    tmp_path: Path,
) -> None:
    machine = fake_nvml.t4_pcie()
    twin = "GPU-abcdef01-0000-0000-0000-000000000000"
    machine.gpus[0].uuid, machine.gpus[1].uuid = (
        twin,
        twin.replace("0000-0000-0000", "1111-0000-0000"),
    )
    [plugin] = plugins_for(machine, tmp_path, memory())

    devices = await plugin.discover()

    assert {d.id.rpartition("-")[0] for d in devices} == {
        machine.gpus[0].uuid,
        machine.gpus[1].uuid,
        machine.gpus[2].uuid.removeprefix("GPU-").split("-")[0],
        machine.gpus[3].uuid.removeprefix("GPU-").split("-")[0],
    }


async def test_mixed_mig_shares_only_the_gpus_without_mig(tmp_path: Path) -> None:
    nvml = fake_nvml.a100_mig([("3g.40gb", "3g.40gb"), None])

    plugins = plugins_for(nvml, tmp_path, {**memory(), "migStrategy": "mixed"})

    assert [p.resource_name for p in plugins] == [MEM, "nvidia.com/mig-3g.40gb"]
    assert units_of(await plugins[0].discover(), nvml) == {1: 80}
    assert len(await plugins[1].discover()) == 2


async def test_slices_are_the_gpus_advertised_slices_times(tmp_path: Path) -> None:
    nvml = fake_nvml.dgx_a100_40gb()
    [plugin] = plugins_for(nvml, tmp_path, vgpu())

    devices = await plugin.discover()

    assert plugin.resource_name == GPU
    assert len(devices) == 32
    assert devices[5].id == f"{nvml.gpus[1].uuid}::1"
    assert devices[5].parent == nvml.gpus[1].uuid


# ----------------------------------------------------------------------------- allocation


async def test_units_on_one_gpu_get_that_gpu_and_gpushares_variables(tmp_path: Path) -> None:
    nvml = fake_nvml.dgx_a100_40gb()
    [plugin] = plugins_for(nvml, tmp_path, memory())
    devices = await plugin.discover()
    on_gpu3 = [d for d in devices if d.parent == nvml.gpus[3].uuid][:10]

    allocation = await plugin.allocate(on_gpu3)

    assert allocation.env == {
        "NVIDIA_VISIBLE_DEVICES": nvml.gpus[3].uuid,
        "ALIYUN_COM_GPU_MEM_IDX": "3",
        "ALIYUN_COM_GPU_MEM_DEV": "40",
        "ALIYUN_COM_GPU_MEM_CONTAINER": "10",
        "CUDA_DEVICE_MEMORY_LIMIT_0": "10240m",
    }
    assert allocation.device_nodes[0].host_path == "/dev/nvidia3"
    assert allocation.mounts == ()


async def test_mib_units_set_the_limit_in_mib_and_cdi_names_the_gpu(tmp_path: Path) -> None:
    nvml = fake_nvml.t4_pcie()
    config = {**memory(unit="MiB"), "deviceListStrategy": ["cdi", "envvar"]}
    [plugin] = plugins_for(nvml, tmp_path, config)
    devices = await plugin.discover()

    allocation = await plugin.allocate(devices[:1500])

    assert allocation.env["CUDA_DEVICE_MEMORY_LIMIT_0"] == "1500m"
    assert allocation.env["ALIYUN_COM_GPU_MEM_DEV"] == "15360"
    assert allocation.env["ALIYUN_COM_GPU_MEM_CONTAINER"] == "1500"
    assert allocation.cdi_devices == (f"nvidia.com/gpu={nvml.gpus[0].uuid}",)


async def test_units_spread_over_gpus_are_refused_naming_where_they_are(tmp_path: Path) -> None:
    nvml = fake_nvml.dgx_a100_40gb()
    [plugin] = plugins_for(nvml, tmp_path, memory())
    devices = await plugin.discover()
    split = [d for d in devices if d.parent == nvml.gpus[2].uuid][:30]
    split += [d for d in devices if d.parent == nvml.gpus[6].uuid][:15]

    with pytest.raises(AllocationError) as caught:
        await plugin.allocate(split)

    assert str(caught.value) == (
        f"{MEM}: 45 GiB requested, and the kubelet chose units on several GPUs"
        " (30 GiB on GPU 2, 15 GiB on GPU 6); a container's memory must be on one GPU"
        " (sharing.memory.multiGpu allows several)"
    )


async def test_after_a_preference_the_refusal_names_the_largest_free_block(
    tmp_path: Path,
) -> None:
    nvml = fake_nvml.dgx_a100_40gb()
    [plugin] = plugins_for(nvml, tmp_path, memory())
    devices = await plugin.discover()
    # GPU 2 has 30 GiB free, every other GPU 10.
    free = [d for d in devices if units_of([d], nvml) != {2: 1}][::4]
    free += [d for d in devices if d.parent == nvml.gpus[2].uuid][:30]

    chosen = await plugin.preferred_allocation(free, [], 45)
    by_id = {d.id: d for d in devices}
    with pytest.raises(AllocationError) as caught:
        await plugin.allocate([by_id[i] for i in chosen])

    assert units_of([by_id[i] for i in chosen], nvml) == {2: 30, 0: 10, 1: 5}
    assert f"{MEM}: no single GPU has 45 GiB free; largest free: 30 GiB on GPU 2" in str(
        caught.value
    )
    assert "(free GiB by GPU: 0:10 1:10 2:30 3:10 4:10 5:10 6:10 7:10)" in str(caught.value)


async def test_multi_gpu_gives_every_gpu_with_a_limit_each_in_visible_order(
    tmp_path: Path,
) -> None:
    nvml = fake_nvml.dgx_a100_40gb()
    [plugin] = plugins_for(nvml, tmp_path, memory(multiGpu=True, interceptor={}))
    devices = await plugin.discover()
    split = [d for d in devices if d.parent == nvml.gpus[6].uuid][:5]
    split += [d for d in devices if d.parent == nvml.gpus[1].uuid][:40]

    allocation = await plugin.allocate(split)

    assert allocation.env["NVIDIA_VISIBLE_DEVICES"] == f"{nvml.gpus[1].uuid},{nvml.gpus[6].uuid}"
    assert allocation.env["CUDA_DEVICE_MEMORY_LIMIT_0"] == "40960m"
    assert allocation.env["CUDA_DEVICE_MEMORY_LIMIT_1"] == "5120m"
    assert allocation.env["ALIYUN_COM_GPU_MEM_IDX"] == "1,6"
    assert allocation.env["ALIYUN_COM_GPU_MEM_DEV"] == "40,40"
    assert allocation.env["ALIYUN_COM_GPU_MEM_CONTAINER"] == "45"
    assert allocation.mounts == (
        Mount("/usr/local/vgpu/libvgpu.so", "/usr/local/vgpu/libvgpu.so", read_only=True),
        Mount("/usr/local/vgpu/ld.so.preload", "/etc/ld.so.preload", read_only=True),
        Mount("/usr/local/vgpu/vgpulock", "/tmp/vgpulock"),
    )


async def test_the_count_resource_gives_the_container_nothing(tmp_path: Path) -> None:
    nvml = fake_nvml.t4_pcie()
    _, count = plugins_for(nvml, tmp_path, memory(countResourceName="aliyun.com/gpu-count"))

    devices = await count.discover()

    assert (await count.allocate(devices[:2])).env == {}
    assert (await count.allocate(devices[:2])).device_nodes == ()


async def test_slices_get_their_gpus_in_index_order_with_hami_cores_limits(
    tmp_path: Path,
) -> None:
    nvml = fake_nvml.dgx_a100_40gb()
    [plugin] = plugins_for(nvml, tmp_path, vgpu(interceptor={"hostPath": "/opt/hami"}))
    devices = await plugin.discover()

    allocation = await plugin.allocate([devices[4 * 5 + 2], devices[4 * 1 + 3]])

    assert allocation.env == {
        "NVIDIA_VISIBLE_DEVICES": f"{nvml.gpus[1].uuid},{nvml.gpus[5].uuid}",
        "CUDA_DEVICE_MEMORY_LIMIT_0": "10240m",
        "CUDA_DEVICE_MEMORY_LIMIT_1": "10240m",
        "CUDA_DEVICE_SM_LIMIT": "25",
    }
    assert [m.host_path for m in allocation.mounts] == [
        "/opt/hami/libvgpu.so",
        "/opt/hami/ld.so.preload",
        "/opt/hami/vgpulock",
    ]


async def test_slice_limits_can_be_switched_off(tmp_path: Path) -> None:
    nvml = fake_nvml.t4_pcie()
    [plugin] = plugins_for(nvml, tmp_path, vgpu(slices=3, memoryLimit=False))
    devices = await plugin.discover()

    allocation = await plugin.allocate(devices[:1])

    assert allocation.env == {
        "NVIDIA_VISIBLE_DEVICES": nvml.gpus[0].uuid,
        "CUDA_DEVICE_SM_LIMIT": "33",
    }
    [plugin] = plugins_for(nvml, tmp_path, vgpu(slices=3, coreLimit=False))
    allocation = await plugin.allocate((await plugin.discover())[:1])
    assert "CUDA_DEVICE_SM_LIMIT" not in allocation.env
    assert allocation.env["CUDA_DEVICE_MEMORY_LIMIT_0"] == "5120m"


async def test_two_slices_of_one_gpu_are_refused(tmp_path: Path) -> None:
    nvml = fake_nvml.dgx_a100_40gb()
    [plugin] = plugins_for(nvml, tmp_path, vgpu())
    devices = await plugin.discover()

    with pytest.raises(AllocationError) as caught:
        await plugin.allocate([devices[0], devices[1], devices[9]])

    assert str(caught.value) == (
        f"{GPU}: 3 slices requested, got 2 on GPU 0, 1 on GPU 2;"
        " each slice of a container must be on a different GPU"
    )


# ----------------------------------------------------------------------------- preference


async def test_binpack_and_spread_prefer_the_fullest_and_the_emptiest_gpu_that_fits(
    tmp_path: Path,
) -> None:
    nvml = fake_nvml.dgx_a100_40gb()
    for placement, expected in (("binpack", 4), ("spread", 0)):
        [plugin] = plugins_for(nvml, tmp_path, memory(placement=placement))
        devices = await plugin.discover()
        # GPU 4 has 12 GiB free, GPU 6 8 GiB, GPU 0 40 GiB; the rest is taken.
        free = [d for d in devices if d.parent == nvml.gpus[4].uuid][:12]
        free += [d for d in devices if d.parent == nvml.gpus[6].uuid][:8]
        free += [d for d in devices if d.parent == nvml.gpus[0].uuid]

        chosen = await plugin.preferred_allocation(free, [], 10)

        assert units_of([d for d in devices if d.id in set(chosen)], nvml) == {expected: 10}


async def test_the_rest_of_a_request_joins_its_must_include_units(tmp_path: Path) -> None:
    nvml = fake_nvml.dgx_a100_40gb()
    [plugin] = plugins_for(nvml, tmp_path, memory())
    devices = await plugin.discover()
    reused = [d for d in devices if d.parent == nvml.gpus[7].uuid][:4]

    chosen = await plugin.preferred_allocation(devices, reused, 20)

    assert list(chosen[:4]) == [d.id for d in reused]
    assert units_of([d for d in devices if d.id in set(chosen)], nvml) == {7: 20}


async def test_slices_are_preferred_on_distinct_gpus_the_freest_first(tmp_path: Path) -> None:
    nvml = fake_nvml.dgx_a100_40gb()
    [plugin] = plugins_for(nvml, tmp_path, vgpu())
    devices = await plugin.discover()
    # Every GPU has one slice in use but GPUs 3 and 6.
    free = [
        d
        for d in devices
        if not d.id.endswith("::0") or d.parent in {nvml.gpus[i].uuid for i in (3, 6)}
    ]

    chosen = await plugin.preferred_allocation(free, [], 3)

    got = units_of([d for d in devices if d.id in set(chosen)], nvml)
    assert set(got.values()) == {1}
    assert {3, 6} <= set(got)


# ----------------------------------------------------------------------------- health


async def test_memory_units_health_is_reported_by_gpu(tmp_path: Path) -> None:
    nvml = fake_nvml.dgx_a100_40gb()
    [plugin] = plugins_for(nvml, tmp_path, memory())
    devices = await plugin.discover()
    nvml.lose(2)

    report = await plugin.check_health(devices)

    assert isinstance(report, HealthReport)
    assert dict(report) == {
        g.uuid: Health.UNHEALTHY if g.index == 2 else Health.HEALTHY for g in nvml.gpus
    }
    assert report.reasons[nvml.gpus[2].uuid].startswith("GPU lost")


async def test_an_xid_is_one_event_for_the_gpu_and_its_units(tmp_path: Path) -> None:
    nvml = fake_nvml.dgx_a100_40gb()
    [plugin] = plugins_for(nvml, tmp_path, memory())
    await plugin.discover()

    async with anyio.create_task_group() as tg:
        send, receive = anyio.create_memory_object_stream[Any](10)

        async def pump() -> None:
            async for event in plugin.watch():
                await send.send(event)

        tg.start_soon(pump)
        assert await anyio.to_thread.run_sync(nvml.wait_for_waiters, 1, 5.0)
        nvml.xid(4, 79)
        with anyio.fail_after(5):
            event = await receive.receive()
        tg.cancel_scope.cancel()

    assert event == HealthEvent(
        nvml.gpus[4].uuid,
        Health.UNHEALTHY,
        "Xid 79 (GPU has fallen off the bus)",
        Effect.NO_EXECUTE,
    )
    send.close()
    receive.close()
    await plugin.on_stop()


# ----------------------------------------------------------------------------- through the kubelet


async def test_10_35_30_gib_land_as_binpack_says_and_45_gets_the_clear_error(
    tmp_path: Path,
) -> None:
    nvml = fake_nvml.dgx_a100_40gb()
    plugins = plugins_for(nvml, tmp_path, memory())
    index = gpu_index(nvml)

    async with FakeKubelet() as kubelet, serving(*plugins, settings=kubelet.settings()):
        await kubelet.wait_for_allocatable(MEM, 320)
        landed = []
        for size in (10, 35, 30):
            got = await kubelet.allocate(MEM, size)
            landed.append(index[got.allocation.env["NVIDIA_VISIBLE_DEVICES"]])
        with pytest.raises(AdmissionError) as caught:
            await kubelet.allocate(MEM, 45)

    assert landed == [0, 1, 0]
    assert str(caught.value) == (
        "Allocate failed due to rpc error: code = FailedPrecondition desc = "
        f"{MEM}: no single GPU has 45 GiB free; largest free: 40 GiB on GPU 2"
        " (free GiB by GPU: 0:0 1:5 2:40 3:40 4:40 5:40 6:40 7:40); a container's memory"
        " must be on one GPU (sharing.memory.multiGpu allows several), which is unexpected"
    )


async def test_placement_is_right_across_a_plugin_restart_and_a_kubelet_restart(
    tmp_path: Path,
) -> None:
    nvml = fake_nvml.dgx_a100_40gb()
    index = gpu_index(nvml)

    async with FakeKubelet() as kubelet:
        async with serving(*plugins_for(nvml, tmp_path, memory()), settings=kubelet.settings()):
            await kubelet.wait_for_allocatable(MEM, 320)
            await kubelet.allocate(MEM, 10)  # GPU 0
            await kubelet.allocate(MEM, 35)  # GPU 1
        # A new plugin process knows nothing: the kubelet's available list says it all.
        async with serving(*plugins_for(nvml, tmp_path, memory()), settings=kubelet.settings()):
            await kubelet.wait_for_registrations(MEM, 2)
            await kubelet.wait_for_allocatable(MEM, 320)
            got = await kubelet.allocate(MEM, 30)
            assert index[got.allocation.env["NVIDIA_VISIBLE_DEVICES"]] == 0
            await kubelet.restart()  # the checkpoint keeps the allocations
            await kubelet.wait_for_registrations(MEM, 3)
            await kubelet.wait_for_allocatable(MEM, 320)
            got = await kubelet.allocate(MEM, 5)
            assert index[got.allocation.env["NVIDIA_VISIBLE_DEVICES"]] == 1


async def test_a_gpu_fault_takes_exactly_its_units_out_and_brings_them_back(
    tmp_path: Path,
) -> None:
    nvml = fake_nvml.dgx_a100_40gb()
    config = memory(countResourceName="aliyun.com/gpu-count")
    config["health"] = {"probeInterval": 0.02, "recoveryPeriod": 0}
    plugins = plugins_for(nvml, tmp_path, config)
    sick = nvml.gpus[3].uuid.removeprefix("GPU-").split("-")[0]  # its units' ID prefix

    async with FakeKubelet() as kubelet, serving(*plugins, settings=kubelet.settings()):
        await kubelet.wait_for_allocatable(MEM, 320)
        assert await anyio.to_thread.run_sync(nvml.wait_for_waiters, 2, 5.0, 3)
        nvml.lose(3)
        nvml.xid(3, 79)
        await kubelet.wait_for_allocatable(MEM, 280)
        await kubelet.wait_for_allocatable("aliyun.com/gpu-count", 7)
        out = {i for i, d in kubelet.devices(MEM).items() if d.health == "Unhealthy"}
        assert out == {f"{sick}-{n}" for n in range(40)}

        nvml.recover(3)
        await kubelet.wait_for_allocatable(MEM, 320)
        await kubelet.wait_for_allocatable("aliyun.com/gpu-count", 8)

    assert nvml.init_count == 0


async def test_a_pod_asking_for_slices_gets_different_gpus(tmp_path: Path) -> None:
    nvml = fake_nvml.dgx_a100_40gb()
    plugins = plugins_for(nvml, tmp_path, vgpu())
    index = gpu_index(nvml)

    async with FakeKubelet() as kubelet, serving(*plugins, settings=kubelet.settings()):
        await kubelet.wait_for_allocatable(GPU, 32)
        pairs = [await kubelet.allocate(GPU, 2) for _ in range(4)]
        three = await kubelet.allocate(GPU, 3)

    for got in [*pairs, three]:
        visible = got.allocation.env["NVIDIA_VISIBLE_DEVICES"].split(",")
        assert len(set(visible)) == len(got.device_ids)
        assert sorted(visible, key=index.get) == visible
    # Spread: the first four pairs use every GPU once.
    used = [index[u] for p in pairs for u in p.allocation.env["NVIDIA_VISIBLE_DEVICES"].split(",")]
    assert sorted(used) == list(range(8))


def test_config_dataclass_fields_are_all_documented_in_from_mapping() -> None:
    text = NvidiaConfig.from_mapping.__doc__ or ""
    for field in dataclasses.fields(MemorySharing):
        camel = re.sub(r"_(\w)", lambda m: m.group(1).upper(), field.name)
        assert camel in text, camel
