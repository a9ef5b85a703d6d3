"""Small helpers for backends that read sysfs (generic, FPGA, RDMA, NVML's NUMA lookup).

Every function takes the sysfs root as a parameter so tests can point it at a fake tree.
Reads are blocking: call them from ``anyio.to_thread.run_sync``. They are bounded: an attribute
is read only if it is a regular file of at most a page (``config.read_file``), so a FIFO or a huge
file where an attribute should be (a tampered or mistaken ``sysfsRoot``) never blocks a worker
thread nor costs memory.
"""

from __future__ import annotations

import mmap
import os
import re
from pathlib import Path

from devplugin_sdk.config import read_file
from devplugin_sdk.errors import ConfigError

# A PCI root bus in the device path, e.g. /sys/devices/pci0000:3a/0000:3a:02.0/0000:3b:00.0.
_ROOT_BUS = re.compile(r"^pci[0-9a-f]{4}:[0-9a-f]{2}$")

#: The largest attribute read, in bytes: the kernel formats a sysfs attribute into one page
#: (``sysfs_emit``), 4096 bytes on x86-64, 64 KiB on some arm64 and ppc64 kernels.
MAX_ATTR_BYTES = max(4096, mmap.PAGESIZE)

__all__ = [
    "MAX_ATTR_BYTES",
    "NUMA_NODE_ATTRIBUTE",
    "list_dir",
    "numa_attribute",
    "numa_node",
    "pci_device_dir",
    "pcie_root",
    "read_attr",
    "read_int",
    "read_link_name",
]


def read_attr(path: Path, limit: int = MAX_ATTR_BYTES) -> str | None:
    """Read a sysfs attribute without surrounding whitespace; None if missing, unreadable, not
    a regular file (checked before opening, and opened non-blocking) or over ``limit`` bytes
    (checked before reading; never more than ``limit`` + 1 bytes read)."""
    try:
        data = read_file(path, limit)
    except ConfigError:
        return None
    return data.decode("utf-8", errors="replace").strip()


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


#: The standard DRA attribute of a device's NUMA node, an int (KEP-6072, stable in 1.37; the name
#: dra-driver-cpu and NVIDIA's DRA driver publish): one ``matchAttribute`` on it keeps devices of
#: several drivers (a GPU and a NIC) on one NUMA node.
NUMA_NODE_ATTRIBUTE = "resource.kubernetes.io/numaNode"


def numa_attribute(nodes: int | tuple[int, ...] | None) -> dict[str, int]:
    """``{NUMA_NODE_ATTRIBUTE: node}`` for a device on exactly one known NUMA node, else empty
    (an unknown node is left out rather than guessed; a device on several has no one node)."""
    if isinstance(nodes, tuple):
        nodes = nodes[0] if len(nodes) == 1 else None
    return {} if nodes is None else {NUMA_NODE_ATTRIBUTE: nodes}


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
