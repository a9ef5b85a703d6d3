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
"""

from __future__ import annotations

import glob
import logging
import os
import re
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, cast

import anyio
from typing_extensions import Self

from devplugin_sdk import fswatch
from devplugin_sdk.backends import _sysfs
from devplugin_sdk.config import ConfigReader, shown
from devplugin_sdk.errors import ConfigError
from devplugin_sdk.plugin import DevicePlugin
from devplugin_sdk.types import Device, DeviceNode, Health, HealthEvent, RescanEvent

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

log = logging.getLogger(__name__)

Family = Literal["xrt", "dfl"]
DflMode = Literal["af", "region"]

XILINX_VENDOR = "0x10ee"
# The DFL driver reports an all-f AFU or interface ID when the card's firmware has crashed
# (intel-device-plugins-for-kubernetes cmd/fpga_plugin/fpga_plugin.go: unhealthyAfuID).
UNHEALTHY_ID = "f" * 32
DEFAULT_DOMAIN: Mapping[str, str] = {"xrt": "amd.com", "dfl": "fpga.intel.com"}

_PCI_ADDRESS = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
_DFL_FME = re.compile(r"^dfl-fme\.\d+$")
_DFL_PORT = re.compile(r"^dfl-port\.\d+$")
_NOT_NAME_CHAR = re.compile(r"[^A-Za-z0-9._-]+")


@dataclass(frozen=True, slots=True)
class Board:
    """One schedulable FPGA unit as read from sysfs (an Alveo board, a DFL port or region).

    Args:
        id: Stable device ID: the user function's PCI address (XRT), ``<pci>-port<N>`` (DFL af
            mode) or the card's PCI address (DFL region mode).
        key: What names the resource: the shell VBNV (XRT), the AFU ID (af) or the interface
            ID (region); None when it cannot be read (driver offline, shell not loaded).
        key_valid: False when ``key`` is None or the all-f crash marker; such a board stays in
            the resource that already served it, as Unhealthy.
        device_nodes: Node paths relative to the /dev root (``dri/renderD128``, ``dfl-port.0``).
        numa_node: NUMA node of the PCI device, None when unknown.
        health: Health as read now.
        reason: Why the board is unhealthy ("" when healthy).
        attributes: Facts for logs and custom plugins (PCI addresses, VBNV, AFU ID, ...).
    """

    id: str
    key: str | None
    key_valid: bool
    device_nodes: tuple[str, ...]
    numa_node: int | None
    health: Health
    reason: str = ""
    attributes: Mapping[str, str] = field(default_factory=dict)


# ----------------------------------------------------------------------------- naming


def sanitize_name_part(text: str) -> str:
    """Turn ``text`` (a VBNV, an ID) into the part of an extended resource name after the ``/``.

    Runs of characters outside ``[A-Za-z0-9._-]`` become ``_``; leading and trailing
    punctuation is dropped and the result is cut to 63 characters (the kubelet's limit).

    Raises:
        ValueError: if nothing usable is left.
    """
    part = _NOT_NAME_CHAR.sub("_", text).strip("._-")
    part = part[:63].rstrip("._-")
    if not part:
        raise ValueError(f"cannot make a resource name from {text!r}")
    return part


def _canonical_id(text: str) -> str:
    """AFU/interface IDs as the DFL driver prints them: 32 lower-case hex digits, no dashes."""
    return text.strip().replace("-", "").lower()


def _valid_uuid_key(key: str | None) -> bool:
    if key is None or key == UNHEALTHY_ID:
        return False
    return re.fullmatch(r"[0-9a-f]{32}", key) is not None


# ----------------------------------------------------------------------------- config


#: The backend's keys, as ``from_config`` takes them.
CONFIG_KEYS = (
    "family",
    "mode",
    "domain",
    "rename",
    "vendors",
    "includeMgmt",
    "includeFme",
    "healthInterval",
    "sysfsRoot",
    "devRoot",
    "hostDevRoot",
)


@dataclass(frozen=True, slots=True)
class FpgaConfig:
    """Validated backend settings (the backend's keys of a ``devplugin run`` file).

    Args:
        family: ``"xrt"`` (AMD/Xilinx Alveo) or ``"dfl"`` (Intel, Linux DFL driver).
        mode: DFL only: ``"af"`` (one resource per programmed AFU ID, one device per port) or
            ``"region"`` (one resource per interface ID, one device per card with all its ports).
        domain: Domain of generated resource names (``amd.com`` / ``fpga.intel.com``).
        rename: Key (VBNV, AFU ID or interface ID) to resource name. A bare name gets
            ``domain/`` prepended. Every key listed here is served even when no board has it
            at start, so boards programmed later are picked up; several keys may share a name.
        sysfs_root: Where sysfs is read (``sysfsRoot``).
        dev_root: Where /dev is read and watched (``devRoot``).
        host_dev_root: /dev as the kubelet's host sees it (``hostDevRoot``); device node paths
            given to the kubelet are under it (differs from ``dev_root`` when the plugin runs
            with the host /dev mounted elsewhere).
        include_mgmt: XRT: also give the management node ``/dev/xclmgmt<N>`` (``includeMgmt``;
            it can reflash the card: off by default).
        include_fme: DFL region mode: also give the FME node (``includeFme``; partial
            reconfiguration from inside the container, like Intel's ``regiondevel`` mode).
        vendors: XRT: PCI vendor IDs to consider.
        health_interval: Seconds between rescans of sysfs when /dev shows no change
            (``healthInterval``): the pace at which health read from sysfs is refreshed.
    """

    family: Family
    mode: DflMode = "af"
    domain: str = ""
    rename: Mapping[str, str] = field(default_factory=dict)
    sysfs_root: Path = Path("/sys")
    dev_root: Path = Path("/dev")
    host_dev_root: Path = Path("/dev")
    include_mgmt: bool = False
    include_fme: bool = False
    vendors: tuple[str, ...] = (XILINX_VENDOR,)
    health_interval: float = 5.0

    def __post_init__(self) -> None:
        if not self.domain:
            object.__setattr__(self, "domain", DEFAULT_DOMAIN[self.family])
        for name in ("sysfs_root", "dev_root", "host_dev_root"):
            object.__setattr__(self, name, Path(getattr(self, name)))

    @classmethod
    def from_mapping(cls, config: Mapping[str, Any]) -> FpgaConfig:
        """Validate the backend's keys (``CONFIG_KEYS``) as loaded from YAML.

        Raises:
            ConfigError: naming the full dotted key and the reason.
        """
        reader = ConfigReader(config)
        reader.known(*CONFIG_KEYS)
        family = cast("Family", reader.choice("family", ("xrt", "dfl")))
        if family == "xrt" and reader.has("mode"):
            raise ConfigError(reader.key("mode"), "only applies to family 'dfl'")
        mode = cast("DflMode", reader.choice("mode", ("af", "region"), "af"))
        domain = reader.domain("domain", DEFAULT_DOMAIN[family])
        vendors: list[str] = []
        for i, vendor in enumerate(reader.strings("vendors", (XILINX_VENDOR,))):
            if re.fullmatch(r"0x[0-9a-fA-F]{4}", vendor) is None:
                raise ConfigError(
                    f"{reader.key('vendors')}[{i}]", f"must look like '0x10ee', got {shown(vendor)}"
                )
            vendors.append(vendor.lower())
        names = reader.section("rename")
        rename: dict[str, str] = {}
        for key in names.data:
            if not isinstance(key, str) or not key:
                # An AFU ID of decimal digits only is a number to YAML.
                raise ConfigError(
                    names.key(shown(key)), "must be a non-empty string (quote IDs in YAML)"
                )
            # AFU and interface IDs are compared in the driver's canonical form.
            canonical = key if family == "xrt" else _canonical_id(key)
            rename[canonical] = names.resource_name(key, domain=domain)
        return cls(
            family=family,
            mode=mode,
            domain=domain,
            rename=rename,
            sysfs_root=reader.path("sysfsRoot", "/sys"),
            dev_root=reader.path("devRoot", "/dev"),
            host_dev_root=reader.path("hostDevRoot", "/dev"),
            include_mgmt=reader.boolean("includeMgmt", False),
            include_fme=reader.boolean("includeFme", False),
            vendors=tuple(vendors),
            health_interval=reader.interval("healthInterval", 5.0),
        )

    def resource_name_for(self, key: str) -> str:
        """The resource name of boards whose key is ``key`` (rename map first)."""
        if key in self.rename:
            return self.rename[key]
        if self.family == "xrt":
            return f"{self.domain}/{sanitize_name_part(key)}"
        prefix = "af" if self.mode == "af" else "region"
        return f"{self.domain}/{prefix}-{sanitize_name_part(key)}"


# ----------------------------------------------------------------------------- XRT scan


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

    nodes: list[str] = []
    # xocl is a DRM driver: its render node is listed in the function's drm/ directory
    # (FPGA_as_a_Service fpga.go reads <pci>/drm/renderD*).
    renders = [n for n in _sysfs.list_dir(user_dir / "drm") if n.startswith("renderD")]
    if renders:
        nodes.append(f"dri/{renders[0]}")
    else:
        problems.append("xocl has no DRM render node")

    for label, function_dir in (("user", user_dir), ("management", mgmt_dir)):
        if function_dir is None:
            continue
        # dev_offline: 1 while the driver has the device offline (reset, shell change).
        if _sysfs.read_int(function_dir / "dev_offline") == 1:
            problems.append(f"{label} function is offline")
        # ready: xocl prints 0x1 once the mailbox to xclmgmt is up; xclmgmt prints 1 once its
        # subdevices are up (xocl_sysfs.c / mgmt-sysfs.c ready_show). Missing means an older
        # driver without the attribute: not a fault.
        if _sysfs.read_int(function_dir / "ready") == 0:
            problems.append(f"{label} function is not ready")

    if mgmt_dir is not None and include_mgmt:
        instance = _sysfs.read_int(mgmt_dir / "instance", 10)
        nodes.append(f"xclmgmt{instance if instance is not None else _xocl_instance(mgmt or '')}")
    # Optional QDMA streaming node (FPGA_as_a_Service fpga.go: /dev/xfpga/dma.qdma.u<inst>.0).
    qdma = f"xfpga/dma.qdma.u{_xocl_instance(user)}.0"
    if (dev_root / qdma).exists():
        nodes.append(qdma)
    for node in nodes:
        if not (dev_root / node).exists():
            problems.append(f"/dev/{node} is missing")

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


# ----------------------------------------------------------------------------- DFL scan


@dataclass(slots=True)
class _DflPort:
    name: str
    port_id: int
    afu_id: str | None
    bound: bool


def _dfl_interface_id(region_dir: Path, fmes: Sequence[str], pci_dir: Path | None) -> str | None:
    # The FME's PR sub-feature creates one FPGA region per port under the FME
    # (dfl-fme-pr.c: dfl-fme-region.<n>/fpga_region/region<m>); its compat_id is the interface
    # ID a PR bitstream must match (Documentation/fpga/dfl.rst "Partial Reconfiguration").
    # The roots come from configuration: escape them, only the wildcards below are patterns.
    patterns = [
        glob.escape(str(region_dir / fme)) + "/dfl-fme-region.*/fpga_region/region*/compat_id"
        for fme in fmes
    ]
    if not fmes and pci_dir is not None:
        # A port on an SR-IOV VF has no FME; the PF's FME holds the interface ID
        # (Documentation/fpga/dfl.rst "FPGA virtualization - PCIe SRIOV").
        patterns.append(
            glob.escape(str(pci_dir / "physfn" / "fpga_region"))
            + "/region*/dfl-fme.*/dfl-fme-region.*/fpga_region/region*/compat_id"
        )
    for pattern in patterns:
        for path in sorted(glob.glob(pattern)):
            value = _sysfs.read_attr(Path(path))
            if value:
                return _canonical_id(value)
    return None


def scan_dfl(
    sysfs_root: Path,
    dev_root: Path,
    *,
    mode: DflMode = "af",
    include_fme: bool = False,
) -> list[Board]:
    """Find Intel FPGAs driven by the Linux DFL driver.

    Blocking (reads sysfs): call through ``anyio.to_thread.run_sync``.

    Args:
        sysfs_root: The sysfs mount (``/sys``).
        dev_root: The /dev directory to check nodes in.
        mode: ``"af"``: one board per port, keyed by its AFU ID; ``"region"``: one board per
            card with all its ports, keyed by the interface ID.
        include_fme: Region mode: add the FME node.

    Returns:
        The boards, sorted by ID.
    """
    class_dir = sysfs_root / "class" / "fpga_region"
    boards: list[Board] = []
    for region in _sysfs.list_dir(class_dir):
        region_dir = class_dir / region
        entries = _sysfs.list_dir(region_dir)
        fmes = [e for e in entries if _DFL_FME.match(e)]
        port_names = [e for e in entries if _DFL_PORT.match(e)]
        # "Application needs to search each regionX folder, if feature device is found ...
        # then it's the base fpga region which represents the FPGA device" (dfl.rst); the
        # other regions are the FME's PR regions. A PF whose ports were all released to
        # SR-IOV VFs keeps only its FME: nothing to allocate there.
        if not port_names:
            continue
        # /sys/class/fpga_region/regionX links to <pci device>/fpga_region/regionX.
        real = Path(os.path.realpath(region_dir))
        pci_dir = real.parent.parent if real.parent.name == "fpga_region" else None
        pci = pci_dir.name if pci_dir is not None and _PCI_ADDRESS.match(pci_dir.name) else None
        interface_id = _dfl_interface_id(region_dir, fmes, pci_dir)
        numa = _sysfs.numa_node(pci_dir) if pci_dir is not None else None
        ports = []
        for name in port_names:
            port_dir = region_dir / name
            afu = _sysfs.read_attr(port_dir / "afu_id")
            ports.append(
                _DflPort(
                    name=name,
                    # id: "returns id of this port" in its FPGA device (sysfs-platform-dfl-port).
                    port_id=_sysfs.read_int(port_dir / "id", 10) or 0,
                    afu_id=_canonical_id(afu) if afu else None,
                    bound=_sysfs.read_link_name(port_dir / "driver") is not None,
                )
            )
        base_id = pci or region
        common = {"family": "dfl", "region": region}
        if pci:
            common["pciAddress"] = pci
        if interface_id:
            common["interfaceID"] = interface_id
        if mode == "af":
            for port in sorted(ports, key=lambda p: p.port_id):
                boards.append(
                    _dfl_af_board(
                        base_id=base_id,
                        port=port,
                        interface_id=interface_id,
                        numa=numa,
                        dev_root=dev_root,
                        common=common,
                    )
                )
        else:
            boards.append(
                _dfl_region_board(
                    base_id=base_id,
                    ports=ports,
                    fmes=fmes,
                    interface_id=interface_id,
                    numa=numa,
                    dev_root=dev_root,
                    include_fme=include_fme,
                    common=common,
                )
            )
    return sorted(boards, key=lambda b: b.id)


def _dfl_af_board(
    *,
    base_id: str,
    port: _DflPort,
    interface_id: str | None,
    numa: int | None,
    dev_root: Path,
    common: Mapping[str, str],
) -> Board:
    problems: list[str] = []
    if port.afu_id is None:
        problems.append(f"{port.name} has no readable afu_id")
    elif port.afu_id == UNHEALTHY_ID:
        problems.append(f"{port.name} reports an all-f AFU ID (firmware crashed)")
    if interface_id == UNHEALTHY_ID:
        problems.append("the FME reports an all-f interface ID (firmware crashed)")
    if not port.bound:
        problems.append(f"{port.name} is not bound to the dfl-port driver")
    # The port's char device is /dev/dfl-port.<n>, named after the platform device
    # (dfl.c gives the feature device a devt; "/sys/class/fpga_region/<regionX>/<dfl-port.n>/dev").
    if not (dev_root / port.name).exists():
        problems.append(f"/dev/{port.name} is missing")
    attributes = {**common, "port": port.name}
    if port.afu_id:
        attributes["afuID"] = port.afu_id
    return Board(
        id=f"{base_id}-port{port.port_id}",
        key=port.afu_id,
        key_valid=_valid_uuid_key(port.afu_id),
        device_nodes=(port.name,),
        numa_node=numa,
        health=Health.UNHEALTHY if problems else Health.HEALTHY,
        reason="; ".join(problems),
        attributes=attributes,
    )


def _dfl_region_board(
    *,
    base_id: str,
    ports: Sequence[_DflPort],
    fmes: Sequence[str],
    interface_id: str | None,
    numa: int | None,
    dev_root: Path,
    include_fme: bool,
    common: Mapping[str, str],
) -> Board:
    problems: list[str] = []
    if interface_id is None:
        problems.append("no interface ID readable (FME region missing)")
    elif interface_id == UNHEALTHY_ID:
        problems.append("the FME reports an all-f interface ID (firmware crashed)")
    nodes = [p.name for p in sorted(ports, key=lambda p: p.port_id)]
    if not nodes:
        problems.append("no port")
    if include_fme:
        nodes.extend(fmes)
    for port in ports:
        if not port.bound:
            problems.append(f"{port.name} is not bound to the dfl-port driver")
    for node in nodes:
        if not (dev_root / node).exists():
            problems.append(f"/dev/{node} is missing")
    return Board(
        id=base_id,
        key=interface_id,
        key_valid=_valid_uuid_key(interface_id),
        device_nodes=tuple(nodes),
        numa_node=numa,
        health=Health.UNHEALTHY if problems else Health.HEALTHY,
        reason="; ".join(problems),
        attributes={**common, "ports": ",".join(p.name for p in ports)},
    )


def _dra_attributes(board: Board) -> dict[str, str | int]:
    """The board's facts as typed attributes (DRA publishes them): its NUMA node as a number;
    a value longer than a DRA attribute may be (64 bytes) is left out."""
    attributes: dict[str, str | int] = {
        k: v for k, v in board.attributes.items() if len(v.encode()) <= 64
    }
    if board.numa_node is not None:
        attributes["numaNode"] = board.numa_node
    return attributes


def scan(config: FpgaConfig) -> list[Board]:
    """Scan the host for the configured family (blocking)."""
    if config.family == "xrt":
        return scan_xrt(
            config.sysfs_root,
            config.dev_root,
            vendors=config.vendors,
            include_mgmt=config.include_mgmt,
        )
    return scan_dfl(
        config.sysfs_root, config.dev_root, mode=config.mode, include_fme=config.include_fme
    )


# ----------------------------------------------------------------------------- plugin


class FpgaPlugin(DevicePlugin):
    """Serve the FPGA boards of one resource (one shell, AFU ID or interface ID, or a rename).

    ``discover()`` reads sysfs and returns the resource's boards, each with its health as the
    driver's own attributes show it now (XRT: driver bound, ``dev_offline``, ``ready``, render
    node present; DFL: all-f IDs, driver bound, port node present). ``watch()`` asks for a
    rescan at once when a relevant /dev entry appears or disappears (inotify) and every
    ``healthInterval`` seconds otherwise (sysfs sends no events); the SDK diffs devices and
    health on every rescan, so faults and recoveries both reach the kubelet that way. Nothing
    is polled besides: health has one source.

    A board whose key stops being readable (driver offline, all-f crash marker) stays in the
    resource that served it, as Unhealthy; a board reprogrammed to another valid key leaves
    this resource at the next rescan and joins the plugin serving that key, if this process
    runs one (see ``from_config``).

    Args:
        resource_name: The extended resource name.
        keys: The VBNVs, AFU IDs or interface IDs whose boards this resource serves.
        config: Backend settings.
        socket_name: Optional socket file name.
    """

    def __init__(
        self,
        *,
        resource_name: str,
        keys: Iterable[str],
        config: FpgaConfig,
        socket_name: str | None = None,
    ) -> None:
        super().__init__(resource_name=resource_name, socket_name=socket_name)
        self.config = config
        # Sorted: the plugin's fingerprint (reload) must not depend on set order.
        self.keys: tuple[str, ...] = tuple(sorted(set(keys)))
        # The boards the last discover() returned: a board whose key turns unreadable stays.
        self._served: dict[str, Board] = {}

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> list[Self]:
        """Validate ``config`` (``CONFIG_KEYS``); scan the host; one plugin per resource.

        Resources are those of the boards found now (named by ``rename`` or from the key) plus
        every resource named in ``rename``, found or not: the set of plugins stays fixed until
        a configuration reload calls this again, so a key that first appears after start (a
        board reprogrammed with a new shell or AFU) is only served if it was declared there.
        Boards whose key cannot be read now are logged and left out. Subclasses get plugins
        of their own class.

        Returns:
            Plugins sorted by resource name; empty when nothing is found or declared.

        Raises:
            ConfigError: naming the full dotted key and the reason.
        """
        settings = FpgaConfig.from_mapping(config)
        keys_by_name: dict[str, set[str]] = {}
        for key, name in settings.rename.items():
            keys_by_name.setdefault(name, set()).add(key)
        for board in scan(settings):
            if board.key is None:
                log.warning("FPGA %s skipped: %s", board.id, board.reason or "no key readable")
                continue
            try:
                name = settings.resource_name_for(board.key)
            except ValueError:
                log.warning("FPGA %s skipped: cannot name a resource after %r", board.id, board.key)
                continue
            keys_by_name.setdefault(name, set()).add(board.key)
        return [
            cls(resource_name=name, keys=keys, config=settings)
            for name, keys in sorted(keys_by_name.items())
        ]

    # ------------------------------------------------------------------ hooks

    async def discover(self) -> Sequence[Device]:
        """Read sysfs and return this resource's boards with the health read now."""
        boards = self._select(await anyio.to_thread.run_sync(scan, self.config))
        for board in boards:
            before = self._served.get(board.id)
            # Rescans come every interval: log a fault when it is new or different, not each time.
            if board.reason and (before is None or before.reason != board.reason):
                log.warning("%s: %s is unhealthy: %s", self.resource_name, board.id, board.reason)
        self._served = {b.id: b for b in boards}
        return [self._device(b) for b in boards]

    def watch(self) -> AsyncIterator[HealthEvent | RescanEvent]:
        """Ask for a rescan when a relevant /dev entry changes, and every ``healthInterval``."""
        return fswatch.watch_or_rescan(
            self._watch_dirs(), self.config.health_interval, relevant=self._relevant
        )

    # ------------------------------------------------------------------ helpers

    def _select(self, boards: Iterable[Board]) -> list[Board]:
        """This resource's boards: those with one of its keys, plus boards it served whose key
        is no longer readable (they stay, unhealthy, instead of vanishing)."""
        return [
            b
            for b in boards
            if (b.key is not None and b.key in self.keys)
            or (not b.key_valid and b.id in self._served)
        ]

    def _device(self, board: Board) -> Device:
        host = self.config.host_dev_root
        return Device(
            id=board.id,
            health=board.health,
            numa_nodes=(board.numa_node,) if board.numa_node is not None else (),
            device_nodes=tuple(
                DeviceNode(host_path=str(host / node), container_path=f"/dev/{node}")
                for node in board.device_nodes
            ),
            attributes=_dra_attributes(board),
        )

    def _watch_dirs(self) -> list[Path]:
        dev = self.config.dev_root
        if self.config.family == "xrt":
            return [dev, dev / "dri", dev / "xfpga"]
        return [dev]

    def _relevant(self, path: Path) -> bool:
        """A /dev entry the boards' nodes live in or are named like (not ttys, loops, ...)."""
        if path in self._watch_dirs():
            return True
        prefixes = (
            ("renderD", "xclmgmt", "dma.qdma.")
            if self.config.family == "xrt"
            else ("dfl-port.", "dfl-fme.")
        )
        return path.name.startswith(prefixes)


def from_config(config: Mapping[str, Any]) -> list[DevicePlugin]:
    """The backend contract: ``FpgaPlugin.from_config`` (``devplugin run fpga --config FILE``).

    Raises:
        ConfigError: naming the full dotted key and the reason.
    """
    return list(FpgaPlugin.from_config(config))
