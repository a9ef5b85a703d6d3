"""The issue's scenario: DRA drivers built from the NVML backend (fake NVML) and from the generic
backend register with FakeKubelet's DRA side, publish slices whose attributes are the devices',
prepare and unprepare claims (CDI specs written and removed, IDs returned), and survive a plugin
restart (checkpoint) and a kubelet restart (re-registration)."""

from __future__ import annotations

import json
from pathlib import Path

from dra_helpers import dra_options

from devplugin_sdk.backends.generic import GenericPlugin
from devplugin_sdk.backends.nvidia import NvidiaConfig, NvmlPlugin
from devplugin_sdk.dra import SliceDevice, device_name
from devplugin_sdk.testing import FakeKubelet, MemoryApi, fake_nvml, serving

GPU_DRIVER = "gpu.nvidia.com"


def published(api: MemoryApi, driver: str, node: str) -> dict[str, SliceDevice]:
    return {d.name: d for s in api.pool(driver, node) for d in s.devices}


async def test_an_nvml_driver_end_to_end(tmp_path: Path) -> None:
    nvml = fake_nvml.dgx_a100()
    roots = nvml.write_host(tmp_path / "host")
    config = NvidiaConfig(
        sysfs_root=roots.sysfs_root, dev_root=roots.dev_root, proc_root=roots.proc_root
    )
    api = MemoryApi(nodes=["node-1"])

    def plugin() -> NvmlPlugin:
        return NvmlPlugin(config, nvml=nvml)

    async with FakeKubelet(dra_api=api) as kubelet:
        options = dra_options(kubelet, api, driver=GPU_DRIVER)
        settings = kubelet.settings()
        pod = kubelet.dra.pod("ml", "trainer", ["two-gpus"])
        async with serving(plugin(), settings=settings, api="dra", dra=options):
            await kubelet.wait_for(lambda: kubelet.dra.is_registered(GPU_DRIVER))
            await kubelet.wait_for(lambda: len(published(api, GPU_DRIVER, "node-1")) == 8)
            reference = plugin()
            devices = {device_name(d.id): d for d in await reference.discover()}
            await reference.on_stop()
            slices = published(api, GPU_DRIVER, "node-1")
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
            prepared = await kubelet.dra.prepare(pod)
            claim = api.claims[("ml", "two-gpus")]
            assert prepared.cdi_ids("two-gpus", "gpus") == [
                f"k8s.{GPU_DRIVER}/claim={claim.uid}-gpus"
            ]
            spec = json.loads(
                (options.cdi_dir / f"k8s.{GPU_DRIVER}-claim_{claim.uid}.json").read_text()
            )
            edits = spec["devices"][0]["containerEdits"]
            uuids = sorted(devices[n].id for n in (first, second))
            visible = next(e for e in edits["env"] if e.startswith("NVIDIA_VISIBLE_DEVICES="))
            assert sorted(visible.split("=", 1)[1].split(",")) == uuids

        # The plugin restarts mid-way: the claim is still prepared (checkpoint), and the GPU
        # plugin, its slices and the kubelet's answer are the same.
        async with serving(plugin(), settings=settings, api="dra", dra=options):
            await kubelet.wait_for(
                lambda: len(kubelet.dra.successful_registrations(GPU_DRIVER)) == 2
            )
            kubelet.dra._claims.clear()  # the kubelet asks again
            again = await kubelet.dra.prepare(pod)
            assert again.claims == prepared.claims
            # The kubelet restarts: slices wiped, the driver registered again and republished.
            await kubelet.restart()
            await kubelet.wait_for(
                lambda: len(kubelet.dra.successful_registrations(GPU_DRIVER)) == 3
            )
            await kubelet.wait_for(lambda: len(published(api, GPU_DRIVER, "node-1")) == 8)
            await kubelet.dra.unprepare(pod)
            assert not list(options.cdi_dir.glob(f"k8s.{GPU_DRIVER}-claim_*"))
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
            assert len(published(api, GPU_DRIVER, "node-1")) == 8


async def test_a_generic_driver_end_to_end(tmp_path: Path) -> None:
    dev = tmp_path / "dev"
    dev.mkdir()
    for i in range(3):
        (dev / f"ttyUSB{i}").touch()
    api = MemoryApi(nodes=["node-1"])
    async with FakeKubelet(dra_api=api) as kubelet:
        driver = "serial.example.com"
        options = dra_options(kubelet, api, driver=driver)

        def plugin() -> GenericPlugin:
            return GenericPlugin("example.com/serial", ["/dev/ttyUSB*"], root=tmp_path)

        settings = kubelet.settings()
        pod = kubelet.dra.pod("default", "logger", ["port"])
        async with serving(plugin(), settings=settings, api="dra", dra=options):
            await kubelet.wait_for(lambda: kubelet.dra.is_registered(driver))
            await kubelet.wait_for(lambda: len(published(api, driver, "node-1")) == 3)
            slices = published(api, driver, "node-1")
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
            prepared = await kubelet.dra.prepare(pod)
            claim = api.claims[("default", "port")]
            spec_file = options.cdi_dir / f"k8s.{driver}-claim_{claim.uid}.json"
            nodes = json.loads(spec_file.read_text())["devices"][0]["containerEdits"]["deviceNodes"]
            assert [n["path"] for n in nodes] == ["/dev/ttyUSB1"]
        async with serving(plugin(), settings=settings, api="dra", dra=options):
            await kubelet.wait_for(lambda: len(kubelet.dra.successful_registrations(driver)) == 2)
            await kubelet.restart()
            await kubelet.wait_for(lambda: len(kubelet.dra.successful_registrations(driver)) == 3)
            await kubelet.wait_for(lambda: len(published(api, driver, "node-1")) == 3)
            assert kubelet.dra.prepared_claims()  # the kubelet's checkpoint kept it
            await kubelet.dra.unprepare(pod)
            assert not spec_file.exists()
            del prepared
