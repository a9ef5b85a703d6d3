"""FakeKubelet: the kubelet's side of the device-plugin protocol, run against real plugins.

Shipped, not only for tests: ``devplugin conformance --register-dir`` and ``devplugin demo`` run
it, and ``devplugin_sdk.testing`` re-exports it for plugin authors' tests. It speaks to plugins
through ``_wire`` (``client``, ``registration``, ``watcher_registration``) and never sees
protobuf.

It follows the kubelet v1.32 device manager as written down in the protocol reference:
registration validates with the kubelet's error strings and dials back synchronously, calling
GetDevicePluginOptions inside Register; ListAndWatch messages replace the device set and are
checkpointed; a stream end disconnects the plugin (healthy devices become unhealthy, grace period
starts), and, as in v1.32, the client is looked up by resource name (kubelet issue #121994), so a
duplicate registration gets torn down when the old stream ends. ``allocate`` chooses devices the
kubelet's way. ``restart`` wipes the directory except the checkpoint, as kubelet start does.
``_kubelet`` holds ``FakeKubelet`` and names the module of each part.
"""

from __future__ import annotations

from devplugin_sdk.kubelet.fake._kubelet import FakeKubelet
from devplugin_sdk.kubelet.fake._records import (
    AdmissionError,
    ContainerAllocation,
    ContainerStartError,
    FakeKubeletError,
    KubeletDevice,
    Registration,
)

__all__ = [
    "AdmissionError",
    "ContainerAllocation",
    "ContainerStartError",
    "FakeKubelet",
    "FakeKubeletError",
    "KubeletDevice",
    "Registration",
]
