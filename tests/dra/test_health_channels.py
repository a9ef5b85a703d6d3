"""One health engine, every channel: an NVML signal reaches ListAndWatch, the DRA taint and the
DRA health stream from one report, with one reason, on every share of the GPU in both APIs.

The NVIDIA backend on fake NVML shares each GPU in two time-slicing replicas; ``api: both``
gives replica 0 of every GPU to DRA and replica 1 to the device plugin, so one GPU's shares are
in both APIs at once.
"""

from __future__ import annotations

from pathlib import Path

from devplugin_sdk.backends.nvidia import NvidiaConfig, NvmlPlugin
from devplugin_sdk.dra import device_name
from devplugin_sdk.dra.resources import DeviceTaint
from devplugin_sdk.observe import Observer
from devplugin_sdk.testing import DraNode, MemoryApi, fake_nvml
from devplugin_sdk.types import Health

DRIVER = "gpu.acme.com"
RESOURCE = "nvidia.com/gpu"
XID_79 = "Xid 79 (GPU has fallen off the bus)"
XID_43 = "Xid 43 (GPU stopped processing)"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Reasons(Observer):
    """The device plugin's channel's reasons: what ``health_changed`` was told, by device."""

    def __init__(self) -> None:
        self.said: dict[str, tuple[Health | None, str]] = {}

    def health_changed(
        self, resource: str, device: str, health: Health | None, reason: str
    ) -> None:
        self.said[device] = (health, reason)


async def test_one_signal_every_channel_every_share(tmp_path: Path) -> None:
    nvml = fake_nvml.t4_pcie()
    roots = nvml.write_host(tmp_path / "host")
    clock = Clock()
    config = NvidiaConfig(
        sysfs_root=roots.sysfs_root,
        dev_root=roots.dev_root,
        proc_root=roots.proc_root,
        replicas=2,
        probe_interval=0.05,
        recovery_period=60,
    )
    plugin = NvmlPlugin(config, nvml=nvml, clock=clock)
    api = MemoryApi(nodes=["node-1"])
    reasons = Reasons()
    gpu0, gpu1 = nvml.gpus[0].uuid, nvml.gpus[1].uuid
    # DRA publishes the GPU once, its replicas as shares of it (dra/_claims/shares.py).
    dp0, dra0 = f"{gpu0}::1", device_name(gpu0)
    dp1, dra1 = f"{gpu1}::1", device_name(gpu1)

    async with DraNode(
        plugin,
        driver=DRIVER,
        memory=api,
        device_plugin_api=True,
        devices=lambda resource, d: d.id.endswith("::0"),
        observer=reasons,
    ) as node:
        kubelet = node.kubelet

        def listed(device: str) -> str:
            return kubelet.devices(RESOURCE)[device].health

        def taints(name: str) -> tuple[DeviceTaint, ...]:
            return next(
                d.taints for s in api.pool(DRIVER, "node-1") for d in s.devices if d.name == name
            )

        def streamed(name: str) -> tuple[str, str]:
            return kubelet.dra.health.health(DRIVER, "node-1", name)

        await kubelet.wait_for(lambda: len(kubelet.devices(RESOURCE)) == 4, what="DP list")
        await kubelet.wait_for(lambda: streamed(dra0) == ("Healthy", ""), what="stream")
        assert await _armed(nvml)

        nvml.xid(0, 79)
        await kubelet.wait_for(lambda: listed(dp0) == "Unhealthy", what="DP unhealthy")
        await kubelet.wait_for(lambda: bool(taints(dra0)), what="DRA tainted")
        await kubelet.wait_for(lambda: streamed(dra0)[0] == "Unhealthy", what="stream")
        # One reason in every channel; NoSchedule (NoExecute needs the operator's opt-in).
        assert reasons.said[dp0] == (Health.UNHEALTHY, XID_79)
        (taint,) = taints(dra0)
        assert (taint.key, taint.value, taint.effect) == (
            f"{DRIVER}/health",
            "Xid-79-GPU-has-fallen-off-the-bus",
            "NoSchedule",
        )
        assert streamed(dra0) == ("Unhealthy", XID_79)
        # The other GPUs' shares are untouched.
        assert listed(dp1) == "Healthy"
        assert not taints(dra1)

        nvml.xid(1, 43)  # advisory: DRA's None taint and the stream's message only
        await kubelet.wait_for(lambda: bool(taints(dra1)), what="advisory taint")
        assert [(t.value, t.effect) for t in taints(dra1)] == [
            ("Xid-43-GPU-stopped-processing", "None")
        ]
        await kubelet.wait_for(
            lambda: streamed(dra1) == ("Healthy", f"advisory: {XID_43}"), what="advisory"
        )
        assert listed(dp1) == "Healthy"
        assert dp1 not in reasons.said

        clock.now += 60  # GPU 0 probes clean for the recovery period
        await kubelet.wait_for(lambda: listed(dp0) == "Healthy", what="DP recovered")
        await kubelet.wait_for(lambda: not taints(dra0), what="taint removed")
        await kubelet.wait_for(lambda: streamed(dra0) == ("Healthy", ""), what="stream")
        assert reasons.said[dp0][0] is Health.HEALTHY


async def _armed(nvml: fake_nvml.FakeNVML) -> bool:
    import anyio.to_thread

    return await anyio.to_thread.run_sync(nvml.wait_for_waiters, 1, 5.0)


async def test_a_gpu_wide_fault_taints_every_mig_device_of_that_gpu(tmp_path: Path) -> None:
    """NVIDIA's plugin misses MIG siblings (k8s-device-plugin #1929): here a GPU-wide Xid takes
    every MIG device of that GPU, in the slice and on the stream, and no other."""
    nvml = fake_nvml.a100_mig([("1g.10gb",) * 3, ("1g.10gb",) * 3])
    roots = nvml.write_host(tmp_path / "host")
    config = NvidiaConfig(
        sysfs_root=roots.sysfs_root,
        dev_root=roots.dev_root,
        proc_root=roots.proc_root,
        mig_strategy="single",
        probe_interval=3600,
    )
    plugin = NvmlPlugin(config, nvml=nvml)
    api = MemoryApi(nodes=["node-1"])
    async with DraNode(plugin, driver=DRIVER, memory=api) as node:
        kubelet = node.kubelet
        await kubelet.wait_for(lambda: kubelet.dra.health.messages >= 1, what="stream")
        by_gpu: dict[str, list[str]] = {}
        for s in api.pool(DRIVER, "node-1"):
            for d in s.devices:
                by_gpu.setdefault(str(d.attributes["gpuUUID"]), []).append(d.name)
        # Three MIG devices and, for DRA's counters, the GPU they partition.
        assert sorted(len(v) for v in by_gpu.values()) == [4, 4]
        assert await _armed(nvml)

        nvml.xid(0, 79)
        hit, spared = by_gpu[nvml.gpus[0].uuid], by_gpu[nvml.gpus[1].uuid]

        def state(name: str) -> tuple[str, list[str]]:
            taints = next(
                d.taints for s in api.pool(DRIVER, "node-1") for d in s.devices if d.name == name
            )
            health = kubelet.dra.health.health(DRIVER, "node-1", name)[0]
            return health, [t.effect for t in taints]

        await kubelet.wait_for(
            lambda: all(state(n) == ("Unhealthy", ["NoSchedule"]) for n in hit),
            what="every MIG device of GPU 0 out",
        )
        assert all(state(n) == ("Healthy", []) for n in spared)
