"""Deployment manifests: every YAML parses, and every DaemonSet has what a device plugin needs.

The kustomize overlays under deploy/kustomize are rendered with ``kubectl kustomize`` (kustomize
is built into kubectl) when kubectl is on PATH; the base and the examples' own DaemonSets are
checked as plain YAML always.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import shutil
import subprocess
from collections.abc import Iterator, Mapping
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml
from sdk_helpers import ROOT, load_example

from devplugin_sdk import backends
from devplugin_sdk.cli.runfile import parse_run_config
from devplugin_sdk.config import load_yaml

KUSTOMIZE = ROOT / "deploy" / "kustomize"
OVERLAYS = sorted(p.name for p in (KUSTOMIZE / "overlays").iterdir() if p.is_dir())
EXAMPLES = sorted(p.parent.name for p in ROOT.glob("examples/*/daemonset.yaml"))
DEVICE_PLUGIN_DIR = "/var/lib/kubelet/device-plugins"

# Examples whose own daemonset.yaml has no httpGet liveness probe on /healthz yet: they need
# `--metrics-port` in plugin.py first (see docs/metrics.md). Strict: fixing one fails this list.
EXAMPLES_WITHOUT_HEALTHZ: set[str] = set()

Doc = dict[str, Any]


def yaml_files() -> list[Path]:
    files = sorted((ROOT / "deploy").rglob("*.yaml")) + sorted(
        ROOT.glob("examples/*/daemonset.yaml")
    )
    return [f for f in files if f.is_file()]


def load_all(path: Path) -> list[Doc]:
    return [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d is not None]


@cache
def render(overlay: str) -> tuple[Doc, ...]:
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
    return tuple(d for d in yaml.safe_load_all(out) if d is not None)


def one(docs: tuple[Doc, ...] | list[Doc], kind: str) -> Doc:
    (found,) = [d for d in docs if d["kind"] == kind]
    return found


def plugin_container(daemonset: Doc) -> Doc:
    (container,) = daemonset["spec"]["template"]["spec"]["containers"]
    return container  # type: ignore[no-any-return]


def volumes(daemonset: Doc) -> dict[str, Doc]:
    return {v["name"]: v for v in daemonset["spec"]["template"]["spec"].get("volumes", [])}


def mounts(container: Doc) -> dict[str, Doc]:
    return {m["mountPath"]: m for m in container.get("volumeMounts", [])}


def check_device_plugin_dir(daemonset: Doc) -> None:
    mount = mounts(plugin_container(daemonset)).get(DEVICE_PLUGIN_DIR)
    assert mount is not None, f"nothing mounted at {DEVICE_PLUGIN_DIR}"
    assert not mount.get("readOnly", False), "the plugin creates its socket there"
    volume = volumes(daemonset)[mount["name"]]
    # A directory mount: the kubelet deletes and recreates sockets in it; inotify watches it.
    assert volume["hostPath"] == {"path": DEVICE_PLUGIN_DIR, "type": "Directory"}


def http_probe_ports(container: Doc) -> Iterator[tuple[str, Doc]]:
    for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
        probe = container.get(kind)
        if probe is not None and "httpGet" in probe:
            yield kind, probe["httpGet"]


def check_probes_and_port(daemonset: Doc) -> int:
    """Liveness on /healthz through the port the plugin is told to serve; returns the port."""
    container = plugin_container(daemonset)
    liveness = container.get("livenessProbe", {}).get("httpGet")
    assert liveness is not None, "no httpGet liveness probe"
    assert liveness["path"] == "/healthz"
    ports = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
    flags = [a for a in container.get("args", []) if a.startswith("--metrics-port=")]
    assert len(flags) == 1, f"one --metrics-port=N in args, got {container.get('args')}"
    port = int(flags[0].split("=", 1)[1])
    for kind, get in http_probe_ports(container):
        assert get["path"] == "/healthz", kind
        assert ports.get(get["port"], get["port"]) == port, f"{kind} probes another port"
    annotations = daemonset["spec"]["template"]["metadata"].get("annotations", {})
    if "prometheus.io/port" in annotations:
        assert annotations["prometheus.io/port"] == str(port)
    # Tolerates a kubelet restart: at least 30 s of failures before the container is killed.
    live = container["livenessProbe"]
    assert live.get("periodSeconds", 10) * live.get("failureThreshold", 3) >= 30
    return port


def check_pod_settings(daemonset: Doc) -> None:
    spec = daemonset["spec"]["template"]["spec"]
    assert spec["priorityClassName"] == "system-node-critical"
    assert spec.get("tolerations"), "GPU/FPGA nodes are usually tainted"
    container = plugin_container(daemonset)
    requests = container["resources"]["requests"]
    assert {"cpu", "memory"} <= set(requests)
    assert "memory" in container["resources"]["limits"]
    security = container["securityContext"]
    assert security["allowPrivilegeEscalation"] is False
    assert security.get("privileged", False) is False
    assert security["readOnlyRootFilesystem"] is True
    assert security["capabilities"]["drop"] == ["ALL"]
    selector = daemonset["spec"]["selector"]["matchLabels"]
    labels = daemonset["spec"]["template"]["metadata"]["labels"]
    assert selector.items() <= labels.items()
    names = volumes(daemonset)
    for mount in container.get("volumeMounts", []):
        assert mount["name"] in names, f"mount of an undeclared volume {mount['name']}"


# ----------------------------------------------------------------------------- every file


@pytest.mark.parametrize("path", yaml_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_manifest_is_valid_yaml(path: Path) -> None:
    docs = load_all(path)
    assert docs, "empty"
    for doc in docs:
        assert isinstance(doc, (dict, list)), f"a document of {type(doc).__name__}"


def test_every_example_has_an_overlay_and_generic_too() -> None:
    assert set(EXAMPLES) | {"generic"} <= set(OVERLAYS)


# ----------------------------------------------------------------------------- the base, as YAML


def test_base_daemonset_has_the_device_plugin_essentials() -> None:
    (daemonset,) = load_all(KUSTOMIZE / "base" / "daemonset.yaml")
    check_device_plugin_dir(daemonset)
    check_probes_and_port(daemonset)
    check_pod_settings(daemonset)


# ----------------------------------------------------------------------------- rendered overlays


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_a_complete_device_plugin_daemonset(overlay: str) -> None:
    docs = render(overlay)
    daemonset = one(docs, "DaemonSet")
    assert daemonset["metadata"]["namespace"] == "kube-system"
    assert daemonset["metadata"]["name"] == f"{overlay}-device-plugin"
    check_device_plugin_dir(daemonset)
    check_probes_and_port(daemonset)
    check_pod_settings(daemonset)
    assert plugin_container(daemonset)["image"].startswith("registry.example.com/")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_config_is_mounted_where_the_plugin_reads_it_and_is_valid(
    overlay: str, tmp_path: Path
) -> None:
    docs = render(overlay)
    daemonset = one(docs, "DaemonSet")
    container = plugin_container(daemonset)
    (flag,) = [a for a in container["args"] if a.startswith("--config=")]
    path = Path(flag.split("=", 1)[1])
    mount = mounts(container)[str(path.parent)]
    config_map_name = volumes(daemonset)[mount["name"]]["configMap"]["name"]
    (config_map,) = [
        d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == config_map_name
    ]
    text = config_map["data"][path.name]
    config_file = tmp_path / "config.yaml"
    config_file.write_text(text, encoding="utf-8")
    # What the image would do with it: the example's loader, or the built-in backend's.
    plugins = load_with_entry_point(overlay, config_file)
    assert plugins, f"{overlay}: the config yields no plugin"


def image_target(example: str) -> str | None:
    """TARGET of an example image whose ENTRYPOINT is ``devplugin run TARGET``, else None."""
    dockerfile = ROOT / "examples" / example / "Dockerfile"
    if not dockerfile.exists():
        return None
    for line in dockerfile.read_text(encoding="utf-8").splitlines():
        if line.startswith("ENTRYPOINT "):
            words = json.loads(line.removeprefix("ENTRYPOINT "))
            if words[:2] == ["devplugin", "run"] and len(words) == 3:
                return str(words[2])
    return None


def load_with_entry_point(overlay: str, config_file: Path) -> list[Any]:
    if (ROOT / "examples" / overlay / "plugin.py").exists():
        module = load_example(overlay)
        # What the image does: `devplugin run plugin:CLASS --config FILE`, i.e.
        # CLASS.from_config(the file less the SDK's keys).
        target = image_target(overlay)
        assert target is not None, f"examples/{overlay}: the image must run devplugin run"
        module_name, _, attr = target.partition(":")
        assert module_name == "plugin", target
        options = parse_run_config(load_yaml(config_file)).backend_options
        return list(getattr(module, attr).from_config(options))
    backend = importlib.import_module(backends.BUILTIN[overlay])
    return list(backend.from_config(yaml.safe_load(config_file.read_text(encoding="utf-8"))))


def test_overlays_can_run_side_by_side() -> None:
    """Distinct names and selectors in one namespace; distinct ports where on the host network."""
    daemonsets = [one(render(o), "DaemonSet") for o in OVERLAYS]
    names = [d["metadata"]["name"] for d in daemonsets]
    selectors = [tuple(sorted(d["spec"]["selector"]["matchLabels"].items())) for d in daemonsets]
    assert len(set(names)) == len(names)
    assert len(set(selectors)) == len(selectors)
    host_ports = [
        check_probes_and_port(d)
        for d in daemonsets
        if d["spec"]["template"]["spec"].get("hostNetwork")
    ]
    base = one(load_all(KUSTOMIZE / "base" / "daemonset.yaml"), "DaemonSet")
    assert check_probes_and_port(base) not in host_ports
    assert len(set(host_ports)) == len(host_ports)


def test_pod_monitor_selects_every_overlays_pods() -> None:
    docs = load_all(KUSTOMIZE / "monitoring" / "podmonitor.yaml")
    monitor = one(docs, "PodMonitor")
    wanted: Mapping[str, str] = monitor["spec"]["selector"]["matchLabels"]
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    for overlay in OVERLAYS:
        daemonset = one(render(overlay), "DaemonSet")
        assert wanted.items() <= daemonset["spec"]["template"]["metadata"]["labels"].items()
        ports = {p["name"] for p in plugin_container(daemonset)["ports"]}
        assert endpoint["port"] in ports


def test_plugins_registry_component_adds_the_watcher_directory(tmp_path: Path) -> None:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl (with built-in kustomize) is not installed")
    overlay = tmp_path / "overlay"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                # kustomize takes relative paths only.
                "resources": [os.path.relpath(KUSTOMIZE / "overlays" / "fpga", overlay)],
                "components": [
                    os.path.relpath(KUSTOMIZE / "components" / "plugins-registry", overlay)
                ],
            }
        ),
        encoding="utf-8",
    )
    out = subprocess.run(
        ["kubectl", "kustomize", "--load-restrictor=LoadRestrictionsNone", str(overlay)],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    daemonset = one([d for d in yaml.safe_load_all(out) if d], "DaemonSet")
    mount = mounts(plugin_container(daemonset))["/var/lib/kubelet/plugins_registry"]
    assert volumes(daemonset)[mount["name"]]["hostPath"]["path"] == (
        "/var/lib/kubelet/plugins_registry"
    )
    check_device_plugin_dir(daemonset)


# ----------------------------------------------------------------------------- examples' own


@pytest.mark.parametrize("example", EXAMPLES)
def test_example_daemonset_mounts_the_device_plugin_dir_with_requests(example: str) -> None:
    daemonset = one(load_all(ROOT / "examples" / example / "daemonset.yaml"), "DaemonSet")
    check_device_plugin_dir(daemonset)
    check_pod_settings(daemonset)


@pytest.mark.parametrize(
    "example",
    [
        pytest.param(
            e,
            marks=pytest.mark.xfail(
                reason="no /healthz liveness probe yet: plugin.py needs --metrics-port", strict=True
            ),
        )
        if e in EXAMPLES_WITHOUT_HEALTHZ
        else e
        for e in EXAMPLES
    ],
)
def test_example_daemonset_probes_healthz(example: str) -> None:
    daemonset = one(load_all(ROOT / "examples" / example / "daemonset.yaml"), "DaemonSet")
    check_probes_and_port(daemonset)
