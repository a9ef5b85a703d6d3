"""The example RDMA plugin on a fake ConnectX host (two InfiniBand HCAs, a RoCE PF and its VFs).

Run as the image runs it, ``devplugin run plugin:RdmaExamplePlugin --config FILE`` in a real
process against a FakeKubelet: registration, allocation, /healthz and /metrics, JSON logs, a hot
reload and a bad config. Port faults and hot-plug in-process, through ``from_config``. And the
image, the DaemonSet and the kustomize overlay agreeing on what runs.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import sys
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import anyio
import anyio.abc
import yaml
from plugin_process import PluginProcess, spawned

from devplugin_sdk import cli
from devplugin_sdk.backends.rdma import load_config
from devplugin_sdk.cli.runfile import parse_run_config
from devplugin_sdk.config import load_yaml
from devplugin_sdk.testing import FakeKubelet, serving
from devplugin_sdk.testing.rdma_trees import RdmaHost, connectx_host

HERE = Path(__file__).parent
OVERLAY = HERE.parent.parent / "deploy" / "kustomize" / "overlays" / "rdma"
TARGET = "plugin:RdmaExamplePlugin"
RESOURCES = ("rdma/roce_vf", "rdma/ib", "rdma/roce_shared")


def config_yaml(host: RdmaHost, *, shares: int | None = None) -> dict[str, Any]:
    """config.yaml with its roots pointed at the fake host and quick rescans."""
    config = dict(load_yaml(HERE / "config.yaml"))
    config.update(sysfsRoot=str(host.sysfs_root), devRoot=str(host.dev_root), healthInterval=0.1)
    if shares is not None:
        [shared] = [r for r in config["resources"] if r["resourceName"] == "rdma/roce_shared"]
        shared["shares"] = shares
    return config


def write_config(path: Path, config: Mapping[str, Any]) -> None:
    """Replace the file at once, as a ConfigMap update does (a reader never sees half of it)."""
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(yaml.safe_dump(dict(config)), encoding="utf-8")
    os.replace(temporary, path)


def backend_keys(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """What ``devplugin run`` hands to ``from_config``: the file less the SDK's keys."""
    return parse_run_config(config).backend_options


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


async def http_get(port: int, path: str) -> bytes:
    """One HTTP/1.1 request to the plugin's endpoint server, as a kubelet probe makes it."""
    async with await anyio.connect_tcp("127.0.0.1", port) as stream:
        await stream.send(f"GET {path} HTTP/1.1\r\nHost: probe\r\n\r\n".encode())
        reply = b""
        with anyio.fail_after(5):
            async for chunk in stream:
                reply += chunk
    return reply


def devplugin_command(*args: str) -> tuple[list[str], dict[str, str]]:
    """``devplugin ARGS`` as this interpreter runs it, with plugin.py importable as ``plugin``."""
    path = os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH")) if p)
    return [sys.executable, "-m", "devplugin_sdk", *args], {**os.environ, "PYTHONPATH": path}


@asynccontextmanager
async def devplugin_run(
    config_file: Path, kubelet: FakeKubelet, *args: str
) -> AsyncIterator[PluginProcess]:
    """``devplugin run plugin:RdmaExamplePlugin --config FILE`` registering with ``kubelet``;
    stopped (SIGTERM, then SIGKILL) when the block ends."""
    command, env = devplugin_command(
        "run",
        TARGET,
        "--config",
        str(config_file),
        "--device-plugin-dir",
        str(kubelet.directory),
        "--registration",
        "kubelet",
        *args,
    )
    async with spawned(command, env=env) as plugin:
        yield plugin


# ----------------------------------------------------------------------------- as the image runs it


async def test_devplugin_run_serves_the_config_with_nccl_variables_probes_and_reload(
    tmp_path: Path,
) -> None:
    host = connectx_host(tmp_path / "host")  # mlx5_0/1: IB; mlx5_2: RoCE PF; mlx5_3/4: its VFs
    config_file = tmp_path / "config.yaml"
    write_config(config_file, config_yaml(host))
    port = free_port()

    async with (
        FakeKubelet() as kubelet,
        devplugin_run(config_file, kubelet, f"--metrics-port={port}") as plugin,
    ):
        for resource, count in zip(RESOURCES, (2, 2, 64), strict=True):
            await kubelet.wait_for_allocatable(resource, count, timeout=20)
        assert {d.id: d.numa_nodes for d in kubelet.devices("rdma/ib").values()} == {
            "mlx5_0": (0,),
            "mlx5_1": (1,),
        }
        ib = await kubelet.allocate("rdma/ib", 2)
        shared = await kubelet.allocate("rdma/roce_shared", 1)

        # Registered as the plugin sees it, with the kubelet's streams open: /healthz is 200.
        for resource in RESOURCES:
            await plugin.wait_for_record(
                lambda r, resource=resource: (
                    r.get("resource") == resource and "registered" in r["message"]
                )
            )
        healthz = await http_get(port, "/healthz")
        metrics = await http_get(port, "/metrics")

        # The subnet manager went away: the link is up, the port stays INIT.
        host.set_port_state("mlx5_0", state="INIT", phys_state="LinkUp")
        await kubelet.wait_for_health("rdma/ib", "mlx5_0", "Unhealthy", timeout=10)

        write_config(config_file, config_yaml(host, shares=8))  # a ConfigMap edit
        await kubelet.wait_for_allocatable("rdma/roce_shared", 8, timeout=20)
        assert kubelet.allocatable("rdma/roce_vf") == 2

        assert await plugin.stop() == 0

    assert sorted(ib.device_ids) == ["mlx5_0", "mlx5_1"]
    env = ib.allocation.env
    hcas = env["RDMA_DEVICES"].split(",")
    assert sorted(hcas) == ["mlx5_0", "mlx5_1"]
    assert env["NCCL_IB_HCA"] == "=" + ",".join(f"{h}:1" for h in hcas)
    assert env["UCX_NET_DEVICES"] == ",".join(f"{h}:1" for h in hcas)
    assert sorted(env["RDMA_NETDEVS"].split(",")) == ["ib0", "ib1"]
    assert {n.host_path for n in ib.allocation.device_nodes} == {
        "/dev/infiniband/uverbs0",
        "/dev/infiniband/umad0",
        "/dev/infiniband/issm0",
        "/dev/infiniband/uverbs1",
        "/dev/infiniband/umad1",
        "/dev/infiniband/issm1",
        "/dev/infiniband/rdma_cm",
    }
    # issm: false for the shared resource: a pod sharing the NIC cannot become subnet manager.
    assert [n.host_path for n in shared.allocation.device_nodes] == [
        "/dev/infiniband/uverbs2",
        "/dev/infiniband/umad2",
        "/dev/infiniband/rdma_cm",
    ]
    assert shared.allocation.env["RDMA_NETDEVS"] == "ens3f0np0"
    assert healthz.startswith(b"HTTP/1.1 200")
    assert b"devplugin_registered{" in metrics
    records = plugin.records()  # every line of the log is a JSON object
    # Why mlx5_0 went Unhealthy, logged once although every rescan (0.1 s) sees it again.
    [why] = [r for r in records if r["logger"] == "devplugin_sdk.backends.rdma"]
    assert (why["resource"], why["device"], why["message"]) == (
        "rdma/ib",
        "mlx5_0",
        "mlx5_0: port 1 is INIT/LinkUp",
    )


async def test_devplugin_run_refuses_a_bad_config_in_one_line_with_exit_2(tmp_path: Path) -> None:
    config_file = tmp_path / "config.yaml"
    config = dict(load_yaml(HERE / "config.yaml"))
    del config["resources"][2]["shares"]  # rdma/roce_shared is mode: shared
    write_config(config_file, config)
    command, env = devplugin_command("run", TARGET, "--config", str(config_file))

    with anyio.fail_after(30):
        result = await anyio.run_process(command, env=env, check=False)

    assert result.returncode == 2
    [line] = result.stderr.decode().splitlines()
    assert "resources[2].shares: is required in mode 'shared'" in line


# ----------------------------------------------------------------------------- faults, in-process


async def test_ports_going_down_leave_allocatable_and_come_back(
    tmp_path: Path, example: ModuleType
) -> None:
    host = connectx_host(tmp_path, vfs=0)
    plugins = example.RdmaExamplePlugin.from_config(backend_keys(config_yaml(host)))

    async with FakeKubelet() as kubelet, serving(*plugins, settings=kubelet.settings()):
        await kubelet.wait_for_allocatable("rdma/ib", 2)
        await kubelet.wait_for_allocatable("rdma/roce_shared", 64)

        host.set_port_state("mlx5_0", state="INIT")  # the subnet manager went away
        await kubelet.wait_for_health("rdma/ib", "mlx5_0", "Unhealthy")
        host.set_port_state("mlx5_2", state="DOWN")  # RoCE link down: every share goes
        await kubelet.wait_for_allocatable("rdma/roce_shared", 0)
        assert kubelet.allocatable("rdma/ib") == 1
        assert kubelet.capacity("rdma/roce_shared") == 64

        host.set_port_state("mlx5_0", state="ACTIVE")
        host.set_port_state("mlx5_2", state="ACTIVE")
        await kubelet.wait_for_allocatable("rdma/ib", 2)
        await kubelet.wait_for_allocatable("rdma/roce_shared", 64)


async def test_vfs_created_and_destroyed_change_capacity(
    tmp_path: Path, example: ModuleType
) -> None:
    host = connectx_host(tmp_path, vfs=1)
    plugins = example.RdmaExamplePlugin.from_config(backend_keys(config_yaml(host)))

    async with FakeKubelet() as kubelet, serving(*plugins, settings=kubelet.settings()):
        await kubelet.wait_for_allocatable("rdma/roce_vf", 1)

        host.add_function(
            "0000:b1:00.3",
            ibdev="mlx5_4",
            netdev="ens3f0v1",
            device="0x101e",
            numa_node=1,
            physfn="0000:b1:00.0",
        )
        await kubelet.wait_for_allocatable("rdma/roce_vf", 2)
        host.remove_function("0000:b1:00.2")
        await kubelet.wait_for(lambda: kubelet.capacity("rdma/roce_vf") == 1, what="VF gone")

    assert set(kubelet.devices("rdma/roce_vf")) == {"mlx5_4"}


# ----------------------------------------------------------------------------- image and manifests


def dockerfile_instruction(name: str) -> list[str]:
    """The exec-form (JSON) arguments of the Dockerfile's ``name`` instruction."""
    [line] = [
        line
        for line in (HERE / "Dockerfile").read_text("utf-8").splitlines()
        if line.startswith(f"{name} ")
    ]
    words: list[str] = json.loads(line.removeprefix(f"{name} "))
    return words


def test_image_daemonset_and_overlay_run_the_same_thing() -> None:
    config_map, daemonset = yaml.safe_load_all((HERE / "daemonset.yaml").read_text("utf-8"))
    pod: dict[str, Any] = daemonset["spec"]["template"]["spec"]
    [container] = pod["containers"]
    entrypoint = dockerfile_instruction("ENTRYPOINT")
    assert entrypoint == ["devplugin", "run", TARGET]
    dockerfile = (HERE / "Dockerfile").read_text("utf-8")
    assert "COPY examples/rdma/plugin.py /app/plugin.py" in dockerfile
    assert "ENV PYTHONPATH=/app " in dockerfile

    # The image's CMD and the DaemonSet's args (which replace it) say the same to the CLI.
    from_cmd = cli.build_parser().parse_args([*entrypoint[1:], *dockerfile_instruction("CMD")])
    from_pod = cli.build_parser().parse_args([*entrypoint[1:], *container["args"]])
    assert (from_cmd.target, from_cmd.config, from_cmd.metrics_port) == (
        from_pod.target,
        from_pod.config,
        from_pod.metrics_port,
    )
    [port] = container["ports"]
    # hostNetwork: a port of the node, not the 9450 the other plugins take there.
    assert from_pod.metrics_port == port["containerPort"] == 9452
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": port["name"]}

    # The ConfigMap is mounted where --config points.
    [mount] = [m for m in container["volumeMounts"] if m["mountPath"] == "/etc/rdma-device-plugin"]
    [volume] = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert volume["configMap"]["name"] == config_map["metadata"]["name"]
    assert Path(from_pod.config).parent == Path(mount["mountPath"])

    # The image the kustomize overlay deploys is this one.
    [image] = yaml.safe_load((OVERLAY / "kustomization.yaml").read_text("utf-8"))["images"]
    assert container["image"] == f"{image['newName']}:{image['newTag']}"


def test_configmap_and_overlay_serve_config_yaml_from_the_host_mounts() -> None:
    # config.yaml, with the host's /sys and /dev where the DaemonSets mount them.
    expected = dict(load_yaml(HERE / "config.yaml"))
    expected.update(sysfsRoot="/host/sys", devRoot="/host/dev")
    documents = list(yaml.safe_load_all((HERE / "daemonset.yaml").read_text(encoding="utf-8")))
    config_map = yaml.safe_load(documents[0]["data"]["config.yaml"])
    overlay = load_yaml(OVERLAY / "config.yaml")

    for config in (config_map, overlay):
        sdk_keys = dataclasses.replace(parse_run_config(config), backend_options={})
        assert sdk_keys == dataclasses.replace(parse_run_config(expected), backend_options={})
        assert load_config(backend_keys(config)) == load_config(backend_keys(expected))
