"""The example FPGA plugin against FakeKubelet on fake hosts: two Alveo U250s, two DFL ports."""

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
from devplugin_sdk.testing import FakeKubelet, serving
from devplugin_sdk.testing.fpga_trees import (
    DFL_INTERFACE_ID,
    FpgaHost,
    alveo_u250_host,
    dfl_pac_host,
)

HERE = Path(__file__).parent
ALL_F = "f" * 32


def _example() -> ModuleType:
    # Examples are not a package (pytest runs with --import-mode=importlib): load by path.
    spec = importlib.util.spec_from_file_location("fpga_example_plugin", HERE / "plugin.py")
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


def load(config: str, host: FpgaHost, **overrides: Any) -> list[Any]:
    """The plugins of ``config`` with the roots pointed at the fake host."""
    plugins: list[Any] = example.load_plugins(
        HERE / config,
        sysfs_root=host.sysfs_root,
        dev_root=host.dev_root,
        health_interval=0.05,
        **overrides,
    )
    return plugins


async def test_u250_boards_are_served_and_allocated_with_their_render_nodes(
    tmp_path: Path,
) -> None:
    host, _ = alveo_u250_host(tmp_path)
    plugins = load("config.yaml", host)
    assert [p.resource_name for p in plugins] == ["amd.com/u250", "amd.com/u250-4"]

    async with FakeKubelet() as kubelet, serving(*plugins, settings=kubelet.settings()):
        await kubelet.wait_for_allocatable("amd.com/u250", 2)
        await kubelet.wait_for_registrations("amd.com/u250-4", 1)
        devices = kubelet.devices("amd.com/u250")
        assert {d.id: d.numa_nodes for d in devices.values()} == {
            "0000:3b:00.1": (0,),
            "0000:d8:00.1": (1,),
        }
        assert kubelet.capacity("amd.com/u250-4") == 0

        got = await kubelet.allocate("amd.com/u250", 1)

        [node] = got.allocation.device_nodes
        board = got.device_ids[0]
        render = {"0000:3b:00.1": "renderD128", "0000:d8:00.1": "renderD129"}[board]
        assert (node.host_path, node.container_path) == (f"/dev/dri/{render}",) * 2
        assert got.allocation.env["FPGA_DEVICES"] == board


async def test_offline_board_leaves_allocatable_and_comes_back(tmp_path: Path) -> None:
    host, boards = alveo_u250_host(tmp_path)
    plugins = load("config.yaml", host)

    async with FakeKubelet() as kubelet, serving(*plugins, settings=kubelet.settings()):
        await kubelet.wait_for_allocatable("amd.com/u250", 2)

        boards[0].set_offline(True)
        await kubelet.wait_for_health("amd.com/u250", "0000:3b:00.1", "Unhealthy")
        assert kubelet.allocatable("amd.com/u250") == 1
        assert kubelet.capacity("amd.com/u250") == 2

        boards[0].set_offline(False)
        await kubelet.wait_for_allocatable("amd.com/u250", 2)

        boards[1].unplug()
        await kubelet.wait_for(lambda: kubelet.capacity("amd.com/u250") == 1, what="unplug")
        boards[1].replug()
        await kubelet.wait_for_allocatable("amd.com/u250", 2)


async def test_two_boards_for_one_pod_come_from_one_numa_node(tmp_path: Path) -> None:
    host = FpgaHost(tmp_path)
    for slot, node in (("0000:3b:00", 0), ("0000:5e:00", 1), ("0000:86:00", 0), ("0000:d8:00", 1)):
        host.add_alveo(slot, numa_node=node)
    plugins = load("config.yaml", host)

    async with FakeKubelet() as kubelet, serving(*plugins, settings=kubelet.settings()):
        await kubelet.wait_for_allocatable("amd.com/u250", 4)
        got = await kubelet.allocate("amd.com/u250", 2)
        chosen = {d: kubelet.devices("amd.com/u250")[d].numa_nodes for d in got.device_ids}

    assert got.preferred == got.device_ids
    assert len(set(chosen.values())) == 1, chosen


async def test_dfl_ports_are_served_per_afu_and_a_crashed_port_recovers(tmp_path: Path) -> None:
    host, cards = dfl_pac_host(tmp_path)
    plugins = load("config-dfl.yaml", host)
    assert [p.resource_name for p in plugins] == ["fpga.intel.com/nlb0", "fpga.intel.com/nlb3"]

    async with FakeKubelet() as kubelet, serving(*plugins, settings=kubelet.settings()):
        await kubelet.wait_for_allocatable("fpga.intel.com/nlb0", 1)
        await kubelet.wait_for_allocatable("fpga.intel.com/nlb3", 1)
        got = await kubelet.allocate("fpga.intel.com/nlb3", 1)
        assert got.device_ids == ("0000:af:00.0-port0",)
        assert [n.container_path for n in got.allocation.device_nodes] == ["/dev/dfl-port.1"]

        cards[0].set_afu_id(0, ALL_F)
        await kubelet.wait_for_health("fpga.intel.com/nlb0", "0000:5e:00.0-port0", "Unhealthy")
        cards[0].set_afu_id(0, "d8424dc4a4a3c413f89e433683f9040b")
        await kubelet.wait_for_allocatable("fpga.intel.com/nlb0", 1)


async def test_dfl_region_mode_serves_cards_by_interface_id(tmp_path: Path) -> None:
    host, _ = dfl_pac_host(tmp_path)
    plugins = load("config-dfl.yaml", host, mode="region", rename={})
    resource = f"fpga.intel.com/region-{DFL_INTERFACE_ID}"
    assert [p.resource_name for p in plugins] == [resource]

    async with FakeKubelet() as kubelet, serving(*plugins, settings=kubelet.settings()):
        await kubelet.wait_for_allocatable(resource, 2)
        got = await kubelet.allocate(resource, 1)

    assert got.allocation.annotations == {"com.intel.fpga.mode": "fpga.intel.com/region"}
    assert len(got.allocation.device_nodes) == 1


def test_main_refuses_a_bad_config_and_a_host_without_boards(tmp_path: Path) -> None:
    host = FpgaHost(tmp_path / "host")
    config = tmp_path / "config.yaml"
    config.write_text(
        f"family: dfl\nsysfs_root: {host.sysfs_root}\ndev_root: {host.dev_root}\n",
        encoding="utf-8",
    )
    assert example.main(["--config", str(config)]) == 1

    config.write_text("family: opae\n", encoding="utf-8")
    with pytest.raises(SystemExit) as exited:
        example.main(["--config", str(config)])
    assert exited.value.code == 2


async def test_main_with_the_daemonset_args_serves_healthz_on_its_probe_port(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config, container = daemonset_container()
    [port] = container["ports"]
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": port["name"]}
    host, _ = alveo_u250_host(tmp_path / "host")
    config.update(sysfs_root=str(host.sysfs_root), dev_root=str(host.dev_root))

    plugins, kwargs = run_main_as_the_daemonset(config, container, tmp_path, monkeypatch)
    assert kwargs["port"] == port["containerPort"] == 9450
    assert kwargs["settings"].health_interval == config["health_interval"]

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
        await kubelet.wait_for_allocatable("amd.com/u250", 2)
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
