"""Per-node configuration chosen by a node label, as NVIDIA's plugin does with
``nvidia.com/device-plugin.config``: ``devplugin run --config DIR/default.yaml
--node-config-label LABEL`` runs with ``DIR/<value>.yaml`` (or ``DIR/<value>``) on a node whose
label LABEL has that value, and with the ``--config`` file on a node without the label.

The label is read from the Node object through the API server (the ``dra`` extra's lightkube):
the downward API gives a pod its own labels, never its node's. It is read once, at start; a
relabelled node takes its new configuration when its pod restarts.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from devplugin_sdk import _files, _names
from devplugin_sdk.errors import ConfigError, KubeApiError, MissingDependencyError

__all__ = ["choose", "node_config", "read_node_labels"]

_OPTION = "--node-config-label"
_TIMEOUT = 10.0  # seconds for the one GET of the Node


def choose(default: Path, label: str, labels: Mapping[str, str], node: str) -> tuple[Path, str]:
    """The configuration file for a node with ``labels``, and why it was chosen.

    Raises:
        ConfigError: the label's value is not a valid label value (it could name a path
            outside ``default``'s directory), or names no file beside ``default``.
    """
    value = labels.get(label, "")
    if not value:
        return default, f"node {node} has no {label} label: {default}"
    # A valid label value is [A-Za-z0-9._-], starting and ending alphanumeric, so never a path;
    # but the labels come from an API server (or a proxy) that may not have validated them.
    problem = _names.label_value_problem(value)
    candidates: list[Path] = []
    if problem is None:
        try:  # the one way a name from outside becomes a path
            candidates = [_files.inside(default.parent, n) for n in (f"{value}.yaml", value)]
        except ValueError:
            problem = "a path"
    if problem is not None:
        raise ConfigError(
            _OPTION,
            f"node {node} has {label}={_shown(value)}, which is not a label value "
            f"({problem}): it cannot name a file in {default.parent}",
        )
    for candidate in candidates:
        if candidate.is_file():
            return candidate, f"node {node} has {label}={value}: {candidate}"
    present = sorted(p.name for p in default.parent.iterdir() if not p.name.startswith("."))
    raise ConfigError(
        _OPTION,
        f"node {node} has {label}={value}, but neither {value}.yaml nor {value} is in "
        f"{default.parent} (there: {', '.join(present) or 'nothing'})",
    )


def _shown(value: str) -> str:
    """The value quoted, cut to 80 characters, control characters escaped (``repr``)."""
    return repr(value[:80]) + ("..." if len(value) > 80 else "")


def read_node_labels(node: str, kubeconfig: Path | None = None) -> dict[str, str]:
    """The labels of the Node ``node``: one GET through the pod's service account (or
    ``kubeconfig``). Blocking.

    Raises:
        MissingDependencyError: lightkube is not installed (the ``dra`` extra).
        KubeApiError: the API server refused or could not be reached.
        ConfigError: the Kubernetes configuration cannot be loaded.
    """
    try:
        import httpx2  # noqa: PLC0415 - the dra extra, only with --node-config-label
        from lightkube import Client, KubeConfig  # noqa: PLC0415
        from lightkube.core.exceptions import ApiError  # noqa: PLC0415
        from lightkube.resources.core_v1 import Node  # noqa: PLC0415
    except ImportError:
        raise MissingDependencyError(
            f"{_OPTION} reads the node's labels through the Kubernetes API: "
            "pip install 'devplugin-sdk[dra]'"
        ) from None
    try:
        config = (
            KubeConfig.from_file(kubeconfig)
            if kubeconfig is not None
            else KubeConfig.from_service_account()
        )
    except Exception as exc:  # lightkube raises several kinds for one cause
        where = kubeconfig or "the in-cluster service account"
        raise ConfigError(
            _OPTION, f"cannot load the Kubernetes configuration from {where}: {exc}"
        ) from None
    try:
        with Client(config=config, timeout=httpx2.Timeout(_TIMEOUT)) as client:
            obj = client.get(Node, node)
    except ApiError as exc:
        code = exc.status.code if exc.status is not None else 0
        message = exc.status.message if exc.status is not None else str(exc)
        hint = " (the service account needs get on nodes)" if code == 403 else ""
        raise KubeApiError(int(code or 0), f"reading node {node}: {message}{hint}") from None
    except httpx2.HTTPError as exc:
        raise KubeApiError(0, f"reading node {node}: {type(exc).__name__}: {exc}") from None
    return dict((obj.metadata.labels if obj.metadata is not None else None) or {})


def node_config(
    default: Path, label: str, environ: Mapping[str, str] = os.environ
) -> tuple[Path, str]:
    """The configuration file of the node in ``$NODE_NAME`` (see ``choose``); ``$KUBECONFIG``
    names the cluster outside a pod.

    Raises:
        ConfigError: no ``$NODE_NAME``, or a label that names no file.
        MissingDependencyError, KubeApiError: as ``read_node_labels``.
    """
    node = environ.get("NODE_NAME", "")
    if not node:
        raise ConfigError(
            _OPTION,
            "needs the node's name in $NODE_NAME (the downward API: fieldRef spec.nodeName)",
        )
    kubeconfig = environ.get("KUBECONFIG") or None
    labels = read_node_labels(node, Path(kubeconfig) if kubeconfig else None)
    return choose(default, label, labels, node)
