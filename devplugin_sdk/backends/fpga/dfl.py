"""Intel FPGAs under the Linux DFL driver: the base regions under /sys/class/fpga_region, their
FME and ports, one board per port (``af`` mode, keyed by AFU ID) or per card (``region`` mode,
keyed by interface ID) (``scan_dfl``).
"""

from __future__ import annotations

import glob
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from devplugin_sdk.backends import _sysfs
from devplugin_sdk.backends.fpga.board import (
    _PCI_ADDRESS,
    UNHEALTHY_ID,
    Board,
    _canonical_id,
    _valid_uuid_key,
)
from devplugin_sdk.backends.fpga.config import DflMode
from devplugin_sdk.types import Health

__all__ = ["scan_dfl"]


_DFL_FME = re.compile(r"^dfl-fme\.\d+$")


_DFL_PORT = re.compile(r"^dfl-port\.\d+$")


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
        ports = [_read_port(region_dir / name) for name in port_names]
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


def _read_port(port_dir: Path) -> _DflPort:
    afu = _sysfs.read_attr(port_dir / "afu_id")
    return _DflPort(
        name=port_dir.name,
        # id: "returns id of this port" in its FPGA device (sysfs-platform-dfl-port).
        port_id=_sysfs.read_int(port_dir / "id", 10) or 0,
        afu_id=_canonical_id(afu) if afu else None,
        bound=_sysfs.read_link_name(port_dir / "driver") is not None,
    )


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
