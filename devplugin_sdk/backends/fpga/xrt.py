"""AMD/Xilinx Alveo boards under XRT: each management function (xclmgmt) paired with its user
function (xocl), with health from the drivers' ``ready`` and ``dev_offline`` attributes, the
feature ROM and the /dev nodes (``scan_xrt``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from pathlib import Path

from devplugin_sdk.backends import _sysfs
from devplugin_sdk.backends.fpga.board import _PCI_ADDRESS, Board
from devplugin_sdk.types import Health

__all__ = ["XILINX_VENDOR", "scan_xrt"]

# The backend's logger, whichever of its modules logs (the name is in every JSON log line).
log = logging.getLogger("devplugin_sdk.backends.fpga")


XILINX_VENDOR = "0x10ee"


def _xocl_instance(pci_address: str) -> int:
    """XRT's per-function instance number: (domain << 16) | (bus << 8) | devfn.

    XOCL_DEV_ID in xocl/mgmtpf/mgmt-core.c; it names /dev/xclmgmt<N> and the rom.<pf>.<N>
    sub-device directories.
    """
    domain, bus, devfn = pci_address.split(":")
    dev, fn = devfn.split(".")
    return (int(domain, 16) << 16) | (int(bus, 16) << 8) | (int(dev, 16) << 3) | int(fn, 16)


def _xrt_role(function_dir: Path) -> str | None:
    driver = _sysfs.read_link_name(function_dir / "driver")
    # xclmgmt/xocl create empty mgmt_pf/user_pf attributes: "The existence of entry indicates
    # mgmt function" (mgmt-sysfs.c, xocl_sysfs.c); the driver link covers drivers without them.
    if driver == "xclmgmt" or (function_dir / "mgmt_pf").exists():
        return "mgmt"
    if driver == "xocl" or (function_dir / "user_pf").exists():
        return "user"
    return None


def _rom_attr(function_dir: Path, name: str) -> str | None:
    # The feature ROM sub-device is a platform device named rom.<u|m>.<instance> under the PCI
    # function (devices.h XOCL_FEATURE_ROM + SUBDEV_SUFFIX); feature_rom.c gives it VBNV etc.
    for entry in _sysfs.list_dir(function_dir):
        if entry.startswith("rom."):
            value = _sysfs.read_attr(function_dir / entry / name)
            if value:
                return value
    return None


def scan_xrt(
    sysfs_root: Path,
    dev_root: Path,
    *,
    vendors: Iterable[str] = (XILINX_VENDOR,),
    include_mgmt: bool = False,
) -> list[Board]:
    """Find Alveo boards: pair each management function (xclmgmt) with its user function (xocl).

    Blocking (reads sysfs): call through ``anyio.to_thread.run_sync``.

    Args:
        sysfs_root: The sysfs mount (``/sys``).
        dev_root: The /dev directory to check nodes in.
        vendors: PCI vendor IDs to consider.
        include_mgmt: Add the management node to each board's nodes.

    Returns:
        One board per user function, sorted by ID.
    """
    wanted = {v.lower() for v in vendors}
    devices_dir = sysfs_root / "bus" / "pci" / "devices"
    slots: dict[str, dict[str, list[str]]] = {}
    for address in _sysfs.list_dir(devices_dir):
        if not _PCI_ADDRESS.match(address):
            continue
        vendor = (_sysfs.read_attr(devices_dir / address / "vendor") or "").lower()
        if vendor not in wanted:
            continue
        role = _xrt_role(devices_dir / address) or "unknown"
        slot = address.rsplit(".", 1)[0]
        slots.setdefault(slot, {}).setdefault(role, []).append(address)

    boards: list[Board] = []
    for slot, roles in sorted(slots.items()):
        mgmts = roles.get("mgmt") or []
        mgmt = mgmts[0] if mgmts else None
        users = roles.get("user") or []
        if not users and mgmt is not None and roles.get("unknown"):
            # Since XRT 2018.3 the management function is 0 and the user function 1
            # (FPGA_as_a_Service fpga.go); a sibling without a driver is the user function
            # with xocl unbound, which makes the board unusable rather than absent.
            users = roles["unknown"][:1]
        if not users:
            log.debug("FPGA slot %s has no user function; skipped", slot)
            continue
        boards.append(_xrt_board(devices_dir, users[0], mgmt, dev_root, include_mgmt))
    return boards


def _xrt_board(
    devices_dir: Path, user: str, mgmt: str | None, dev_root: Path, include_mgmt: bool
) -> Board:
    user_dir = devices_dir / user
    mgmt_dir = devices_dir / mgmt if mgmt else None
    problems: list[str] = []
    if _sysfs.read_link_name(user_dir / "driver") != "xocl" and not (user_dir / "user_pf").exists():
        problems.append(f"{user} is not bound to xocl")

    vbnv = _rom_attr(user_dir, "VBNV") or (_rom_attr(mgmt_dir, "VBNV") if mgmt_dir else None)
    timestamp = _rom_attr(user_dir, "timestamp") or (
        _rom_attr(mgmt_dir, "timestamp") if mgmt_dir else None
    )
    if vbnv is None:
        problems.append("no shell VBNV readable (rom sub-device missing)")

    # xocl is a DRM driver: its render node is listed in the function's drm/ directory
    # (FPGA_as_a_Service fpga.go reads <pci>/drm/renderD*).
    renders = [n for n in _sysfs.list_dir(user_dir / "drm") if n.startswith("renderD")]
    if not renders:
        problems.append("xocl has no DRM render node")
    for label, function_dir in (("user", user_dir), ("management", mgmt_dir)):
        if function_dir is not None:
            problems += _function_problems(label, function_dir)
    nodes = _xrt_nodes(user, renders, mgmt_dir if include_mgmt else None, dev_root)
    problems += [f"/dev/{node} is missing" for node in nodes if not (dev_root / node).exists()]

    attributes = {"family": "xrt", "userFunction": user}
    if mgmt:
        attributes["managementFunction"] = mgmt
    if vbnv:
        attributes["vbnv"] = vbnv
    if timestamp:
        attributes["timestamp"] = timestamp
    return Board(
        id=user,
        key=vbnv,
        key_valid=vbnv is not None,
        device_nodes=tuple(nodes),
        numa_node=_sysfs.numa_node(user_dir),
        health=Health.UNHEALTHY if problems else Health.HEALTHY,
        reason="; ".join(problems),
        attributes=attributes,
    )


def _function_problems(label: str, function_dir: Path) -> list[str]:
    """What the driver of one function (user or management) says is wrong with it."""
    problems = []
    # dev_offline: 1 while the driver has the device offline (reset, shell change).
    if _sysfs.read_int(function_dir / "dev_offline") == 1:
        problems.append(f"{label} function is offline")
    # ready: xocl prints 0x1 once the mailbox to xclmgmt is up; xclmgmt prints 1 once its
    # subdevices are up (xocl_sysfs.c / mgmt-sysfs.c ready_show). Missing means an older
    # driver without the attribute: not a fault.
    if _sysfs.read_int(function_dir / "ready") == 0:
        problems.append(f"{label} function is not ready")
    return problems


def _xrt_nodes(
    user: str, renders: Sequence[str], mgmt_dir: Path | None, dev_root: Path
) -> list[str]:
    """A board's nodes under /dev: the render node, the management node when given
    (``mgmt_dir``), and the QDMA streaming node when present."""
    nodes = [f"dri/{renders[0]}"] if renders else []
    if mgmt_dir is not None:
        instance = _sysfs.read_int(mgmt_dir / "instance", 10)
        if instance is None:
            instance = _xocl_instance(mgmt_dir.name)
        nodes.append(f"xclmgmt{instance}")
    # Optional QDMA streaming node (FPGA_as_a_Service fpga.go: /dev/xfpga/dma.qdma.u<inst>.0).
    qdma = f"xfpga/dma.qdma.u{_xocl_instance(user)}.0"
    if (dev_root / qdma).exists():
        nodes.append(qdma)
    return nodes
