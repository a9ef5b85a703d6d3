"""The kubelet's rules for a DRA driver's registration, checked before anything starts.

Newer kubelets refuse a registration whose GetInfo breaks them, and say so only in their own
log (kubernetes ``pkg/kubelet/cm/dra/plugin/dra_plugin_manager.go``, tested by
``TestRegisterPluginRejectsUntrustedInput``): the DRA endpoint must be an absolute, clean path
inside the kubelet's root directory that fits a unix socket address, and the driver name a DNS
subdomain of at most 63 characters. The driver checks both when it is built, so a wrong
``pluginDir`` is one line at start, not a driver that never registers.
"""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath

from devplugin_sdk import _names

__all__ = ["MAX_SOCKET_PATH_BYTES", "driver_problem", "endpoint_problem", "kubelet_root"]

#: sun_path holds 108 bytes with the terminating NUL: a path of at most 107 can be bound.
MAX_SOCKET_PATH_BYTES = 107


def kubelet_root(plugins_registry_dir: Path) -> Path:
    """The kubelet's root directory as the plugin-watcher directory implies it
    (``<root>/plugins_registry``, which follows the kubelet's ``--root-dir``)."""
    return plugins_registry_dir.parent


def endpoint_problem(endpoint: Path, root: Path) -> str | None:
    """Why the kubelet would refuse ``endpoint`` as a DRA socket under ``root``, or None."""
    text = str(endpoint)
    if not endpoint.is_absolute():
        return f"the DRA socket {text} is not an absolute path"
    if ".." in PurePosixPath(text).parts:
        return f"the DRA socket {text} contains '..', which the kubelet refuses"
    clean_root = os.path.normpath(root)
    if os.path.commonpath([os.path.normpath(text), clean_root]) != clean_root:
        return (
            f"the DRA socket {text} is outside the kubelet's root directory {clean_root}; "
            "newer kubelets refuse it (set dra.pluginDir under the root, or dra.kubeletRootDir "
            "to the kubelet's --root-dir)"
        )
    size = len(os.fsencode(text))
    if size > MAX_SOCKET_PATH_BYTES:
        return (
            f"the DRA socket {text} is {size} bytes long; a unix socket path holds at most "
            f"{MAX_SOCKET_PATH_BYTES}"
        )
    return None


def driver_problem(driver: str) -> str | None:
    """Why the kubelet would refuse ``driver`` as a DRA driver name, or None."""
    problem = _names.driver_name_problem(driver)
    return None if problem is None else f"invalid DRA driver name {driver!r}: {problem}"
