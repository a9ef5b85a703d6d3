"""The NVIDIA example against FakeKubelet, on fake NVML machines (no GPU needed).

End to end it runs as the image runs it, ``devplugin run plugin:SiteGpuPlugin --config FILE``
in a subprocess, with ``python -m devplugin_sdk.testing.fake_nvml`` installing a fake machine as
``pynvml`` first. Faults (Xid, lost GPU, recovery) are injected in-process: plugins built with
``SiteGpuPlugin.from_config`` on a ``FakeNVML`` and served with ``serving``. The GPU-sharing
configs (``config-gpushare.yaml``, ``config-hami.yaml``) run both ways on an A100x8 40 GiB node.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import anyio
import anyio.abc
import pytest
import yaml
from plugin_process import PluginProcess, spawned

from devplugin_sdk import cli
from devplugin_sdk.cli.runfile import parse_run_config
from devplugin_sdk.testing import (
    AdmissionError,
    ContainerStartError,
    FakeKubelet,
    fake_nvml,
    serving,
)
from devplugin_sdk.testing.fake_nvml import FakeNVML

HERE = Path(__file__).parent
SHIPPED: dict[str, Any] = yaml.safe_load((HERE / "config.yaml").read_text())
GPU = "nvidia.com/gpu"


def config_for(roots: fake_nvml.HostRoots, **changes: Any) -> dict[str, Any]:
    """The shipped config.yaml on the fake host ``roots``, with ``changes`` merged in."""
    config = {**SHIPPED, **roots.config()}
    for key, value in changes.items():
        config[key] = {**config.get(key, {}), **value} if isinstance(value, dict) else value
    return config


def load(example: ModuleType, tmp_path: Path, nvml: FakeNVML, **changes: Any) -> list[Any]:
    """``SiteGpuPlugin.from_config`` on the fake machine ``nvml``."""
    roots = nvml.write_host(tmp_path / "host")
    with nvml.installed():
        plugins: list[Any] = example.SiteGpuPlugin.from_config(config_for(roots, **changes))
    return plugins


# ----------------------------------------------------------------------------- the manifests


def test_the_shipped_config_is_valid_and_means_nvidias_defaults(
    tmp_path: Path, example: ModuleType
) -> None:
    [plugin] = load(example, tmp_path, fake_nvml.t4_pcie())

    assert plugin.resource_name == GPU
    assert plugin.config.ignored_xids == {109}
    assert plugin.config.recovery_period == 60
    assert plugin.health_interval == plugin.config.probe_interval == 5
    assert plugin.container_env == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}


def dockerfile_instruction(name: str) -> list[str]:
    text = (HERE / "Dockerfile").read_text()
    (line,) = re.findall(rf"^{name} (\[.*\])$", text, re.M)
    value: list[str] = json.loads(line)
    return value


def test_the_image_runs_devplugin_with_the_daemonsets_arguments_and_config(
    tmp_path: Path,
    example: ModuleType,
) -> None:
    config_map, daemonset = yaml.safe_load_all((HERE / "daemonset.yaml").read_text())
    container = daemonset["spec"]["template"]["spec"]["containers"][0]
    dockerfile = (HERE / "Dockerfile").read_text()
    entrypoint = dockerfile_instruction("ENTRYPOINT")

    assert entrypoint == ["devplugin", "run", "plugin:SiteGpuPlugin"]
    assert "COPY examples/nvidia/plugin.py /app/plugin.py" in dockerfile
    assert re.search(r"^\s+PYTHONPATH=/app ", dockerfile, re.M)
    parser = cli.build_parser()
    for args in (dockerfile_instruction("CMD"), container["args"]):
        parsed = parser.parse_args([*entrypoint[1:], *args])
        assert parsed.target == "plugin:SiteGpuPlugin"
        assert parsed.config == "/etc/nvidia-device-plugin/config.yaml"
        [port] = container["ports"]
        assert parsed.metrics_port == port["containerPort"]
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in daemonset["spec"]["template"]["spec"]["volumes"]}
    config_volume = volumes[mounts["/etc/nvidia-device-plugin"]]
    assert config_volume["configMap"]["name"] == config_map["metadata"]["name"]

    options = parse_run_config(yaml.safe_load(config_map["data"]["config.yaml"])).backend_options
    with fake_nvml.t4_pcie().installed():
        [plugin] = example.SiteGpuPlugin.from_config(options)
    assert plugin.config.sysfs_root == Path("/host/sys")
    assert mounts["/host/sys"] == "sys"


# ----------------------------------------------------------------------------- end to end


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def write_atomically(path: Path, config: Mapping[str, Any]) -> None:
    # The plugin watches the file: it must never read a half-written one.
    temporary = path.with_suffix(".tmp")
    temporary.write_text(yaml.safe_dump(dict(config)))
    os.replace(temporary, path)


def runner_command(machine: str, host: Path, *devplugin_args: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "devplugin_sdk.testing.fake_nvml",
        "--machine",
        machine,
        "--host-root",
        str(host),
        "--",
        *devplugin_args,
    ]


def runner_env() -> dict[str, str]:
    # What the image's PYTHONPATH=/app does: `plugin:SiteGpuPlugin` is importable.
    path = os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path}


@asynccontextmanager
async def devplugin_run(command: list[str]) -> AsyncIterator[PluginProcess]:
    """Run ``command`` for the body of the ``async with``; SIGTERM then kill, always bounded."""
    async with spawned(command, env=runner_env()) as running:
        yield running


async def http_get(port: int, path: str) -> tuple[int, str]:
    """One HTTP/1.1 GET on localhost: (status, body)."""
    with anyio.fail_after(5):
        async with await anyio.connect_tcp("127.0.0.1", port) as stream:
            await stream.send(
                f"GET {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n".encode()
            )
            reply = b""
            async for chunk in stream:
                reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body.decode()


async def wait_for_healthz(port: int) -> str:
    """Poll /healthz until it answers 200 (it fails until the plugin hears back from the
    kubelet, shortly after the kubelet records the registration); return the body."""
    with anyio.fail_after(20):
        while True:
            try:
                status, body = await http_get(port, "/healthz")
            except OSError:  # not listening yet
                status, body = 0, ""
            if status == 200:
                return body
            await anyio.sleep(0.05)


async def test_devplugin_run_serves_the_example_on_a_dgx_a100_end_to_end(tmp_path: Path) -> None:
    machine = fake_nvml.dgx_a100()  # the same model the subprocess builds: the same UUIDs
    host = tmp_path / "host"
    config_file = tmp_path / "config.yaml"
    roots = fake_nvml.HostRoots(host / "sys", host / "dev", host / "proc")
    write_atomically(config_file, {**config_for(roots), "logging": {"format": "json"}})
    port = free_port()

    async with FakeKubelet() as kubelet:
        command = runner_command(
            "dgx_a100",
            host,
            "run",
            "plugin:SiteGpuPlugin",
            "--config",
            str(config_file),
            "--device-plugin-dir",
            str(kubelet.directory),
            "--registration",
            "kubelet",
            "--metrics-port",
            str(port),
        )
        async with devplugin_run(command) as plugin:
            # Registration and capacity: every GPU of the machine, by UUID, with its NUMA node.
            await kubelet.wait_for_allocatable(GPU, 8, timeout=30)
            devices = kubelet.devices(GPU)
            assert set(devices) == {g.uuid for g in machine.gpus}
            assert {d.numa_nodes for d in devices.values()} == {(1,), (3,), (5,), (7,)}

            # An allocation: a pair under one PCIe switch, the backend's and the site's setup.
            got = await kubelet.allocate(GPU, 2, pod="pair")
            index = {g.uuid: g.index for g in machine.gpus}
            assert sorted(index[i] for i in got.device_ids) in ([0, 1], [2, 3], [4, 5], [6, 7])
            assert got.allocation.env == {
                "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
                "NVIDIA_VISIBLE_DEVICES": ",".join(got.device_ids),
            }
            nodes = {n.host_path for n in got.allocation.device_nodes}
            assert {"/dev/nvidiactl", "/dev/nvidia-uvm"} <= nodes
            assert {f"/dev/nvidia{index[i]}" for i in got.device_ids} <= nodes

            # /healthz and /metrics, as the DaemonSet's probes and Prometheus ask.
            await wait_for_healthz(port)
            status, metrics = await http_get(port, "/metrics")
            assert status == 200
            assert 'devplugin_registered{resource="nvidia.com/gpu"} 1.0' in metrics

            # Hot reload: the edited file is applied without a restart.
            changed = config_for(
                roots,
                sharing={"timeSlicing": {"replicas": 2}},
                containerEnv={"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "SITE": "reloaded"},
            )
            write_atomically(config_file, {**changed, "logging": {"format": "json"}})
            await kubelet.wait_for_allocatable(GPU, 16, timeout=30)
            # The old IDs stay listed, Unhealthy, while pods may still hold them.
            healthy = {i for i, d in kubelet.devices(GPU).items() if d.health == "Healthy"}
            assert healthy == {f"{g.uuid}::{n}" for g in machine.gpus for n in (0, 1)}
            shared = await kubelet.allocate(GPU, 1, pod="shared")
            assert shared.allocation.env["SITE"] == "reloaded"

            plugin.process.terminate()
            with anyio.fail_after(20):
                assert await plugin.process.wait() == 0

        # SIGTERM: the socket is gone; the logs were JSON lines all along.
        assert not (kubelet.directory / "nvidia.com_gpu.sock").exists()
        messages = [e["message"] for e in plugin.records()]
        assert "nvidia.com/gpu: discovered 8 devices" in messages
        assert any("discovered 16 devices" in m for m in messages)


@pytest.mark.parametrize(
    ("change", "line"),
    [
        (
            {"health": {"ignoredXids": [13, "x"]}},
            "health.ignoredXids[1]: must be an integer >= 1, got 'x'",
        ),
        ({"containerEnv": {"CUDA_DEVICE_ORDER": 1}}, "containerEnv.CUDA_DEVICE_ORDER"),
        ({"migStrategy": "all"}, "migStrategy: must be one of none, single, mixed"),
        ({"contanerEnv": {}}, "contanerEnv: unknown key; did you mean 'containerEnv'?"),
    ],
)
def test_a_bad_config_exits_2_with_one_line_naming_the_key(
    tmp_path: Path, change: dict[str, Any], line: str
) -> None:
    roots = fake_nvml.HostRoots(tmp_path / "sys", tmp_path / "dev", tmp_path / "proc")
    config_file = tmp_path / "config.yaml"
    write_atomically(config_file, config_for(roots, **change))
    command = runner_command(
        "t4_pcie", tmp_path, "run", "plugin:SiteGpuPlugin", "--config", str(config_file)
    )

    done = subprocess.run(
        command, env=runner_env(), capture_output=True, text=True, timeout=60, check=False
    )

    assert done.returncode == 2
    [error] = done.stderr.splitlines()
    assert error.startswith("devplugin: error: ")
    assert line in error


# ----------------------------------------------------------------------------- faults, in-process


async def test_a_gpu_that_falls_off_the_bus_leaves_and_comes_back_once_it_probes_clean(
    tmp_path: Path,
    example: ModuleType,
) -> None:
    nvml = fake_nvml.dgx_a100()
    plugins = load(example, tmp_path, nvml, health={"probeInterval": 0.02, "recoveryPeriod": 0})

    async with FakeKubelet() as kubelet, serving(*plugins, settings=kubelet.settings()):
        await kubelet.wait_for_allocatable(GPU, 8)
        assert await anyio.to_thread.run_sync(nvml.wait_for_waiters, 1, 5.0, 3)
        nvml.lose(3)
        nvml.xid(3, 79)
        await kubelet.wait_for_allocatable(GPU, 7)
        assert kubelet.devices(GPU)[nvml.gpus[3].uuid].health == "Unhealthy"

        nvml.recover(3)
        await kubelet.wait_for_allocatable(GPU, 8)
        assert kubelet.capacity(GPU) == 8

    assert nvml.init_count == 0


async def test_an_xid_is_pushed_without_waiting_for_a_probe(
    tmp_path: Path, example: ModuleType
) -> None:
    nvml = fake_nvml.dgx_a100()
    plugins = load(example, tmp_path, nvml, health={"probeInterval": 3600})

    async with FakeKubelet() as kubelet, serving(*plugins, settings=kubelet.settings()):
        await kubelet.wait_for_allocatable(GPU, 8)
        assert await anyio.to_thread.run_sync(nvml.wait_for_waiters, 1, 5.0, 5)
        nvml.ecc_double_bit(5)
        await kubelet.wait_for_health(GPU, nvml.gpus[5].uuid, "Unhealthy")
        assert kubelet.allocatable(GPU) == 7


async def test_a_mixed_mig_node_serves_each_profile_and_one_instance_fails_alone(
    tmp_path: Path,
    example: ModuleType,
) -> None:
    nvml = fake_nvml.a100_mig([("3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"), None])
    plugins = load(example, tmp_path, nvml, migStrategy="mixed")
    names = [p.resource_name for p in plugins]
    assert names == [
        GPU,
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
        assert got.allocation.env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"

        assert await anyio.to_thread.run_sync(nvml.wait_for_waiters, 4, 5.0)
        nvml.xid(0, 94, gi=sick.gi, ci=sick.ci)
        await kubelet.wait_for_allocatable("nvidia.com/mig-1g.10gb", 1)

        assert kubelet.devices("nvidia.com/mig-1g.10gb")[sick.uuid].health == "Unhealthy"
        assert kubelet.allocatable("nvidia.com/mig-2g.20gb") == 1
        assert kubelet.allocatable(GPU) == 1

    assert nvml.init_count == 0


async def test_time_sliced_gpus_are_shared_one_per_container(
    tmp_path: Path, example: ModuleType
) -> None:
    nvml = fake_nvml.t4_pcie()
    sharing = {"timeSlicing": {"replicas": 4, "failRequestsGreaterThanOne": True}}
    plugins = load(example, tmp_path, nvml, sharing=sharing)

    async with FakeKubelet() as kubelet, serving(*plugins, settings=kubelet.settings()):
        await kubelet.wait_for_allocatable(GPU, 16)
        first = await kubelet.allocate(GPU, 1, pod="a")
        second = await kubelet.allocate(GPU, 1, pod="b")
        with pytest.raises(AdmissionError, match="maximum request size for shared resources is 1"):
            await kubelet.allocate(GPU, 2, pod="c")

    # The second container lands on another physical GPU (replicas are spread).
    uuids = {ids.device_ids[0].split("::")[0] for ids in (first, second)}
    assert len(uuids) == 2
    assert first.allocation.env["NVIDIA_VISIBLE_DEVICES"] in {g.uuid for g in nvml.gpus}


async def test_no_container_starts_on_a_gpu_lost_since_it_was_advertised(
    tmp_path: Path, example: ModuleType
) -> None:
    nvml = fake_nvml.t4_pcie()
    plugins = load(example, tmp_path, nvml, health={"probeInterval": 3600})

    async with FakeKubelet() as kubelet, serving(*plugins, settings=kubelet.settings()):
        await kubelet.wait_for_allocatable(GPU, 4)
        nvml.lose(2)  # no Xid, and no probe before the pod comes

        with pytest.raises(ContainerStartError, match=nvml.gpus[2].uuid):
            await kubelet.allocate(GPU, 4)


# ----------------------------------------------------------------------------- GPU sharing

GPUSHARE = "config-gpushare.yaml"
HAMI = "config-hami.yaml"
MEM = "aliyun.com/gpu-mem"
COUNT = "aliyun.com/gpu-count"


def sharing_config(name: str, roots: fake_nvml.HostRoots, **changes: Any) -> dict[str, Any]:
    """The shipped sharing config ``name`` on the fake host ``roots``, ``changes`` merged in."""
    config: dict[str, Any] = {**yaml.safe_load((HERE / name).read_text()), **roots.config()}
    for key, value in changes.items():
        config[key] = {**config.get(key, {}), **value} if isinstance(value, dict) else value
    return config


def load_sharing(
    example: ModuleType, tmp_path: Path, nvml: FakeNVML, name: str, **changes: Any
) -> list[Any]:
    roots = nvml.write_host(tmp_path / "host")
    with nvml.installed():
        plugins: list[Any] = example.SiteGpuPlugin.from_config(
            sharing_config(name, roots, **changes)
        )
    return plugins


def test_the_sharing_configs_are_valid_and_say_what_they_serve(
    tmp_path: Path, example: ModuleType
) -> None:
    nvml = fake_nvml.dgx_a100_40gb()

    mem, count = load_sharing(example, tmp_path, nvml, GPUSHARE)
    [sliced] = load_sharing(example, tmp_path, nvml, HAMI)

    assert (mem.resource_name, count.resource_name) == (MEM, COUNT)
    assert mem.config.memory.unit == "GiB"
    assert mem.config.memory.placement == "binpack"
    assert not mem.config.memory.multi_gpu
    assert sliced.resource_name == GPU
    assert sliced.config.vgpu.slices == 4
    assert sliced.config.vgpu.interceptor.host_path == Path("/usr/local/vgpu")


async def test_gpushare_config_binpacks_refuses_45_gib_and_follows_gpu_faults(
    tmp_path: Path,
    example: ModuleType,
) -> None:
    nvml = fake_nvml.dgx_a100_40gb()  # A100x8, 40 GiB each
    health = {"probeInterval": 0.02, "recoveryPeriod": 0}
    plugins = load_sharing(example, tmp_path, nvml, GPUSHARE, health=health)
    index = {g.uuid: g.index for g in nvml.gpus}

    async with FakeKubelet() as kubelet, serving(*plugins, settings=kubelet.settings()):
        await kubelet.wait_for_allocatable(MEM, 320)
        await kubelet.wait_for_allocatable(COUNT, 8)
        landed = {}
        held: set[str] = set()
        for size in (10, 35, 30):
            got = await kubelet.allocate(MEM, size)
            held.update(got.device_ids)
            env = got.allocation.env
            landed[size] = index[env["NVIDIA_VISIBLE_DEVICES"]]
            assert env["ALIYUN_COM_GPU_MEM_IDX"] == str(landed[size])
            assert env["ALIYUN_COM_GPU_MEM_CONTAINER"] == str(size)
            assert env["ALIYUN_COM_GPU_MEM_DEV"] == "40"
            assert env["CUDA_DEVICE_MEMORY_LIMIT_0"] == f"{size * 1024}m"
        # Binpack: 10 GiB on GPU 0; 35 does not fit beside it and takes GPU 1; 30 fills GPU 0.
        assert landed == {10: 0, 35: 1, 30: 0}

        with pytest.raises(AdmissionError, match="no single GPU has 45 GiB free; largest free"):
            await kubelet.allocate(MEM, 45)
        assert kubelet.allocated(MEM) == held  # the refused pod holds nothing

        # A GPU fault takes exactly that GPU's 40 units out (and its count), then back.
        assert await anyio.to_thread.run_sync(nvml.wait_for_waiters, 2, 5.0, 5)
        nvml.lose(5)
        nvml.xid(5, 79)
        await kubelet.wait_for_allocatable(MEM, 280)
        await kubelet.wait_for_allocatable(COUNT, 7)
        key = nvml.gpus[5].uuid.removeprefix("GPU-").split("-")[0]
        out = {i for i, d in kubelet.devices(MEM).items() if d.health == "Unhealthy"}
        assert out == {f"{key}-{n}" for n in range(40)}
        nvml.recover(5)
        await kubelet.wait_for_allocatable(MEM, 320)
        await kubelet.wait_for_allocatable(COUNT, 8)

    assert nvml.init_count == 0


async def test_hami_config_gives_n_slices_on_n_gpus_with_limits_and_the_interceptor(
    tmp_path: Path,
    example: ModuleType,
) -> None:
    nvml = fake_nvml.dgx_a100_40gb()
    health = {"probeInterval": 0.02, "recoveryPeriod": 0}
    plugins = load_sharing(example, tmp_path, nvml, HAMI, health=health)

    async with FakeKubelet() as kubelet, serving(*plugins, settings=kubelet.settings()):
        await kubelet.wait_for_allocatable(GPU, 32)
        got = await kubelet.allocate(GPU, 3)
        env = got.allocation.env
        visible = env["NVIDIA_VISIBLE_DEVICES"].split(",")
        assert len(set(visible)) == 3
        assert {env[f"CUDA_DEVICE_MEMORY_LIMIT_{i}"] for i in range(3)} == {"10240m"}
        assert env["CUDA_DEVICE_SM_LIMIT"] == "25"
        assert {(m.host_path, m.container_path) for m in got.allocation.mounts} == {
            ("/usr/local/vgpu/libvgpu.so", "/usr/local/vgpu/libvgpu.so"),
            ("/usr/local/vgpu/ld.so.preload", "/etc/ld.so.preload"),
            ("/usr/local/vgpu/vgpulock", "/tmp/vgpulock"),
        }

        # A GPU fault takes its 4 slices out, and they come back once it probes clean.
        assert await anyio.to_thread.run_sync(nvml.wait_for_waiters, 1, 5.0, 6)
        nvml.lose(6)
        nvml.xid(6, 79)
        await kubelet.wait_for_allocatable(GPU, 28)
        out = {i for i, d in kubelet.devices(GPU).items() if d.health == "Unhealthy"}
        assert out == {f"{nvml.gpus[6].uuid}::{n}" for n in range(4)}
        nvml.recover(6)
        await kubelet.wait_for_allocatable(GPU, 32)


@pytest.mark.parametrize(
    ("name", "target"),
    [(GPUSHARE, "plugin:SiteGpuPlugin"), (HAMI, "nvidia")],
    ids=["gpushare", "hami"],
)
async def test_devplugin_run_serves_the_sharing_configs(
    tmp_path: Path, name: str, target: str
) -> None:
    machine = fake_nvml.dgx_a100_40gb()
    host = tmp_path / "host"
    config_file = tmp_path / name
    roots = fake_nvml.HostRoots(host / "sys", host / "dev", host / "proc")
    write_atomically(config_file, {**sharing_config(name, roots), "logging": {"format": "json"}})
    index = {g.uuid: g.index for g in machine.gpus}

    async with FakeKubelet() as kubelet:
        command = runner_command(
            "dgx_a100_40gb",
            host,
            "run",
            target,
            "--config",
            str(config_file),
            "--device-plugin-dir",
            str(kubelet.directory),
            "--registration",
            "kubelet",
        )
        async with devplugin_run(command) as plugin:
            if name == GPUSHARE:
                await kubelet.wait_for_allocatable(MEM, 320, timeout=30)
                await kubelet.wait_for_allocatable(COUNT, 8, timeout=30)
                for size, gpu in ((10, 0), (35, 1), (30, 0)):
                    got = await kubelet.allocate(MEM, size)
                    assert index[got.allocation.env["NVIDIA_VISIBLE_DEVICES"]] == gpu
                with pytest.raises(AdmissionError, match="no single GPU has 45 GiB free"):
                    await kubelet.allocate(MEM, 45)
            else:
                await kubelet.wait_for_allocatable(GPU, 32, timeout=30)
                got = await kubelet.allocate(GPU, 2)
                visible = got.allocation.env["NVIDIA_VISIBLE_DEVICES"].split(",")
                assert len(set(visible)) == 2
                assert got.allocation.env["CUDA_DEVICE_SM_LIMIT"] == "25"

            plugin.process.terminate()
            with anyio.fail_after(20):
                assert await plugin.process.wait() == 0

    messages = [e["message"] for e in plugin.records()]
    if name == GPUSHARE:
        assert f"{MEM}: discovered 320 devices" in messages
        assert any(
            "Allocate refused: " in m and "largest free: 40 GiB on GPU 2" in m for m in messages
        )
    else:
        assert f"{GPU}: discovered 32 devices" in messages


def test_devplugin_run_refuses_mib_units_over_the_4_mib_limit_naming_the_size(
    tmp_path: Path,
) -> None:
    roots = fake_nvml.HostRoots(tmp_path / "sys", tmp_path / "dev", tmp_path / "proc")
    config_file = tmp_path / "config.yaml"
    write_atomically(
        config_file, sharing_config(GPUSHARE, roots, sharing={"memory": {"unit": "MiB"}})
    )
    command = runner_command(
        "dgx_a100_40gb", tmp_path, "run", "plugin:SiteGpuPlugin", "--config", str(config_file)
    )

    done = subprocess.run(
        command, env=runner_env(), capture_output=True, text=True, timeout=60, check=False
    )

    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        "devplugin: error: sharing.memory.unit: MiB units make a ListAndWatch list of up to"
        " 11,379,920 bytes here (327,680 devices on 8 GPUs), over the kubelet's limit of"
        " 4,194,304 bytes (4 MiB); use GiB"
    ]
