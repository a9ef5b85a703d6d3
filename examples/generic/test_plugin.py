"""The generic example as the image runs it: `devplugin run generic --config FILE` as a real
process against a FakeKubelet, with config.yaml read on a fake /dev in tmp_path (its devRoot)
(registration, allocation, hot-plug, hot reload, /healthz, /metrics, JSON logs, a glob that
matches nothing, a bad config); finer behaviour in-process; and the image, the DaemonSet and the
kustomize overlay agreeing on what runs."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import pytest
import yaml
from plugin_process import PluginProcess, spawned

from devplugin_sdk import cli
from devplugin_sdk.backends.generic import from_config
from devplugin_sdk.config import load_yaml
from devplugin_sdk.testing import AdmissionError, FakeKubelet, serving
from devplugin_sdk.types import DeviceNode

HERE = Path(__file__).parent
OVERLAY = HERE.parent.parent / "deploy" / "kustomize" / "overlays" / "generic"
SERIAL = "devplugin.example.com/serial"
FUSE = "devplugin.example.com/fuse"
TUN = "devplugin.example.com/tun"
VIDEO = "devplugin.example.com/video"


def fake_dev(root: Path) -> Path:
    """A /dev under ``root`` with one USB serial adapter, /dev/fuse and /dev/net/tun (plain
    files: the backend only needs them to exist); returns ``root`` resolved."""
    (root / "dev" / "net").mkdir(parents=True)
    for name in ("ttyUSB0", "fuse", "net/tun"):
        (root / "dev" / name).touch()
    return root.resolve()


def config_yaml_on(root: Path) -> dict[str, Any]:
    """config.yaml as shipped, reading ``<root>/dev`` for /dev (``devRoot``)."""
    return {**load_yaml(HERE / "config.yaml"), "devRoot": str(root / "dev")}


def write_config(path: Path, config: dict[str, Any]) -> None:
    """Write then rename, as a ConfigMap update does: a reader never sees half a file."""
    staged = path.with_name(f".{path.name}.new")
    staged.write_text(yaml.safe_dump(config), encoding="utf-8")
    os.replace(staged, path)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


async def http_get(port: int, path: str) -> tuple[int, str]:
    """One HTTP/1.1 request to the plugin's endpoint server; returns (status, body)."""
    async with await anyio.connect_tcp("127.0.0.1", port) as stream:
        await stream.send(
            f"GET {path} HTTP/1.1\r\nHost: probe\r\nConnection: close\r\n\r\n".encode()
        )
        reply = b""
        with anyio.fail_after(5):
            async for chunk in stream:
                reply += chunk
    head, _, body = reply.decode().partition("\r\n\r\n")
    return int(head.split()[1]), body


def devplugin(*args: str, stderr: Any = subprocess.PIPE) -> subprocess.Popen[str]:
    """``devplugin ARGS`` as the image's entry point runs it, in a child process."""
    return subprocess.Popen(
        [sys.executable, "-m", "devplugin_sdk", *args],
        stdout=subprocess.DEVNULL,
        stderr=stderr,
        text=True,
    )


@asynccontextmanager
async def running(*args: str) -> AsyncIterator[PluginProcess]:
    """Run ``devplugin ARGS`` until the block ends; then SIGTERM and a clean exit (status 0)."""
    async with spawned([sys.executable, "-m", "devplugin_sdk", *args]) as plugin:
        yield plugin
        code = await plugin.stop()
        assert code == 0, f"exit status {code}; its log:\n{plugin.error_output}"


# ----------------------------------------------------------------------------- as the image runs it


async def test_devplugin_run_generic_serves_config_yaml_reloads_it_and_reports(
    tmp_path: Path,
) -> None:
    root = fake_dev(tmp_path / "host")
    config_file = tmp_path / "config.yaml"
    config = config_yaml_on(root)
    # The file may carry the SDK's own keys too; the backend never sees them.
    write_config(config_file, {**config, "logging": {"format": "json"}})
    port = free_port()

    async with FakeKubelet() as kubelet:
        args = ["run", "generic", "--config", str(config_file)]
        args += ["--device-plugin-dir", str(kubelet.directory), "--registration", "kubelet"]
        args += ["--metrics-port", str(port), "--metrics-host", "127.0.0.1"]
        async with running(*args) as plugin:
            # Registration and capacity: config.yaml's four resources.
            await kubelet.wait_for_allocatable(FUSE, 10, timeout=30)
            await kubelet.wait_for_allocatable(TUN, 10, timeout=30)
            await kubelet.wait_for_allocatable(SERIAL, 1, timeout=30)
            await kubelet.wait_for_registrations(VIDEO, 1, timeout=30)
            assert kubelet.capacity(VIDEO) == 0  # no camera: registered, nothing to allocate

            # An allocation: the matched file as a read-write device node, at its own path (the
            # host's: the plugin read it under devRoot).
            got = await kubelet.allocate(SERIAL, 1)
            assert got.device_ids == ("ttyUSB0",)
            assert got.allocation.device_nodes == (DeviceNode("/dev/ttyUSB0", "/dev/ttyUSB0"),)

            # Hot-plug: a board plugged in, an adapter pulled out.
            (root / "dev" / "ttyACM0").touch()
            await kubelet.wait_for(lambda: kubelet.capacity(SERIAL) == 2, what="ttyACM0 listed")
            (root / "dev" / "ttyUSB0").unlink()
            await kubelet.wait_for_health(SERIAL, "ttyUSB0", "Unhealthy")

            # /healthz and /metrics on --metrics-port.
            status, _ = await http_get(port, "/healthz")
            assert status == 200
            status, metrics = await http_get(port, "/metrics")
            assert status == 200
            assert f'devplugin_registered{{resource="{FUSE}"}} 1.0' in metrics

            # Hot reload: fuse shared 20 ways; the other resources keep their registration.
            config["resources"] = [
                {**r, "share": 20} if r["resourceName"] == FUSE else r for r in config["resources"]
            ]
            write_config(config_file, {**config, "logging": {"format": "json"}})
            await kubelet.wait_for_allocatable(FUSE, 20, timeout=15)
            assert len(kubelet.successful_registrations(TUN)) == 1

    records = plugin.records()  # every line is JSON: a JSON log has nothing else
    assert any(r.get("resource") == FUSE and "registered" in r["message"] for r in records)
    assert any("reloaded" in r["message"] for r in records)


async def test_a_glob_that_matches_nothing_is_a_warning_naming_it(tmp_path: Path) -> None:
    """What a user sees on stderr when a configured glob finds nothing (no camera, no ACM
    board): one warning per glob, naming it and where it was read, not only "0 devices"."""
    root = fake_dev(tmp_path / "host")
    config_file = tmp_path / "config.yaml"
    write_config(config_file, config_yaml_on(root))
    async with FakeKubelet() as kubelet:
        args = ["run", "generic", "--config", str(config_file)]
        args += ["--device-plugin-dir", str(kubelet.directory), "--registration", "kubelet"]
        async with running(*args) as plugin:
            await kubelet.wait_for_registrations(VIDEO, 1, timeout=30)
            await kubelet.wait_for_allocatable(SERIAL, 1, timeout=30)
    warnings = plugin.lines(" WARNING ")
    dev = root / "dev"
    # The resources discover side by side: in either order.
    assert sorted(line.split(": ", 1)[1] for line in warnings) == [
        f"{SERIAL}: /dev/ttyACM* matches nothing (read as {dev}/ttyACM*); "
        "no device from it until a match appears",
        f"{VIDEO}: /dev/video* matches nothing (read as {dev}/video*); "
        "no device from it until a match appears",
    ]


@pytest.mark.parametrize(
    ("change", "key"),
    [
        ({"share": 0}, "resources[1].share"),
        ({"paths": ["dev/fuse"]}, "resources[1].paths[0]"),
        ({"name": FUSE}, "resources[1].name"),
    ],
    ids=["share", "relative path", "old key"],
)
async def test_a_bad_config_exits_2_with_one_line_naming_the_key(
    tmp_path: Path, change: dict[str, Any], key: str
) -> None:
    config = load_yaml(HERE / "config.yaml")
    config["resources"][1].update(change)
    config_file = tmp_path / "config.yaml"
    write_config(config_file, dict(config))
    process = devplugin(
        "run", "generic", "--config", str(config_file), "--device-plugin-dir", str(tmp_path)
    )
    try:
        _, stderr = await anyio.to_thread.run_sync(lambda: process.communicate(timeout=30))
    finally:
        process.kill()
        process.communicate()
    assert process.returncode == 2
    [line] = stderr.splitlines()
    assert line.startswith(f"devplugin: error: {key}: "), line


# ----------------------------------------------------------------------------- in-process


async def test_the_shared_fuse_node_goes_to_ten_containers_and_not_to_an_eleventh(
    tmp_path: Path,
) -> None:
    root = fake_dev(tmp_path)
    plugins = from_config(config_yaml_on(root))

    async with FakeKubelet() as kubelet, serving(*plugins, settings=kubelet.settings()):
        await kubelet.wait_for_allocatable(FUSE, 10)
        got = [await kubelet.allocate(FUSE, 1) for _ in range(10)]
        with pytest.raises(AdmissionError):
            await kubelet.allocate(FUSE, 1)

    assert sorted(g.device_ids[0] for g in got) == sorted(f"fuse::{n}" for n in range(10))
    for container in got:
        assert container.allocation.device_nodes == (DeviceNode("/dev/fuse", "/dev/fuse", "rw"),)


async def test_a_pulled_adapter_comes_back_healthy_under_the_same_id(tmp_path: Path) -> None:
    root = fake_dev(tmp_path)
    plugins = from_config(config_yaml_on(root))

    async with FakeKubelet() as kubelet, serving(*plugins, settings=kubelet.settings()):
        await kubelet.wait_for_allocatable(SERIAL, 1)
        (root / "dev" / "ttyUSB0").unlink()
        await kubelet.wait_for_health(SERIAL, "ttyUSB0", "Unhealthy")
        (root / "dev" / "ttyACM0").touch()  # a rescan lists it; ttyUSB0 stays Unhealthy
        await kubelet.wait_for(lambda: kubelet.capacity(SERIAL) == 2, what="ttyACM0 listed")
        assert kubelet.devices(SERIAL)["ttyUSB0"].health == "Unhealthy"
        (root / "dev" / "ttyUSB0").touch()
        await kubelet.wait_for_allocatable(SERIAL, 2)


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
    assert entrypoint == ["devplugin", "run", "generic"]

    # The image's CMD and the DaemonSet's args (which replace it) say the same to the CLI.
    from_cmd = cli.build_parser().parse_args([*entrypoint[1:], *dockerfile_instruction("CMD")])
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

    # The ConfigMap is config.yaml (less its comments), mounted where --config points.
    assert yaml.safe_load(config_map["data"]["config.yaml"]) == load_yaml(HERE / "config.yaml")
    [mount] = [m for m in container["volumeMounts"] if m["mountPath"] == "/etc/devplugin"]
    [volume] = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert volume["configMap"]["name"] == config_map["metadata"]["name"]
    assert Path(from_pod.config).parent == Path(mount["mountPath"])

    # The image the kustomize overlay deploys is this one.
    [image] = yaml.safe_load((OVERLAY / "kustomization.yaml").read_text("utf-8"))["images"]
    assert container["image"] == f"{image['newName']}:{image['newTag']}"
