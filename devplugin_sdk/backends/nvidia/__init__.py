"""NVIDIA GPUs through NVML: discovery, MIG, container setup, health by stated rules, placement.

``NvmlPlugin`` serves one resource (``nvidia.com/gpu``, ``nvidia.com/mig-1g.10gb``, ...);
``from_config`` builds the plugins a node needs from a YAML mapping (``devplugin run nvidia``).
NVML comes from nvidia-ml-py (``pynvml``), imported when a plugin is built, never when the SDK is
imported; tests install the fake of ``devplugin_sdk.testing.fake_nvml`` in its place.

The modules, one piece each: ``config`` (what the backend can be told), ``library`` (pynvml,
``nvmlInit``/``nvmlShutdown``), ``discovery`` and ``mig`` (what the node has), ``container``
(what a container gets), ``sharing`` (memory units and slices), ``health`` (the probe and
recovery), ``events`` (Xid and ECC events), ``topology`` (placement scores) and ``plugin`` (the
hooks). Facts were learned from nvml.h and nvidia-ml-py's ``pynvml.py``; NVIDIA/k8s-device-plugin
``internal/rm/{nvml_devices.go,health.go}`` and ``internal/plugin/server.go`` (device-list
strategies, ignored Xids, MIG capability paths); NVIDIA/go-nvlib
``pkg/nvlib/device/mig_profile.go`` (MIG profile names); NVIDIA/go-gpuallocator
``besteffort_policy.go`` (pair scores); the kernel's ``Documentation/ABI/testing/sysfs-bus-pci``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from devplugin_sdk.backends.nvidia.config import (
    DEFAULT_IGNORED_XIDS,
    Interceptor,
    MemorySharing,
    NvidiaConfig,
    VgpuSharing,
)
from devplugin_sdk.backends.nvidia.discovery import GpuFacts, GpuInfo
from devplugin_sdk.backends.nvidia.library import load_nvml, pci_address
from devplugin_sdk.backends.nvidia.mig import MigInfo, mig_profile_name
from devplugin_sdk.backends.nvidia.plugin import NvmlPlugin
from devplugin_sdk.plugin import DevicePlugin

__all__ = [
    "DEFAULT_IGNORED_XIDS",
    "GpuFacts",
    "GpuInfo",
    "Interceptor",
    "MemorySharing",
    "MigInfo",
    "NvidiaConfig",
    "NvmlPlugin",
    "VgpuSharing",
    "from_config",
    "load_nvml",
    "mig_profile_name",
    "pci_address",
]


def from_config(config: Mapping[str, Any]) -> list[DevicePlugin]:
    """Build the plugins a node needs from the YAML mapping (``devplugin run nvidia``).

    Args:
        config: The YAML mapping (see ``NvidiaConfig.from_mapping``).

    Raises:
        ConfigError: invalid configuration (names the dotted key).
        BackendError: NVML unusable while listing MIG profiles.
        MissingDependencyError: nvidia-ml-py is not installed.
    """
    return list(NvmlPlugin.from_config(config))
