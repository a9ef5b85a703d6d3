"""The NVIDIA example as a DRA driver: config-dra.yaml (api: dra), its DaemonSet and RBAC, and
the example's plugin class serving claims on a fake NVML machine against FakeKubelet's DRA side."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType
from typing import Any

import yaml

from devplugin_sdk.cli.runfile import parse_run_config
from devplugin_sdk.config import load_yaml
from devplugin_sdk.dra import device_name
from devplugin_sdk.testing import DraNode, fake_nvml

HERE = Path(__file__).parent
ROOT = HERE.parent.parent


def test_the_dra_config_selects_dra_and_the_manifests_wire_it() -> None:
    config = parse_run_config(load_yaml(HERE / "config-dra.yaml"))
    assert config.api == "dra"
    assert config.dra is not None
    assert config.dra.driver == "gpu.devplugin.example.com"
    config_map, daemonset = yaml.safe_load_all((HERE / "daemonset-dra.yaml").read_text())
    shipped = yaml.safe_load(config_map["data"]["config.yaml"])
    assert shipped == yaml.safe_load((HERE / "config-dra.yaml").read_text())
    pod = daemonset["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    (node_name,) = [e for e in container["env"] if e["name"] == "NODE_NAME"]
    assert node_name["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert {
        "/var/lib/kubelet/plugins_registry",
        "/var/lib/kubelet/plugins",
        "/var/run/cdi",
    } <= mounts
    rbac = list(yaml.safe_load_all((ROOT / "deploy" / "dra" / "rbac.yaml").read_text()))
    (account,) = [d for d in rbac if d["kind"] == "ServiceAccount"]
    assert pod["serviceAccountName"] == account["metadata"]["name"]
    (role,) = [d for d in rbac if d["kind"] == "ClusterRole"]
    verbs = {(r["resources"][0], v) for r in role["rules"] for v in r["verbs"]}
    assert ("resourceclaims", "get") in verbs
    assert {("resourceslices", v) for v in ("list", "watch", "create", "update", "delete")} <= verbs
    assert not {v for r, v in verbs if r == "resourceclaims"} - {"get"}  # read-only claims
    (policy,) = [d for d in rbac if d["kind"] == "ValidatingAdmissionPolicy"]
    assert "authentication.kubernetes.io/node-name" in json.dumps(policy)


async def test_the_example_serves_claims_through_dra(tmp_path: Path, example: ModuleType) -> None:
    config = parse_run_config(load_yaml(HERE / "config-dra.yaml"))
    assert config.dra is not None
    nvml = fake_nvml.dgx_a100()
    roots = nvml.write_host(tmp_path / "host")
    options: dict[str, Any] = {**config.backend_options, **roots.config()}
    with nvml.installed():
        plugins = example.SiteGpuPlugin.from_config(options)
    driver = config.dra.driver
    async with DraNode(
        *plugins,
        driver=driver,
        kubelet_options={"node_name": "gpu-node"},
        device_plugin_api=config.api == "both",
    ) as node:
        devices = list(node.published().values())
        assert len(devices) == 8
        assert {d.attributes["architecture"] for d in devices} == {"Ampere"}
        pod = node.pod("gpu", name="job", namespace="ml")
        gpu = device_name(nvml.gpus[3].uuid)
        claim = node.claim("gpu", {"one": [gpu]}, pods=[pod], namespace="ml")
        prepared = await node.prepare(pod)
        assert prepared.cdi_ids("gpu") == [f"k8s.{driver}/claim={claim.uid}-one"]
        env = node.spec(claim).devices[0]["containerEdits"]["env"]
        # The example's own allocate() runs: the site variable and the GPU list.
        assert "CUDA_DEVICE_ORDER=PCI_BUS_ID" in env
        assert f"NVIDIA_VISIBLE_DEVICES={nvml.gpus[3].uuid}" in env
        await node.unprepare(pod)
