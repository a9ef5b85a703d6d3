"""FPGA boards from sysfs: AMD/Xilinx Alveo cards under XRT, Intel FPGAs under the Linux DFL driver.

Owns discovery, per-board health from the drivers' own attributes, resource naming (shell VBNV,
AFU ID or interface ID; sanitised, renameable) and hot-plug (``fswatch.watch_or_rescan``: the
SDK diffs devices and health on each rescan). Layouts learned from the kernel's
Documentation/fpga/dfl.rst ("Device enumeration"), Documentation/ABI/testing/
sysfs-class-fpga-region, sysfs-platform-dfl-port, sysfs-platform-dfl-fme, drivers/fpga/dfl.c
and dfl-fme-pr.c; Xilinx/XRT src/runtime_src/core/pcie/driver/linux/xocl/
(userpf/xocl_sysfs.c, mgmtpf/mgmt-sysfs.c, mgmtpf/mgmt-core.c, subdev/feature_rom.c, devices.h);
intel/intel-device-plugins-for-kubernetes cmd/fpga_plugin/ and pkg/fpga/; Xilinx/FPGA_as_a_Service
k8s-device-plugin/fpga.go.

The modules, one piece each: ``board`` (a board and resource naming), ``config`` (the keys),
``xrt`` and ``dfl`` (each family's scan) and ``plugin`` (``FpgaPlugin``); ``from_config`` is here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from devplugin_sdk.backends.fpga.board import Board, sanitize_name_part
from devplugin_sdk.backends.fpga.config import CONFIG_KEYS, FpgaConfig
from devplugin_sdk.backends.fpga.dfl import scan_dfl
from devplugin_sdk.backends.fpga.plugin import FpgaPlugin, scan
from devplugin_sdk.backends.fpga.xrt import scan_xrt
from devplugin_sdk.plugin import DevicePlugin

__all__ = [
    "CONFIG_KEYS",
    "Board",
    "FpgaConfig",
    "FpgaPlugin",
    "from_config",
    "sanitize_name_part",
    "scan",
    "scan_dfl",
    "scan_xrt",
]


def from_config(config: Mapping[str, Any]) -> list[DevicePlugin]:
    """The backend contract: ``FpgaPlugin.from_config`` (``devplugin run fpga --config FILE``).

    Raises:
        ConfigError: naming the full dotted key and the reason.
    """
    return list(FpgaPlugin.from_config(config))
