"""What the generic backend reads from the host's trees: glob matches, USB devices, and the PCI
device behind a /dev node.

Blocking reads of /dev and sysfs, with every root a parameter so that tests point them at a fake
tree; call them from ``anyio.to_thread.run_sync``. Layouts from the kernel's sysfs ABI
(``Documentation/ABI``: ``sysfs-bus-usb``, ``sysfs-dev``, ``sysfs-bus-pci``) and
``drivers/base/core.c`` (``device_add``: the ``/sys/dev/{char,block}/MAJOR:MINOR`` links and
``DEVNAME`` in ``uevent``).
"""

from __future__ import annotations

import glob
import os
import re
import stat
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from devplugin_sdk.backends import _sysfs

__all__ = [
    "PciDevice",
    "UsbDevice",
    "first_of",
    "matches",
    "natural_key",
    "pci_device",
    "usable",
    "usb_class_nodes",
    "usb_devices",
]

_PCI_ADDRESS = re.compile(r"^[0-9a-f]{4,}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
_NATURAL = re.compile(r"(\d+)")


def natural_key(text: str) -> list[Any]:
    """Sort key putting ``x2`` before ``x10``."""
    return [int(piece) if piece.isdigit() else piece for piece in _NATURAL.split(text)]


def usable(path: str, directory_ok: bool = False) -> bool:
    """Whether ``path`` exists, following symlinks (one stat); a directory only if allowed."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    return directory_ok or not stat.S_ISDIR(mode)


def matches(pattern: str, directories: bool) -> list[str]:
    """The paths ``glob`` finds for ``pattern``, in natural order.

    Directories are left out unless ``directories``: containerd hands over every device node
    beneath a directory given as a device host path (``oci.WithDevices`` walks it). ``glob``
    lists dangling symlinks too; they are kept (and count as gone).
    """
    found = [str(Path(match)) for match in glob.glob(pattern)]
    if not directories:
        found = [path for path in found if not os.path.isdir(path)]
    return sorted(found, key=natural_key)


# ====================================================================== USB


@dataclass(frozen=True, slots=True)
class UsbDevice:
    """A USB device as ``/sys/bus/usb/devices/<name>`` shows it.

    Attributes:
        name: The kernel's name for it, the bus and port path (``1-1.4``; ``usb1`` for a root
            hub): stable while the device stays in that port.
        vendor: ``idVendor``, four lowercase hex digits.
        product: ``idProduct``, four lowercase hex digits.
        serial: ``serial``, None when the device reports none.
        devname: Its node relative to /dev (``bus/usb/001/005``).
        directory: Its real sysfs directory.
    """

    name: str
    vendor: str
    product: str
    serial: str | None
    devname: str
    directory: Path


def usb_devices(sysfs_root: Path) -> list[UsbDevice]:
    """Every USB device (not interface) under ``<sysfs_root>/bus/usb/devices``, by name."""
    base = sysfs_root / "bus" / "usb" / "devices"
    found: list[UsbDevice] = []
    for name in sorted(_sysfs.list_dir(base), key=natural_key):
        # Entries are links to devices (1-1.4, usb1) and to their interfaces (1-1.4:1.0); only
        # devices have idVendor.
        directory = base / name
        vendor = _sysfs.read_attr(directory / "idVendor")
        product = _sysfs.read_attr(directory / "idProduct")
        if vendor is None or product is None:
            continue
        devname = _devname(directory)
        if devname is None:
            # usbfs nodes are /dev/bus/usb/BBB/DDD, bus and device numbers in decimal
            # (drivers/usb/core/usb.c, usb_devnode).
            bus = _sysfs.read_int(directory / "busnum", 10)
            number = _sysfs.read_int(directory / "devnum", 10)
            if bus is None or number is None:
                continue
            devname = f"bus/usb/{bus:03d}/{number:03d}"
        found.append(
            UsbDevice(
                name=name,
                vendor=vendor.lower(),
                product=product.lower(),
                serial=_sysfs.read_attr(directory / "serial"),
                devname=devname,
                directory=Path(os.path.realpath(directory)),
            )
        )
    return found


def usb_class_nodes(device: UsbDevice, classes: Collection[str]) -> list[str]:
    """Nodes (relative to /dev) of the given classes on the device's interfaces, in order.

    A class device sits below an interface directory ``<name>:<config>.<interface>``, under a
    directory named after its class: ``1-1:1.0/ttyUSB0/tty/ttyUSB0`` (usb-serial),
    ``1-1:1.0/tty/ttyACM0`` (cdc-acm), ``1-1:1.0/0003:20A0:41E5.0001/hidraw/hidraw0``,
    ``1-1:1.0/sound/card1/controlC1``. Only real directories are walked, so the ``driver``,
    ``subsystem`` and hub ``port`` links never lead to another device's nodes.
    """
    if not classes:
        return []
    found: list[str] = []
    for entry in sorted(_sysfs.list_dir(device.directory), key=natural_key):
        if not entry.startswith(f"{device.name}:"):
            continue
        interface = device.directory / entry
        for directory, subdirectories, files in os.walk(interface):
            subdirectories.sort(key=natural_key)
            inside = Path(directory).relative_to(interface).parts
            # A node's directory holds "dev" (MAJOR:MINOR); its class is an ancestor's name.
            if "dev" in files and any(part in classes for part in inside[:-1]):
                found.append(_devname(Path(directory)) or Path(directory).name)
    return found


# ====================================================================== PCI


@dataclass(frozen=True, slots=True)
class PciDevice:
    """The PCI function a device node belongs to.

    Attributes:
        address: Its address, e.g. ``0000:03:00.0``.
        directory: Its real sysfs directory.
    """

    address: str
    directory: Path

    @property
    def vendor(self) -> str | None:
        """The PCI vendor ID, four lowercase hex digits (``1002``), or None if unreadable."""
        text = _sysfs.read_attr(self.directory / "vendor")
        if text is None:
            return None
        return text.lower().removeprefix("0x").zfill(4)

    @property
    def numa_nodes(self) -> tuple[int, ...]:
        """Its NUMA node, or nothing when the platform reports none (``numa_node`` is -1)."""
        node = _sysfs.numa_node(self.directory)
        return () if node is None else (node,)


def pci_device(sysfs_root: Path, path: str, devname: str) -> PciDevice | None:
    """The PCI function behind the node at ``path`` (``/dev/<devname>`` on the host), or None.

    A character or block node is looked up the way libudev does, through
    ``/sys/dev/{char,block}/MAJOR:MINOR``; otherwise (a node that is a plain file, as in a fake
    tree) through the class device of the node's name whose ``uevent`` says ``DEVNAME=<devname>``
    (``/sys/class/drm/renderD128``). The PCI function is the nearest ancestor of that device
    directory named like a PCI address: ``.../0000:03:00.0/drm/renderD128`` gives
    ``0000:03:00.0``. Virtual devices (``/sys/devices/virtual/kfd/kfd``) have none.
    """
    device = _node_device(sysfs_root, path, devname)
    if device is None:
        return None
    devices = Path(os.path.realpath(sysfs_root / "devices"))
    for directory in (device, *device.parents):
        if directory == devices or devices not in directory.parents:
            return None
        if _PCI_ADDRESS.match(directory.name):
            return PciDevice(directory.name, directory)
    return None  # pragma: no cover - the loop always reaches sysfs's devices directory


def _node_device(sysfs_root: Path, path: str, devname: str) -> Path | None:
    try:
        mode = os.stat(path)
    except OSError:
        return None
    if stat.S_ISCHR(mode.st_mode) or stat.S_ISBLK(mode.st_mode):
        kind = "char" if stat.S_ISCHR(mode.st_mode) else "block"
        number = f"{os.major(mode.st_rdev)}:{os.minor(mode.st_rdev)}"
        link = sysfs_root / "dev" / kind / number
        if os.path.isdir(link):
            return Path(os.path.realpath(link))
    name = devname.rsplit("/", 1)[-1]
    pattern = f"{glob.escape(str(sysfs_root))}/class/*/{glob.escape(name)}"
    for candidate in sorted(glob.glob(pattern)):
        if _devname(Path(candidate)) == devname:
            return Path(os.path.realpath(candidate))
    return None


def _devname(directory: Path) -> str | None:
    """``DEVNAME`` from a device directory's ``uevent`` (its node relative to /dev), or None."""
    text = _sysfs.read_attr(directory / "uevent")
    for line in (text or "").splitlines():
        key, _, value = line.partition("=")
        if key == "DEVNAME" and value:
            return value
    return None


def first_of(items: Sequence[str], count: int = 3) -> str:
    """``a, b, c and 2 more``: a short listing for log lines and health reasons."""
    shown = ", ".join(items[:count])
    return f"{shown} and {len(items) - count} more" if len(items) > count else shown
