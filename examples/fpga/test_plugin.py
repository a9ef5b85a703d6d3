"""The example FPGA plugin against FakeKubelet on fake hosts: two Alveo U250s, two DFL ports.

End to end as the image runs it: ``devplugin run plugin:FpgaExamplePlugin --config FILE`` in a
subprocess (registration, allocation, hot reload, /healthz, /metrics, JSON logs, refusals).
Allocation policy and DFL modes in-process, with ``FpgaExamplePlugin.from_config`` and
``serving``. And the image, the DaemonSet and the kustomize overlay agreeing on what runs.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import anyio
import anyio.to_thread
import yaml
from plugin_process import PluginProcess, spawned

from devplugin_sdk import cli
from devplugin_sdk.testing import FakeKubelet, serving
from devplugin_sdk.testing.fpga_trees import (
    DFL_INTERFACE_ID,
    NLB0_AFU_ID,
    FpgaHost,
    alveo_u250_host,
    dfl_pac_host,
)

HERE = Path(__file__).parent
OVERLAY = HERE.parent.parent / "deploy" / "kustomize" / "overlays" / "fpga"
ALL_F = "f" * 32
TARGET = "plugin:FpgaExamplePlugin"


def config_for(name: str, host: FpgaHost, **changes: Any) -> dict[str, Any]:
    """The example config ``name`` with the roots pointed at the fake host."""
    config: dict[str, Any] = yaml.safe_load((HERE / name).read_text("utf-8"))
    config.update(sysfsRoot=str(host.sysfs_root), devRoot=str(host.dev_root), **changes)
    return config


def load(example: ModuleType, name: str, host: FpgaHost, **changes: Any) -> list[Any]:
    """The plugins of the example config ``name`` on the fake host, rescanning every 50 ms."""
    plugins: list[Any] = example.FpgaExamplePlugin.from_config(
        config_for(name, host, healthInterval=0.05, **changes)
    )
    return plugins


# ----------------------------------------------------------------------------- devplugin run


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


def image_env() -> dict[str, str]:
    """The environment with this directory on PYTHONPATH, as in the image."""
    path = [str(HERE), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path)}


def devplugin(*args: str, cwd: Path, stderr: Any = subprocess.PIPE) -> subprocess.Popen[str]:
    """``python -m devplugin_sdk ARGS`` as the image runs it."""
    return subprocess.Popen(
        [sys.executable, "-m", "devplugin_sdk", *args],
        stdout=subprocess.DEVNULL,
        stderr=stderr,
        text=True,
        env=image_env(),
        cwd=cwd,
    )


@asynccontextmanager
async def running(*args: str, cwd: Path) -> AsyncIterator[PluginProcess]:
    """A ``devplugin`` process for the body (SIGTERM at the end, killed if it hangs); its log
    is its stderr."""
    command = [sys.executable, "-m", "devplugin_sdk", *args]
    async with spawned(command, env=image_env(), cwd=cwd) as plugin:
        try:
            yield plugin
        except BaseException:
            print(f"devplugin's log:\n{plugin.error_output[-6000:]}")  # shown on failure
            raise


async def http_get(port: int, path: str) -> bytes:
    """One HTTP/1.1 request to the plugin's endpoint server, as a kubelet probe makes it."""
    async with await anyio.connect_tcp("127.0.0.1", port) as stream:
        await stream.send(
            f"GET {path} HTTP/1.1\r\nHost: probe\r\nConnection: close\r\n\r\n".encode()
        )
        reply = b""
        with anyio.fail_after(5):
            async for chunk in stream:
                reply += chunk
    return reply


def healthz_ok(port: int) -> bool:
    """Whether /healthz answers 200 now (a blocking GET on loopback: the server is another
    process, so this cannot wait on the test's own event loop)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
            conn.sendall(b"GET /healthz HTTP/1.1\r\nHost: probe\r\nConnection: close\r\n\r\n")
            return conn.makefile("rb").readline().startswith(b"HTTP/1.1 200")
    except ConnectionRefusedError:  # not listening yet
        return False


async def test_devplugin_run_serves_allocates_reloads_and_reports(tmp_path: Path) -> None:
    host, _ = alveo_u250_host(tmp_path / "host")
    config_file = tmp_path / "config.yaml"
    config = config_for("config.yaml", host)
    config_file.write_text(yaml.safe_dump(config), encoding="utf-8")
    port = free_port()

    async with FakeKubelet() as kubelet:
        args = ["--log-format", "json", "run", TARGET, "--config", str(config_file)]
        args += ["--device-plugin-dir", str(kubelet.directory), "--registration", "kubelet"]
        args += ["--metrics-port", str(port), "--metrics-host", "127.0.0.1"]
        async with running(*args, cwd=tmp_path) as plugin:
            await kubelet.wait_for_allocatable("amd.com/u250", 2, timeout=30)
            await kubelet.wait_for_registrations("amd.com/u250-4", 1, timeout=30)
            assert kubelet.capacity("amd.com/u250-4") == 0  # declared, no board with it yet
            assert {d.id: d.numa_nodes for d in kubelet.devices("amd.com/u250").values()} == {
                "0000:3b:00.1": (0,),
                "0000:d8:00.1": (1,),
            }

            got = await kubelet.allocate("amd.com/u250", 1)
            [board] = got.device_ids
            [node] = got.allocation.device_nodes
            render = {"0000:3b:00.1": "renderD128", "0000:d8:00.1": "renderD129"}[board]
            assert (node.host_path, node.container_path) == (f"/dev/dri/{render}",) * 2
            assert got.allocation.env["FPGA_DEVICES"] == board

            # 200 once every plugin has heard back from its Register call, which the kubelet's
            # view can show a moment earlier.
            await kubelet.wait_for(lambda: healthz_ok(port), timeout=10, what="/healthz 200")
            metrics = await http_get(port, "/metrics")
            assert metrics.startswith(b"HTTP/1.1 200")
            assert b'resource="amd.com/u250"' in metrics

            # Hot reload: a new name for the shell, picked up from the edited file.
            config["rename"]["xilinx_u250_xdma_201830_2"] = "alveo-u250"
            edited = tmp_path / "edited.yaml"
            edited.write_text(yaml.safe_dump(config), encoding="utf-8")
            os.replace(edited, config_file)
            await kubelet.wait_for_allocatable("amd.com/alveo-u250", 2, timeout=15)
            await kubelet.wait_for_allocatable("amd.com/u250", 0, timeout=15)
            code = await plugin.stop()
        assert code == 0, plugin.error_output[-4000:]

    records = plugin.records()
    assert any(
        r.get("resource") == "amd.com/u250" and "registered" in r["message"] for r in records
    )
    assert any("reloaded" in r["message"] for r in records)


def run_to_the_end(config: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    config_file = tmp_path / "config.yaml"
    config_file.write_text(config, encoding="utf-8")
    proc = devplugin("run", TARGET, "--config", str(config_file), cwd=tmp_path)
    try:
        _, stderr = proc.communicate(timeout=30)
    finally:
        proc.kill()
        proc.communicate()
    return subprocess.CompletedProcess(proc.args, proc.returncode, "", stderr)


def test_devplugin_run_refuses_a_bad_config_in_one_line_naming_the_key(tmp_path: Path) -> None:
    # A file of the old style: snake_case keys.
    result = run_to_the_end("family: xrt\nsysfs_root: /host/sys\n", tmp_path)

    assert result.returncode == 2
    [line] = result.stderr.splitlines()
    assert "sysfs_root: unknown key; did you mean 'sysfsRoot'?" in line


def test_devplugin_run_refuses_a_host_with_nothing_to_serve(tmp_path: Path) -> None:
    """No board found and no resource declared under ``rename``: one line, exit 2."""
    host = FpgaHost(tmp_path / "host")
    config = f"family: dfl\nsysfsRoot: {host.sysfs_root}\ndevRoot: {host.dev_root}\n"

    result = run_to_the_end(config, tmp_path)

    assert result.returncode == 2
    [line] = result.stderr.splitlines()
    assert "no plugins" in line


# ----------------------------------------------------------------------------- in-process


async def test_offline_board_leaves_allocatable_and_comes_back(
    tmp_path: Path, example: ModuleType
) -> None:
    host, boards = alveo_u250_host(tmp_path)
    plugins = load(example, "config.yaml", host)

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


async def test_two_boards_for_one_pod_come_from_one_numa_node(
    tmp_path: Path, example: ModuleType
) -> None:
    host = FpgaHost(tmp_path)
    for slot, node in (("0000:3b:00", 0), ("0000:5e:00", 1), ("0000:86:00", 0), ("0000:d8:00", 1)):
        host.add_alveo(slot, numa_node=node)
    plugins = load(example, "config.yaml", host)

    async with FakeKubelet() as kubelet, serving(*plugins, settings=kubelet.settings()):
        await kubelet.wait_for_allocatable("amd.com/u250", 4)
        got = await kubelet.allocate("amd.com/u250", 2)
        chosen = {d: kubelet.devices("amd.com/u250")[d].numa_nodes for d in got.device_ids}

    assert got.preferred == got.device_ids
    assert len(set(chosen.values())) == 1, chosen


async def test_dfl_ports_are_served_per_afu_and_a_crashed_port_recovers(
    tmp_path: Path, example: ModuleType
) -> None:
    host, cards = dfl_pac_host(tmp_path)
    plugins = load(example, "config-dfl.yaml", host)
    assert [p.resource_name for p in plugins] == ["fpga.intel.com/nlb0", "fpga.intel.com/nlb3"]

    async with FakeKubelet() as kubelet, serving(*plugins, settings=kubelet.settings()):
        await kubelet.wait_for_allocatable("fpga.intel.com/nlb0", 1)
        await kubelet.wait_for_allocatable("fpga.intel.com/nlb3", 1)
        got = await kubelet.allocate("fpga.intel.com/nlb3", 1)
        assert got.device_ids == ("0000:af:00.0-port0",)
        assert [n.container_path for n in got.allocation.device_nodes] == ["/dev/dfl-port.1"]
        assert got.allocation.annotations == {}  # af mode: nothing for Intel's CRI hook

        cards[0].set_afu_id(0, ALL_F)
        await kubelet.wait_for_health("fpga.intel.com/nlb0", "0000:5e:00.0-port0", "Unhealthy")
        cards[0].set_afu_id(0, NLB0_AFU_ID)
        await kubelet.wait_for_allocatable("fpga.intel.com/nlb0", 1)


async def test_dfl_region_mode_serves_cards_by_interface_id(
    tmp_path: Path, example: ModuleType
) -> None:
    host, _ = dfl_pac_host(tmp_path)
    plugins = load(example, "config-dfl.yaml", host, mode="region", rename={})
    resource = f"fpga.intel.com/region-{DFL_INTERFACE_ID}"
    assert [p.resource_name for p in plugins] == [resource]

    async with FakeKubelet() as kubelet, serving(*plugins, settings=kubelet.settings()):
        await kubelet.wait_for_allocatable(resource, 2)
        got = await kubelet.allocate(resource, 1)

    assert got.allocation.annotations == {"com.intel.fpga.mode": "fpga.intel.com/region"}
    assert len(got.allocation.device_nodes) == 1
    assert got.allocation.env["FPGA_DEVICES"] == got.device_ids[0]


# ----------------------------------------------------------------------------- image and manifests


def dockerfile_instruction(name: str) -> str:
    """The arguments of the Dockerfile's one ``name`` instruction."""
    [line] = [
        line
        for line in (HERE / "Dockerfile").read_text("utf-8").splitlines()
        if line.startswith(f"{name} ")
    ]
    return line.removeprefix(f"{name} ")


def test_image_daemonset_and_overlay_run_the_same_thing() -> None:
    config_map, daemonset = yaml.safe_load_all((HERE / "daemonset.yaml").read_text("utf-8"))
    pod: dict[str, Any] = daemonset["spec"]["template"]["spec"]
    [container] = pod["containers"]
    entrypoint: list[str] = json.loads(dockerfile_instruction("ENTRYPOINT"))
    assert entrypoint == ["devplugin", "run", TARGET]
    # `plugin:` is /app/plugin.py, found through PYTHONPATH.
    assert "PYTHONPATH=/app " in dockerfile_instruction("ENV") + " "
    assert "COPY examples/fpga/plugin.py /app/plugin.py" in (HERE / "Dockerfile").read_text()

    # The image's CMD and the DaemonSet's args (which replace it) say the same to the CLI.
    cmd: list[str] = json.loads(dockerfile_instruction("CMD"))
    from_cmd = cli.build_parser().parse_args([*entrypoint[1:], *cmd])
    from_pod = cli.build_parser().parse_args([*entrypoint[1:], *container["args"]])
    assert (from_cmd.target, from_cmd.config, from_cmd.metrics_port) == (
        from_pod.target,
        from_pod.config,
        from_pod.metrics_port,
    )
    [port] = container["ports"]
    assert from_pod.metrics_port == port["containerPort"]
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": port["name"]}

    # The ConfigMap and the overlay's config are config.yaml (less its comments), mounted
    # where --config points.
    ours = yaml.safe_load((HERE / "config.yaml").read_text("utf-8"))
    assert yaml.safe_load(config_map["data"]["config.yaml"]) == ours
    assert yaml.safe_load((OVERLAY / "config.yaml").read_text("utf-8")) == ours
    [mount] = [m for m in container["volumeMounts"] if m["mountPath"] == "/etc/devplugin"]
    [volume] = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert volume["configMap"]["name"] == config_map["metadata"]["name"]
    assert Path(from_pod.config).parent == Path(mount["mountPath"])

    # The image the kustomize overlay deploys is this one.
    [image] = yaml.safe_load((OVERLAY / "kustomization.yaml").read_text("utf-8"))["images"]
    assert container["image"] == f"{image['newName']}:{image['newTag']}"
