"""The generic plugin of config.yaml against FakeKubelet, re-rooted onto a fake /dev in tmp_path;
and the image, the DaemonSet and the kustomize overlay agreeing on what runs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from devplugin_sdk import cli
from devplugin_sdk.backends.generic import from_config
from devplugin_sdk.config import load_yaml
from devplugin_sdk.plugin import DevicePlugin
from devplugin_sdk.testing import AdmissionError, FakeKubelet, serving

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


def plugins_of_config_yaml(root: Path) -> list[DevicePlugin]:
    """The plugins `devplugin run generic --config config.yaml` serves, its paths under ``root``."""
    config = load_yaml(HERE / "config.yaml")
    for resource in config["resources"]:
        resource["paths"] = [f"{root}{path}" for path in resource["paths"]]
    return from_config(config)


async def test_the_shared_fuse_node_goes_to_ten_containers_and_not_to_an_eleventh(
    tmp_path: Path,
) -> None:
    root = fake_dev(tmp_path)
    plugins = plugins_of_config_yaml(root)

    async with FakeKubelet() as kubelet, serving(*plugins, settings=kubelet.settings()):
        await kubelet.wait_for_allocatable(FUSE, 10)
        got = [await kubelet.allocate(FUSE, 1) for _ in range(10)]
        with pytest.raises(AdmissionError):
            await kubelet.allocate(FUSE, 1)

    assert sorted(g.device_ids[0] for g in got) == sorted(f"fuse::{n}" for n in range(10))
    for container in got:
        [node] = container.allocation.device_nodes
        # The real file as the host path, the configured path in the container.
        assert (node.host_path, node.container_path, node.permissions) == (
            str(root / "dev" / "fuse"),
            str(root / "dev" / "fuse"),
            "rw",
        )


async def test_serial_adapters_come_and_go_while_tun_and_video_keep_their_counts(
    tmp_path: Path,
) -> None:
    root = fake_dev(tmp_path)
    plugins = plugins_of_config_yaml(root)

    async with FakeKubelet() as kubelet, serving(*plugins, settings=kubelet.settings()):
        await kubelet.wait_for_allocatable(SERIAL, 1)
        await kubelet.wait_for_allocatable(TUN, 10)
        await kubelet.wait_for_registrations(VIDEO, 1)
        assert kubelet.capacity(VIDEO) == 0  # no camera: registered, nothing to allocate

        (root / "dev" / "ttyACM0").touch()  # a board plugged in
        await kubelet.wait_for_allocatable(SERIAL, 2)
        (root / "dev" / "ttyUSB0").unlink()  # an adapter pulled out
        await kubelet.wait_for_health(SERIAL, "ttyUSB0", "Unhealthy")
        got = await kubelet.allocate(SERIAL, 1)

    assert got.device_ids == ("ttyACM0",)
    assert [n.container_path for n in got.allocation.device_nodes] == [f"{root}/dev/ttyACM0"]


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
