"""``devplugin dra deviceclass``: the DeviceClasses of the configured plugins, printed by the
real command (a subprocess), valid against the Kubernetes 1.37 schema (kubernetes-validate,
offline), and selecting what the driver publishes."""

from __future__ import annotations

import json
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from cli_process import ROOT, devplugin, error_line
from dra_helpers import DRIVER

from devplugin_sdk.dra._deviceclass import RESOURCE_ATTRIBUTE, device_classes
from devplugin_sdk.testing import DraNode, StaticPlugin
from devplugin_sdk.types import Device

NVIDIA = ROOT / "examples" / "nvidia"


def printed(*args: str, cwd: Path | None = None) -> list[dict[str, object]]:
    result = devplugin("dra", "deviceclass", *args, cwd=cwd)
    assert result.returncode == 0, result.stderr
    return list(yaml.safe_load_all(result.stdout))


def test_the_nvidia_example_class_validates_against_kubernetes_1_37() -> None:
    (plain,) = printed("plugin:SiteGpuPlugin", "--config", "config-dra.yaml", cwd=NVIDIA)
    (bridged,) = printed(
        "plugin:SiteGpuPlugin", "--config", "config-dra.yaml", "--extended-resource", cwd=NVIDIA
    )
    for document in (plain, bridged):
        assert kubernetes_validate.validate(document, "1.37.0", strict=True) == "1.37"
    assert bridged == {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": "gpu.devplugin.example.com"},
        "spec": {
            "selectors": [{"cel": {"expression": 'device.driver == "gpu.devplugin.example.com"'}}],
            "extendedResourceName": "nvidia.com/gpu",
        },
    }
    assert "extendedResourceName" not in plain["spec"]  # type: ignore[operator]


def test_the_schema_check_would_catch_a_wrong_class() -> None:
    (document,) = device_classes("gpu.example.com", ["nvidia.com/gpu"], extended=True)
    document["spec"]["extendedResourceName"] = 7
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(document, "1.37.0", strict=True)


def test_a_file_without_dra_is_one_line_and_exit_2(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(json.dumps({"backend": "cli_target:TwoWidgets"}))
    line = error_line(devplugin("dra", "deviceclass", "--config", str(config)))
    assert "api" in line
    assert "dra" in line


class Gizmos(StaticPlugin):
    pass


async def test_several_resources_get_a_class_each_selecting_their_own_devices() -> None:
    """With two resources in one pool, each device names its resource and each class asks for
    it: the value a class compares is the one its resource's devices carry."""
    classes = device_classes(DRIVER, ["acme.com/widget", "acme.com/gizmo"], extended=True)
    for document in classes:
        kubernetes_validate.validate(document, "1.37.0", strict=True)
    assert [c["metadata"]["name"] for c in classes] == [f"widget.{DRIVER}", f"gizmo.{DRIVER}"]
    plugins = (
        StaticPlugin("acme.com/widget", [Device("w0")]),
        Gizmos("acme.com/gizmo", [Device("g0")]),
    )
    async with DraNode(*plugins, driver=DRIVER) as node:
        published = {name: d.attributes[RESOURCE_ATTRIBUTE] for name, d in node.published().items()}
    assert published == {"w0": "acme.com/widget", "g0": "acme.com/gizmo"}
    for document, resource in zip(classes, ["acme.com/widget", "acme.com/gizmo"], strict=True):
        expression = document["spec"]["selectors"][0]["cel"]["expression"]
        assert f'.{RESOURCE_ATTRIBUTE} == "{resource}"' in expression
        assert f'device.driver == "{DRIVER}"' in expression


def test_the_rbac_grants_the_claim_status_writes_kubernetes_1_36_checks() -> None:
    """deploy/dra/rbac.yaml: resourceclaims/status, and the node-aware verbs on the synthetic
    resourceclaims/driver for the example's driver name only; Events for the Node; every
    object valid against the 1.37 schema."""
    documents = list(yaml.safe_load_all((ROOT / "deploy" / "dra" / "rbac.yaml").read_text()))
    for document in documents:
        if document["kind"] in ("ServiceAccount", "ClusterRole", "ClusterRoleBinding"):
            kubernetes_validate.validate(document, "1.37.0", strict=True)
    (role,) = [d for d in documents if d["kind"] == "ClusterRole"]
    rules = {tuple(r["resources"]): r for r in role["rules"]}
    driver = rules[("resourceclaims/driver",)]
    assert driver["verbs"] == ["associated-node:patch", "associated-node:update"]
    assert driver["resourceNames"] == ["gpu.devplugin.example.com"]
    assert "patch" in rules[("resourceclaims/status",)]["verbs"]
    assert rules[("events",)]["verbs"] == ["create"]
