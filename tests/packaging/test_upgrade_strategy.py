"""Every shipped DaemonSet rolls the way its pod allows: beside the old pod (``maxSurge: 1``,
``maxUnavailable: 0``) with the pod's UID in ``POD_UID``, or, on the node's network (whose HTTP
port a second pod could not bind), old pod out first."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from sdk_helpers import ROOT

DAEMONSETS = sorted(
    [ROOT / "deploy/kustomize/base/daemonset.yaml", *ROOT.glob("examples/*/daemonset*.yaml")]
)


def _daemonset(path: Path) -> dict[str, Any]:
    (doc,) = [
        d
        for d in yaml.safe_load_all(path.read_text(encoding="utf-8"))
        if d and d["kind"] == "DaemonSet"
    ]
    return doc


@pytest.mark.parametrize("path", DAEMONSETS, ids=lambda p: str(p.relative_to(ROOT)))
def test_daemonset_surges_with_the_pod_uid_unless_on_the_node_network(path: Path) -> None:
    spec = _daemonset(path)["spec"]
    pod = spec["template"]["spec"]
    (container,) = pod["containers"]
    env = {e["name"]: e for e in container.get("env", [])}
    assert env["POD_UID"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.uid"}}
    assert not any("hostPort" in p for p in container.get("ports", []))
    rolling = spec["updateStrategy"]["rollingUpdate"]
    if pod.get("hostNetwork"):
        assert (rolling["maxSurge"], rolling["maxUnavailable"]) == (0, 1)
    else:
        assert (rolling["maxSurge"], rolling["maxUnavailable"]) == (1, 0)


def test_the_rdma_overlay_keeps_the_old_pod_out_first() -> None:
    patch = yaml.safe_load(
        (ROOT / "deploy/kustomize/overlays/rdma/daemonset-patch.yaml").read_text(encoding="utf-8")
    )
    assert patch["spec"]["template"]["spec"]["hostNetwork"] is True
    assert patch["spec"]["updateStrategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}
