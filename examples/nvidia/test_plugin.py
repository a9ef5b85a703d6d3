"""The example NVIDIA plugin against FakeKubelet, on fake NVML machines (no GPU needed)."""

from __future__ import annotations

import importlib.util
import sys
from functools import partial
from pathlib import Path
from types import ModuleType
from typing import Any

import anyio
import anyio.to_thread
import pytest
import yaml
from prometheus_client import CollectorRegistry

from devplugin_sdk import healthz
from devplugin_sdk.testing import (
    AdmissionError,
    ContainerStartError,
    FakeKubelet,
    fake_nvml,
    serving,
)
from devplugin_sdk.testing.fake_nvml import FakeNVML

HERE = Path(__file__).parent


def _example() -> ModuleType:
    # Examples are not a package (pytest runs with --import-mode=importlib): load by path.
    spec = importlib.util.spec_from_file_location("nvidia_example_plugin", HERE / "plugin.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


example = _example()


class Clock:
    """A monotonic clock the test moves by hand (recovery periods)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def load(tmp_path: Path, nvml: FakeNVML, clock: Clock | None = None, **changes: Any) -> list[Any]:
    """The shipped config.yaml with ``changes`` merged in, on the fake machine ``nvml``."""
    config = yaml.safe_load((HERE / "config.yaml").read_text())
    for key, value in changes.items():
        if isinstance(value, dict):
            config[key] = {**config.get(key, {}), **value}
        else:
            config[key] = value
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    roots = nvml.write_host(tmp_path / "host")
    plugins: list[Any] = example.load_plugins(
        path,
        nvml=nvml,
        clock=clock or Clock(),
        sysfs_root=roots.sysfs_root,
        dev_root=roots.dev_root,
        proc_root=roots.proc_root,
    )
    return plugins


def test_the_shipped_config_is_valid_and_means_nvidias_defaults(tmp_path: Path) -> None:
    [plugin] = load(tmp_path, fake_nvml.t4_pcie())

    assert plugin.resource_name == "nvidia.com/gpu"
    assert plugin.config.ignored_xids == {13, 31, 43, 45, 68, 109}
    assert plugin.config.recovery_period == 60
    assert plugin.container_env == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}


def test_the_daemonset_config_and_arguments_are_what_the_plugin_takes(tmp_path: Path) -> None:
    config_map, daemonset = yaml.safe_load_all((HERE / "daemonset.yaml").read_text())
    path = tmp_path / "config.yaml"
    path.write_text(config_map["data"]["config.yaml"])
    container = daemonset["spec"]["template"]["spec"]["containers"][0]

    [plugin] = example.load_plugins(path, nvml=fake_nvml.t4_pcie())
    args = example.build_parser().parse_args(container["args"])

    assert plugin.config.sysfs_root == Path("/host/sys")
    assert args.config == Path("/etc/nvidia-device-plugin/config.yaml")
    [port] = container["ports"]
    assert args.metrics_port == port["containerPort"]
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": port["name"]}


async def test_a_dgx_a100_is_served_and_a_pair_comes_from_one_pcie_switch(tmp_path: Path) -> None:
    nvml = fake_nvml.dgx_a100()
    plugins = load(tmp_path, nvml)

    async with FakeKubelet() as kubelet, serving(*plugins, settings=kubelet.settings()):
        await kubelet.wait_for_allocatable("nvidia.com/gpu", 8)
        devices = kubelet.devices("nvidia.com/gpu")
        assert {d.numa_nodes for d in devices.values()} == {(1,), (3,), (5,), (7,)}

        got = await kubelet.allocate("nvidia.com/gpu", 2)

    index = {g.uuid: g.index for g in nvml.gpus}
    assert sorted(index[i] for i in got.device_ids) in ([0, 1], [2, 3], [4, 5], [6, 7])
    env = got.allocation.env
    assert env["NVIDIA_VISIBLE_DEVICES"] == ",".join(got.device_ids)
    assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    nodes = {n.host_path for n in got.allocation.device_nodes}
    assert {"/dev/nvidiactl", "/dev/nvidia-uvm"} <= nodes
    assert {f"/dev/nvidia{index[i]}" for i in got.device_ids} <= nodes


async def test_a_gpu_that_falls_off_the_bus_leaves_and_returns_after_the_recovery_period(
    tmp_path: Path,
) -> None:
    nvml = fake_nvml.dgx_a100()
    clock = Clock()
    plugins = load(tmp_path, nvml, clock, health={"probeInterval": 0.02, "recoveryPeriod": 60})

    async with FakeKubelet() as kubelet, serving(*plugins, settings=kubelet.settings()):
        await kubelet.wait_for_allocatable("nvidia.com/gpu", 8)
        assert await anyio.to_thread.run_sync(nvml.wait_for_waiters, 1, 5.0, 3)
        nvml.xid(3, 79)
        nvml.lose(3)
        await kubelet.wait_for_allocatable("nvidia.com/gpu", 7)
        assert kubelet.devices("nvidia.com/gpu")[nvml.gpus[3].uuid].health == "Unhealthy"

        nvml.recover(3)
        probes = nvml.calls["nvmlDeviceGetMemoryInfo"]
        await kubelet.wait_for(lambda: nvml.calls["nvmlDeviceGetMemoryInfo"] > probes + 16)
        assert kubelet.allocatable("nvidia.com/gpu") == 7  # clean, but not for 60 s yet

        clock.now += 60
        await kubelet.wait_for_allocatable("nvidia.com/gpu", 8)
        assert kubelet.capacity("nvidia.com/gpu") == 8


async def test_a_mixed_mig_node_serves_each_profile_and_one_instance_fails_alone(
    tmp_path: Path,
) -> None:
    nvml = fake_nvml.a100_mig([("3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"), None])
    plugins = load(tmp_path, nvml, migStrategy="mixed")
    names = [p.resource_name for p in plugins]
    assert names == [
        "nvidia.com/gpu",
        "nvidia.com/mig-1g.10gb",
        "nvidia.com/mig-2g.20gb",
        "nvidia.com/mig-3g.40gb",
    ]
    sick = nvml.gpus[0].migs[2]

    async with FakeKubelet() as kubelet, serving(*plugins, settings=kubelet.settings()):
        for name, count in zip(names, (1, 2, 1, 1), strict=True):
            await kubelet.wait_for_allocatable(name, count)
        got = await kubelet.allocate("nvidia.com/mig-3g.40gb", 1)
        assert got.device_ids == (nvml.gpus[0].migs[0].uuid,)
        assert "/dev/nvidia-caps/nvidia-cap12" in {n.host_path for n in got.allocation.device_nodes}

        assert await anyio.to_thread.run_sync(nvml.wait_for_waiters, 4, 5.0)
        nvml.xid(0, 94, gi=sick.gi, ci=sick.ci)
        await kubelet.wait_for_allocatable("nvidia.com/mig-1g.10gb", 1)

        assert kubelet.devices("nvidia.com/mig-1g.10gb")[sick.uuid].health == "Unhealthy"
        assert kubelet.allocatable("nvidia.com/mig-2g.20gb") == 1
        assert kubelet.allocatable("nvidia.com/gpu") == 1


async def test_time_sliced_gpus_are_shared_one_per_container(tmp_path: Path) -> None:
    nvml = fake_nvml.t4_pcie()
    sharing = {"timeSlicing": {"replicas": 4, "failRequestsGreaterThanOne": True}}
    plugins = load(tmp_path, nvml, sharing=sharing)

    async with FakeKubelet() as kubelet, serving(*plugins, settings=kubelet.settings()):
        await kubelet.wait_for_allocatable("nvidia.com/gpu", 16)
        first = await kubelet.allocate("nvidia.com/gpu", 1, pod="a")
        second = await kubelet.allocate("nvidia.com/gpu", 1, pod="b")
        with pytest.raises(AdmissionError, match="maximum request size for shared resources is 1"):
            await kubelet.allocate("nvidia.com/gpu", 2, pod="c")

    # The second container lands on another physical GPU (replicas are spread).
    uuids = {ids.device_ids[0].split("::")[0] for ids in (first, second)}
    assert len(uuids) == 2
    assert first.allocation.env["NVIDIA_VISIBLE_DEVICES"] in {g.uuid for g in nvml.gpus}


async def test_no_container_starts_on_a_gpu_lost_since_it_was_advertised(tmp_path: Path) -> None:
    nvml = fake_nvml.t4_pcie()
    plugins = load(tmp_path, nvml, health={"probeInterval": 3600})

    settings = {"health_interval": 3600.0}
    async with FakeKubelet() as kubelet, serving(*plugins, settings=kubelet.settings(**settings)):
        await kubelet.wait_for_allocatable("nvidia.com/gpu", 4)
        nvml.lose(2)  # no Xid, and no probe before the pod comes

        with pytest.raises(ContainerStartError, match=nvml.gpus[2].uuid):
            await kubelet.allocate("nvidia.com/gpu", 4)


async def test_healthz_answers_once_the_gpus_are_registered(tmp_path: Path) -> None:
    # What the DaemonSet's probes ask: the plugin run as with --metrics-port.
    plugins = load(tmp_path, fake_nvml.t4_pcie())

    async with FakeKubelet() as kubelet, anyio.create_task_group() as tg:
        port = await tg.start(
            partial(
                healthz.serve_with_http,
                plugins,
                port=0,
                settings=kubelet.settings(),
                # A registry of its own: the default one is process-wide.
                registry=CollectorRegistry(),
            )
        )
        await kubelet.wait_for_allocatable("nvidia.com/gpu", 4)
        # Live as the plugin sees it (the kubelet records a registration before the plugin
        # hears back).
        await kubelet.wait_for(
            lambda: not healthz.problems(healthz.served_statuses()), what="the plugin live"
        )
        async with await anyio.connect_tcp("127.0.0.1", port) as stream:
            await stream.send(b"GET /healthz HTTP/1.1\r\nHost: probe\r\n\r\n")
            reply = b""
            with anyio.fail_after(5):
                async for chunk in stream:
                    reply += chunk
        tg.cancel_scope.cancel()

    assert reply.startswith(b"HTTP/1.1 200")
