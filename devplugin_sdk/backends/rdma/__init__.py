"""RDMA backend: InfiniBand HCAs, RoCE NICs and their SR-IOV VFs, discovered from sysfs and
handed out whole (``exclusive``) or in shares (``shared``), with health from port state.

The modules, one piece each: ``discovery`` (the sysfs reading, ``scan``), ``selection``
(``Selector``, ``RdmaResource``), ``health`` (``evaluate_health``), ``config`` (the YAML schema,
``load_config``) and ``plugin`` (``RdmaPlugin``); ``from_config`` is here.

Layouts were learned from: linux ``Documentation/ABI/stable/sysfs-class-infiniband``;
``drivers/infiniband/core/{sysfs.c,uverbs_main.c,user_mad.c,ucma.c}``;
``drivers/infiniband/hw/mlx5/main.c``; ``drivers/infiniband/ulp/ipoib/ipoib_main.c``;
rdma-core ``libibverbs/init-sysfs.c``; Mellanox/rdmamap ``rdma_map.go``;
Mellanox/k8s-rdma-shared-dev-plugin ``pkg/utils/utils.go``, ``pkg/resources/device_selectors.go``,
``pkg/resources/rdma_device_spec.go``, ``README.md``; k8snetworkplumbingwg/
sriov-network-device-plugin ``pkg/infoprovider/rdmaInfoProvider.go``, ``pkg/utils/utils_test.go``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from devplugin_sdk.backends.rdma.config import RdmaConfig, load_config
from devplugin_sdk.backends.rdma.discovery import RdmaDeviceInfo, RdmaPort, scan
from devplugin_sdk.backends.rdma.health import evaluate_health
from devplugin_sdk.backends.rdma.plugin import RdmaPlugin
from devplugin_sdk.backends.rdma.selection import RdmaResource, Selector
from devplugin_sdk.plugin import DevicePlugin

__all__ = [
    "RdmaConfig",
    "RdmaDeviceInfo",
    "RdmaPlugin",
    "RdmaPort",
    "RdmaResource",
    "Selector",
    "evaluate_health",
    "from_config",
    "load_config",
    "scan",
]


def from_config(config: Mapping[str, Any]) -> list[DevicePlugin]:
    """One ``RdmaPlugin`` per configured resource (the backend contract of ``devplugin run``).

    Args:
        config: See ``load_config``.

    Raises:
        ConfigError: naming the dotted key and what is wrong with it.
    """
    return list(RdmaPlugin.from_config(config))
