"""The issue's scenario: DRA drivers built from the NVML backend (fake NVML) and from the generic
backend register with FakeKubelet's DRA side, publish slices whose attributes are the devices',
prepare and unprepare claims (CDI specs written and removed, IDs returned), and survive a plugin
restart (checkpoint) and a kubelet restart (re-registration)."""

from __future__ import annotations

from pathlib import Path

from devplugin_sdk.backends.generic import GenericPlugin
from devplugin_sdk.backends.nvidia import NvidiaConfig, NvmlPlugin
from devplugin_sdk.dra import device_name
from devplugin_sdk.testing import DraNode, MemoryApi, fake_nvml

GPU_DRIVER = "gpu.nvidia.com"


async def test_an_nvml_driver_end_to_end(tmp_path: Path) -> None:
    nvml = fake_nvml.dgx_a100()
    roots = nvml.write_host(tmp_path / "host")
    config = NvidiaConfig(
        sysfs_root=roots.sysfs_root, dev_root=roots.dev_root, proc_root=roots.proc_root
    )
    api = MemoryApi(nodes=["node-1"])

    def plugin() -> NvmlPlugin:
        return NvmlPlugin(config, nvml=nvml)

    async with DraNode(plugin(), driver=GPU_DRIVER, memory=api) as node:
        kubelet = node.kubelet
        pod = node.pod("two-gpus", name="trainer", namespace="ml")
        await kubelet.wait_for(lambda: len(node.published()) == 8)
        reference = plugin()
        devices = {device_name(d.id): d for d in await reference.discover()}
        await reference.on_stop()
        slices = node.published()
        for name, device in devices.items():
            assert slices[name].attributes == device.attributes
            assert slices[name].capacity == device.capacity
        # "2 GPUs in one NVLink domain": what the scheduler would pick.
        domain = {n: d.attributes["nvlinkDomain"] for n, d in devices.items()}
        first, second = sorted(devices)[:2]
        assert domain[first] == domain[second]
        api.allocate(
            "ml",
            "two-gpus",
            {"gpus": [first, second]},
            driver=GPU_DRIVER,
            pool="node-1",
            pods=[pod.uid],
        )
        prepared = await node.prepare(pod)
        claim = api.claims[("ml", "two-gpus")]
        assert prepared.cdi_ids("two-gpus", "gpus") == [f"k8s.{GPU_DRIVER}/claim={claim.uid}-gpus"]
        edits = node.spec(claim).devices[0]["containerEdits"]
        uuids = sorted(devices[n].id for n in (first, second))
        visible = next(e for e in edits["env"] if e.startswith("NVIDIA_VISIBLE_DEVICES="))
        assert sorted(visible.split("=", 1)[1].split(",")) == uuids

        # The plugin restarts mid-way: the claim is still prepared (checkpoint), and the GPU
        # plugin, its slices and the kubelet's answer are the same.
        async with node.stopped(plugin()):
            pass
        await kubelet.wait_for(lambda: len(kubelet.dra.successful_registrations(GPU_DRIVER)) == 2)
        kubelet.dra.forget_prepared()  # the kubelet asks again
        again = await node.prepare(pod)
        assert again.claims == prepared.claims
        # The kubelet restarts: slices wiped, the driver registered again and republished.
        await kubelet.restart()
        await kubelet.wait_for(lambda: len(kubelet.dra.successful_registrations(GPU_DRIVER)) == 3)
        await kubelet.wait_for(lambda: len(node.published()) == 8)
        await node.unprepare(pod)
        assert not list(node.options.cdi_dir.glob(f"k8s.{GPU_DRIVER}-claim_*"))
        # An Xid 79 taints the GPU NoSchedule; it stays in the pool.
        nvml.xid(0, 79)
        hit = device_name(nvml.gpus[0].uuid)

        def effects() -> list[str]:
            return [
                t.effect
                for s in api.pool(GPU_DRIVER, "node-1")
                for d in s.devices
                if d.name == hit
                for t in d.taints
            ]

        await kubelet.wait_for(lambda: effects() == ["NoSchedule"], what="GPU 0 tainted")
        assert len(node.published()) == 8


async def test_a_generic_driver_end_to_end(tmp_path: Path) -> None:
    dev = tmp_path / "dev"
    dev.mkdir()
    for i in range(3):
        (dev / f"ttyUSB{i}").touch()
    api = MemoryApi(nodes=["node-1"])
    driver = "serial.example.com"

    def plugin() -> GenericPlugin:
        return GenericPlugin("example.com/serial", ["/dev/ttyUSB*"], root=tmp_path)

    async with DraNode(plugin(), driver=driver, memory=api) as node:
        kubelet = node.kubelet
        pod = node.pod("port", name="logger")
        await kubelet.wait_for(lambda: len(node.published()) == 3)
        slices = node.published()
        assert sorted(slices) == ["ttyusb0", "ttyusb1", "ttyusb2"]
        assert slices["ttyusb1"].attributes == {"path": "/dev/ttyUSB1"}
        api.allocate(
            "default",
            "port",
            {"serial": ["ttyusb1"]},
            driver=driver,
            pool="node-1",
            pods=[pod.uid],
        )
        prepared = await node.prepare(pod)
        claim = api.claims[("default", "port")]
        spec = node.spec(claim)
        nodes = spec.devices[0]["containerEdits"]["deviceNodes"]
        assert [n["path"] for n in nodes] == ["/dev/ttyUSB1"]
        async with node.stopped(plugin()):
            pass
        await kubelet.wait_for(lambda: len(kubelet.dra.successful_registrations(driver)) == 2)
        await kubelet.restart()
        await kubelet.wait_for(lambda: len(kubelet.dra.successful_registrations(driver)) == 3)
        await kubelet.wait_for(lambda: len(node.published()) == 3)
        assert kubelet.dra.prepared_claims()  # the kubelet's checkpoint kept it
        await node.unprepare(pod)
        assert not spec.path.exists()
        del prepared
