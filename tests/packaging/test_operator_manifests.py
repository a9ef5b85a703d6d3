"""What an operator applies (issue 27, item 6): every DaemonSet finds its nodes without Node
Feature Discovery, waits for the whole shutdown before SIGKILL, and no example takes a vendor's
DRA driver name.

Checked on the examples' own manifests and the kustomize base and patches as plain YAML, and on
the rendered overlays when kubectl is installed.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from sdk_helpers import ROOT

from devplugin_sdk.settings import Settings

KUSTOMIZE = ROOT / "deploy" / "kustomize"
MANIFESTS = [*sorted(ROOT.glob("examples/*/daemonset*.yaml")), KUSTOMIZE / "base/daemonset.yaml"]
PATCHES = sorted(KUSTOMIZE.glob("overlays/*/daemonset-patch.yaml"))
OVERLAYS = sorted(p.name for p in (KUSTOMIZE / "overlays").iterdir() if p.is_dir())
NFD = "feature.node.kubernetes.io/"

Doc = dict[str, Any]


def _docs(path: Path) -> list[Doc]:
    return [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d is not None]


def _daemonsets(path: Path) -> list[Doc]:
    return [d for d in _docs(path) if d.get("kind") == "DaemonSet"]


def _rendered(overlay: str) -> list[Doc]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl (with built-in kustomize) is not installed")
    out = subprocess.run(
        [kubectl, "kustomize", str(KUSTOMIZE / "overlays" / overlay)],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    return [d for d in yaml.safe_load_all(out) if d is not None and d["kind"] == "DaemonSet"]


def _nfd_only(pod: Doc) -> str | None:
    """Why ``pod`` lands on no node of a cluster without NFD, or None when it does."""
    for key in pod.get("nodeSelector") or {}:
        if key.startswith(NFD):
            return f"nodeSelector needs the NFD label {key}"
    required = (
        (pod.get("affinity") or {})
        .get("nodeAffinity", {})
        .get("requiredDuringSchedulingIgnoredDuringExecution")
    )
    if required is None:
        return None
    terms = required["nodeSelectorTerms"]  # ORed: one term without NFD is enough
    if all(any(e["key"].startswith(NFD) for e in t["matchExpressions"]) for t in terms):
        return "every nodeAffinity term needs an NFD label"
    return None


def _check_nodes(pod: Doc, where: str) -> None:
    problem = _nfd_only(pod)
    assert problem is None, f"{where}: {problem}"


@pytest.mark.parametrize("path", MANIFESTS + PATCHES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_daemonset_finds_its_nodes_without_node_feature_discovery(path: Path) -> None:
    for daemonset in _daemonsets(path):
        _check_nodes(daemonset["spec"]["template"]["spec"], str(path.relative_to(ROOT)))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_rendered_overlay_finds_its_nodes_without_nfd(overlay: str) -> None:
    for daemonset in _rendered(overlay):
        _check_nodes(daemonset["spec"]["template"]["spec"], f"overlay {overlay}")


def _shutdown_budget() -> int:
    """Seconds a SIGTERM may take: the servers' grace, then each plugin's ``on_stop`` (the
    plugins stop side by side), and 2 s for the interpreter to exit."""
    settings = Settings()
    return math.ceil(settings.stop_grace + settings.stop_timeout) + 2


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_daemonset_waits_for_the_whole_shutdown(path: Path) -> None:
    """The kubelet SIGKILLs after terminationGracePeriodSeconds: set explicitly, it covers
    ``Settings.stop_grace`` plus ``Settings.stop_timeout``."""
    for daemonset in _daemonsets(path):
        grace = daemonset["spec"]["template"]["spec"].get("terminationGracePeriodSeconds")
        assert grace is not None, f"{path.relative_to(ROOT)}: terminationGracePeriodSeconds unset"
        assert grace >= _shutdown_budget(), (path.relative_to(ROOT), grace, _shutdown_budget())


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_rendered_overlay_waits_for_the_whole_shutdown(overlay: str) -> None:
    for daemonset in _rendered(overlay):
        grace = daemonset["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert grace >= _shutdown_budget(), (overlay, grace)


def _driver_names(node: Any) -> list[str]:
    """Every ``dra.driver`` in a document, ConfigMaps' embedded YAML files included."""
    found: list[str] = []
    if isinstance(node, dict):
        dra = node.get("dra")
        if isinstance(dra, dict) and isinstance(dra.get("driver"), str):
            found.append(dra["driver"])
        for key, value in node.items():
            if isinstance(value, str) and str(key).endswith((".yaml", ".yml")):
                found += [n for d in yaml.safe_load_all(value) for n in _driver_names(d)]
            else:
                found += _driver_names(value)
    elif isinstance(node, list):
        for item in node:
            found += _driver_names(item)
    return found


def test_no_example_takes_a_vendors_dra_driver_name() -> None:
    """Two drivers of one name fight over the same ResourceSlices: NVIDIA's own DRA driver is
    gpu.nvidia.com, so an example that a user deploys beside it must not use that name."""
    files = sorted(ROOT.glob("examples/**/*.yaml")) + sorted((ROOT / "deploy").rglob("*.yaml"))
    names = {
        str(path.relative_to(ROOT)): name
        for path in files
        for doc in _docs(path)
        for name in _driver_names(doc)
    }
    assert names, "no DRA driver name found in the examples"
    for where, name in names.items():
        assert name.endswith(".example.com"), f"{where}: DRA driver {name}"


def test_the_node_config_component_lets_the_plugin_read_its_node(tmp_path: Path) -> None:
    """components/node-config: NODE_NAME, the label's variable, and a service account that may
    get Nodes and nothing else, all renamed with the overlay's prefix."""
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl (with built-in kustomize) is not installed")
    (tmp_path / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "namespace": "kube-system",
                "namePrefix": "generic-",
                "resources": [os.path.relpath(KUSTOMIZE / "base", tmp_path)],
                "components": [os.path.relpath(KUSTOMIZE / "components/node-config", tmp_path)],
            }
        ),
        encoding="utf-8",
    )
    out = subprocess.run(
        ["kubectl", "kustomize", "--load-restrictor=LoadRestrictionsNone", str(tmp_path)],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    docs = {d["kind"]: d for d in yaml.safe_load_all(out) if d}
    pod = docs["DaemonSet"]["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is True
    account = docs["ServiceAccount"]["metadata"]
    assert pod["serviceAccountName"] == account["name"] == "generic-device-plugin"
    (container,) = pod["containers"]
    env = {e["name"]: e for e in container["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert env["DEVPLUGIN_NODE_CONFIG_LABEL"]["value"] == (
        "devplugin.example.com/device-plugin.config"
    )
    assert any(a.startswith("--config=") for a in container["args"])
    (rule,) = docs["ClusterRole"]["rules"]
    assert (rule["resources"], rule["verbs"]) == (["nodes"], ["get"])
    binding = docs["ClusterRoleBinding"]
    assert binding["roleRef"]["name"] == docs["ClusterRole"]["metadata"]["name"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account["name"], "namespace": account["namespace"]}
    ]
