"""A kubelet's-eye client of any device plugin's socket, and ``devplugin probe`` built on it.

``PluginClient`` dials and calls a plugin exactly as the kubelet's device manager does (insecure
gRPC over the unix socket, 10 s dial, 4 MiB receive limit), whatever language the plugin is in;
``probe``/``watch`` report what the kubelet would get. ``conformance`` reuses the client.
Kubelet behaviour is from the protocol reference (kubelet-device-plugin-protocol.md, sections 2.2,
5 and 8), which cites kubelet v1.32 ``pkg/kubelet/cm/devicemanager``.

The pieces: ``_errors`` (what can go wrong), ``_lists`` (device lists, changes, responses as
JSON), ``_client`` (``PluginClient``, ``ListStream``), ``_probe`` (``probe``, ``watch``).
"""

from __future__ import annotations

from devplugin_sdk.kubelet.probe._client import ListStream, PluginClient
from devplugin_sdk.kubelet.probe._errors import (
    NotADevicePluginError,
    NotAnsweringError,
    PluginRpcError,
    ProbeError,
    ProtocolViolation,
    SocketMissingError,
)
from devplugin_sdk.kubelet.probe._lists import (
    DeviceChange,
    DeviceList,
    ListedDevice,
    PluginOptions,
    allocation_json,
    diff_devices,
)
from devplugin_sdk.kubelet.probe._probe import (
    AllocationReport,
    ProbeReport,
    allocate_like_kubelet,
    probe,
    watch,
)

__all__ = [
    "AllocationReport",
    "DeviceChange",
    "DeviceList",
    "ListStream",
    "ListedDevice",
    "NotADevicePluginError",
    "NotAnsweringError",
    "PluginClient",
    "PluginOptions",
    "PluginRpcError",
    "ProbeError",
    "ProbeReport",
    "ProtocolViolation",
    "SocketMissingError",
    "allocate_like_kubelet",
    "allocation_json",
    "diff_devices",
    "probe",
    "watch",
]
