"""The example RDMA plugin against FakeKubelet on a fake ConnectX host: two InfiniBand HCAs and a
RoCE PF with two VFs, served as the three resources of config.yaml."""

from __future__ import annotations

import importlib.util
import sys
from functools import partial
from pathlib import Path
from types import ModuleType
from typing import Any

import anyio
import pytest
import yaml
from prometheus_client import CollectorRegistry

from devplugin_sdk import healthz
from devplugin_sdk.backends.rdma import load_config
from devplugin_sdk.testing import FakeKubelet, serving
from devplugin_sdk.testing.rdma_trees import RdmaHost, connectx_host

HERE = Path(__file__).parent


def _example() -> ModuleType:
    # Examples are not a package (pytest runs with --import-mode=importlib): load by path.
    spec = importlib.util.spec_from_file_location("rdma_example_plugin", HERE / "plugin.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


example = _example()


async def http_get(port: int, path: str) -> bytes:
    """One HTTP/1.1 request to the plugin's endpoint server, as a kubelet probe makes it."""
    async with await anyio.connect_tcp("127.0.0.1", port) as stream:
        await stream.send(f"GET {path} HTTP/1.1\r\nHost: probe\r\n\r\n".encode())
        reply = b""
        with anyio.fail_after(5):
            async for chunk in stream:
                reply += chunk
    return reply


def daemonset_container() -> tuple[dict[str, Any], dict[str, Any]]:
    """The ConfigMap's config.yaml (parsed) and the plugin container of daemonset.yaml."""
    config_map, daemonset = yaml.safe_load_all((HERE / "daemonset.yaml").read_text("utf-8"))
    config: dict[str, Any] = yaml.safe_load(config_map["data"]["config.yaml"])
    container: dict[str, Any] = daemonset["spec"]["template"]["spec"]["containers"][0]
    return config, container


def run_main_as_the_daemonset(
    config: dict[str, Any],
    container: dict[str, Any],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> tuple[list[Any], dict[str, Any]]:
    """main() with the container's args and ``config`` in place of its --config file; returns
    what it handed to ``healthz.run`` (which is stubbed: the real one blocks until SIGTERM)."""
    config_file = tmp_path / "config.yaml"
    config_file.write_text(yaml.safe_dump(config), encoding="utf-8")
    args = [
        f"--config={config_file}" if a.startswith("--config=") else a for a in container["args"]
    ]
    served: list[tuple[list[Any], dict[str, Any]]] = []

    def no_endpoints(*plugins: Any, **kwargs: Any) -> None:
        pytest.fail("served without /healthz although --metrics-port was given")

    monkeypatch.setattr(example, "run", no_endpoints)
    monkeypatch.setattr(healthz, "run", lambda plugins, **kwargs: served.append((plugins, kwargs)))
    assert example.main(args) == 0
    [(plugins, kwargs)] = served
    return plugins, kwargs


def load(host: RdmaHost) -> list[Any]:
    """The plugins of config.yaml with the roots pointed at the fake host."""
    plugins: list[Any] = example.load_plugins(
        HERE / "config.yaml",
        sysfs_root=host.sysfs_root,
        dev_root=host.dev_root,
        health_interval=0.05,
    )
    return plugins


async def test_config_serves_vfs_ib_hcas_and_shared_roce_with_nccl_variables(
    tmp_path: Path,
) -> None:
    host = connectx_host(tmp_path)  # mlx5_0/1: IB; mlx5_2: RoCE PF; mlx5_3/4: its VFs
    plugins = load(host)
    assert [p.resource_name for p in plugins] == ["rdma/roce_vf", "rdma/ib", "rdma/roce_shared"]

    async with FakeKubelet() as kubelet, serving(*plugins, settings=kubelet.settings()):
        await kubelet.wait_for_allocatable("rdma/roce_vf", 2)
        await kubelet.wait_for_allocatable("rdma/ib", 2)
        await kubelet.wait_for_allocatable("rdma/roce_shared", 64)
        assert {d.id: d.numa_nodes for d in kubelet.devices("rdma/ib").values()} == {
            "mlx5_0": (0,),
            "mlx5_1": (1,),
        }

        ib = await kubelet.allocate("rdma/ib", 2)
        shared = await kubelet.allocate("rdma/roce_shared", 1)

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


async def test_ports_going_down_leave_allocatable_and_come_back(tmp_path: Path) -> None:
    host = connectx_host(tmp_path, vfs=0)
    plugins = load(host)

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


async def test_vfs_created_and_destroyed_change_capacity(tmp_path: Path) -> None:
    host = connectx_host(tmp_path, vfs=1)
    plugins = load(host)

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


def test_main_refuses_a_bad_config(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text("resources:\n  - resourceName: rdma/ib\n    mode: shared\n", encoding="utf-8")

    with pytest.raises(SystemExit) as exited:
        example.main(["--config", str(config)])

    assert exited.value.code == 2


def test_the_daemonset_configmap_is_a_valid_config() -> None:
    documents = list(yaml.safe_load_all((HERE / "daemonset.yaml").read_text(encoding="utf-8")))
    config = yaml.safe_load(documents[0]["data"]["config.yaml"])

    loaded = load_config(config)

    assert [r.resource_name for r in loaded.resources] == [
        "rdma/roce_vf",
        "rdma/ib",
        "rdma/roce_shared",
    ]
    assert (loaded.sysfs_root, loaded.dev_root) == (Path("/host/sys"), Path("/host/dev"))


async def test_main_with_the_daemonset_args_serves_healthz_on_its_host_port(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config, container = daemonset_container()
    [port] = container["ports"]
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": port["name"]}
    host = connectx_host(tmp_path / "host")
    config.update(sysfsRoot=str(host.sysfs_root), devRoot=str(host.dev_root))

    plugins, kwargs = run_main_as_the_daemonset(config, container, tmp_path, monkeypatch)
    # hostNetwork: not the 9450 the other plugins take on the node.
    assert kwargs["port"] == port["containerPort"] == 9452
    assert [p.resource_name for p in plugins] == ["rdma/roce_vf", "rdma/ib", "rdma/roce_shared"]

    # What the probes then reach: those plugins and the endpoints, on a free port here (and
    # a registry of its own: the default one takes each metric name once per process).
    async with FakeKubelet() as kubelet, anyio.create_task_group() as tg:
        bound = await tg.start(
            partial(
                healthz.serve_with_http,
                plugins,
                port=0,
                settings=kubelet.settings(),
                registry=CollectorRegistry(),
            )
        )
        await kubelet.wait_for_allocatable("rdma/ib", 2)
        # /healthz is 200 once every plugin is registered with its stream open, as the
        # plugins see it (the kubelet records a registration before the plugin hears back).
        await kubelet.wait_for(
            lambda: not healthz.problems(healthz.served_statuses()), what="every plugin live"
        )
        reply = await http_get(bound, "/healthz")
        metrics = await http_get(bound, "/metrics")
        tg.cancel_scope.cancel()

    assert reply.startswith(b"HTTP/1.1 200")
    assert b"devplugin_registered{" in metrics
