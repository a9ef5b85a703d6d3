"""Helpers of the DRA tests: a driver's options pointing at a FakeKubelet's directories."""

from __future__ import annotations

from typing import Any

from devplugin_sdk.dra import Dra
from devplugin_sdk.testing import FakeKubelet, MemoryApi

DRIVER = "widget.acme.com"


def dra_options(kubelet: FakeKubelet, memory: MemoryApi, **overrides: Any) -> Dra:
    """A ``Dra`` for ``kubelet``'s node, with its sockets and CDI specs beside its directories."""
    root = kubelet.directory.parent
    values: dict[str, Any] = {
        "driver": DRIVER,
        "node_name": kubelet.node_name,
        "api": memory,
        "plugin_dir": root / "plugins" / DRIVER,
        "cdi_dir": root / "cdi",
    }
    values.update(overrides)
    return Dra(**values)
