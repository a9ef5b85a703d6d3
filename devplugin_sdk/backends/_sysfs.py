"""Small helpers for backends that read sysfs (FPGA, RDMA, NVML's NUMA lookup).

Every function takes the sysfs root as a parameter so tests can point it at a fake tree.
Reads are blocking: call them from ``anyio.to_thread.run_sync``.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

# A PCI root bus in the device path, e.g. /sys/devices/pci0000:3a/0000:3a:02.0/0000:3b:00.0.
_ROOT_BUS = re.compile(r"^pci[0-9a-f]{4}:[0-9a-f]{2}$")

__all__ = [
    "list_dir",
    "numa_node",
    "pci_device_dir",
    "pcie_root",
    "read_attr",
    "read_int",
    "read_link_name",
]


def read_attr(path: Path) -> str | None:
    """Read a sysfs attribute without surrounding whitespace; None if missing or unreadable."""
    try:
        return path.read_text(encoding="utf-8", errors="replace").strip()
    except OSError:
        return None


def read_int(path: Path, base: int = 0) -> int | None:
    """Read an integer attribute (``0x``-prefixed hex accepted with base 0), or None."""
    text = read_attr(path)
    if text is None:
        return None
    try:
        return int(text, base)
    except ValueError:
        return None


def read_link_name(path: Path) -> str | None:
    """Return the last component of a symlink's target (e.g. a ``driver`` link), or None."""
    try:
        return Path(os.readlink(path)).name
    except OSError:
        return None


def list_dir(path: Path) -> list[str]:
    """Sorted entry names of a directory, or an empty list if it does not exist."""
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


def pci_device_dir(sysfs_root: Path, pci_address: str) -> Path:
    """``<sysfs>/bus/pci/devices/<address>`` for a PCI address like ``0000:3b:00.0``."""
    return sysfs_root / "bus" / "pci" / "devices" / pci_address.lower()


def numa_node(device_dir: Path) -> int | None:
    """The NUMA node of a PCI device directory, or None when unknown.

    The kernel writes -1 to ``numa_node`` when the platform reports no affinity.
    """
    node = read_int(device_dir / "numa_node", 10)
    if node is None or node < 0:
        return None
    return node


def pcie_root(sysfs_root: Path, pci_address: str) -> str | None:
    """The PCI root bus a device hangs off (``pci0000:3a``), or None when unknown.

    Devices under one root share a PCIe root complex; Kubernetes names this
    ``resource.kubernetes.io/pcieRoot`` (k8s.io/dynamic-resource-allocation deviceattribute),
    found the same way: the ``/sys/bus/pci/devices/<address>`` link resolved.
    """
    try:
        resolved = os.path.realpath(pci_device_dir(sysfs_root, pci_address), strict=True)
    except OSError:
        return None
    return next((part for part in Path(resolved).parts if _ROOT_BUS.match(part)), None)
