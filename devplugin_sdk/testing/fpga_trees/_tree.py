"""The sysfs and /dev plumbing every FPGA card family shares: files written as the kernel's show()
functions print them, relative symlinks, /dev nodes as empty files, PCI functions under their root
port, char devices, fpga_region class devices and platform devices; and what one card added, so
that it can be unplugged and plugged back.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

# DRM minors: card<N> is 226:N, renderD<M> is 226:M with M from 128 (drivers/gpu/drm/drm_drv.c).
_DRM_MAJOR = 226
# xclmgmt and the DFL FME/port char devices get dynamic majors (alloc_chrdev_region); any
# free number does here.
_XCLMGMT_MAJOR = 239
_DFL_FME_MAJOR = 509
_DFL_PORT_MAJOR = 510
# PCI class 0x1200: processing accelerator (pkg/fpga/pci_linux.go fpgaClass "0x120000").
_ACCELERATOR_CLASS = "0x120000"


def _write(path: Path, text: str, *, newline: bool = True) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    # show() functions print their value followed by a newline, with a few exceptions.
    path.write_text(text + "\n" if newline else text, encoding="utf-8")


def _node(path: Path) -> None:
    """A /dev node: a regular empty file stands in for the character device."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch()


def _link(link: Path, target: Path) -> None:
    """Create ``link`` pointing at ``target`` with a relative path, as sysfs does."""
    link.parent.mkdir(parents=True, exist_ok=True)
    if link.is_symlink():
        link.unlink()
    os.symlink(os.path.relpath(target, link.parent), link)


def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8").strip()


def _remove(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)


@dataclass
class _Created:
    """What one board added to the tree, so it can be unplugged and plugged back."""

    paths: list[Path] = field(default_factory=list)
    build: Callable[[], None] | None = None

    def remove(self) -> None:
        # Children first: links and nodes, then the device directories.
        for path in reversed(self.paths):
            _remove(path)
        self.paths.clear()


class _Tree:
    """A fake host's ``<root>/sys`` and ``<root>/dev``, with the numbering its cards share.

    Args:
        root: An empty directory (e.g. pytest's ``tmp_path``).
    """

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.sysfs_root = self.root / "sys"
        self.dev_root = self.root / "dev"
        self._next_render = 128
        self._next_card = 0
        self._next_region = 0
        self._next_fme = 0
        self._next_port = 0
        self._next_bridge = 0
        for sub in ("bus/pci/devices", "bus/platform/devices", "class/drm", "dev/char"):
            (self.sysfs_root / sub).mkdir(parents=True, exist_ok=True)
        self.dev_root.mkdir(parents=True, exist_ok=True)

    # ------------------------------------------------------------------ PCI

    def _root_port_dir(self, root_port: str) -> Path:
        """``sys/devices/pci<domain>:<bus>/<root port>`` (the host bridge, then the port)."""
        domain, bus, _ = root_port.split(":")
        return self.sysfs_root / "devices" / f"pci{domain}:{bus}" / root_port

    def _pci_function(
        self,
        created: _Created,
        address: str,
        *,
        root_port: str,
        vendor: str,
        device: str,
        subsystem_device: str,
        driver: str | None,
        numa_node: int,
    ) -> Path:
        dev_dir = self._root_port_dir(root_port) / address
        created.paths.append(dev_dir)
        # Documentation/ABI/testing/sysfs-bus-pci; pci_uevent() in drivers/pci/pci-driver.c.
        _write(dev_dir / "vendor", vendor)
        _write(dev_dir / "device", device)
        _write(dev_dir / "subsystem_vendor", vendor)
        _write(dev_dir / "subsystem_device", subsystem_device)
        _write(dev_dir / "class", _ACCELERATOR_CLASS)
        _write(dev_dir / "numa_node", str(numa_node))
        _write(dev_dir / "local_cpulist", "0-23,48-71" if numa_node <= 0 else "24-47,72-95")
        _write(dev_dir / "enable", "1")
        pci_id = f"{vendor[2:].upper()}:{device[2:].upper()}"
        uevent = [
            f"PCI_CLASS={_ACCELERATOR_CLASS[2:].upper()}",
            f"PCI_ID={pci_id}",
            f"PCI_SUBSYS_ID={vendor[2:].upper()}:{subsystem_device[2:].upper()}",
            f"PCI_SLOT_NAME={address}",
        ]
        if driver is not None:
            uevent.insert(0, f"DRIVER={driver}")
            _link(dev_dir / "driver", self.sysfs_root / "bus/pci/drivers" / driver)
            back = self.sysfs_root / "bus/pci/drivers" / driver / address
            _link(back, dev_dir)
            created.paths.append(back)
        _write(dev_dir / "uevent", "\n".join(uevent))
        _link(dev_dir / "subsystem", self.sysfs_root / "bus/pci")
        bus_link = self.sysfs_root / "bus/pci/devices" / address
        _link(bus_link, dev_dir)
        created.paths.append(bus_link)
        return dev_dir

    def _char_node(
        self, created: _Created, device_dir: Path, major: int, minor: int, devname: str
    ) -> None:
        """``dev`` attribute, ``/sys/dev/char/M:m`` link and the /dev node of a char device."""
        _write(device_dir / "dev", f"{major}:{minor}")
        char_link = self.sysfs_root / "dev/char" / f"{major}:{minor}"
        _link(char_link, device_dir)
        node = self.dev_root / devname
        _node(node)
        created.paths.extend([char_link, node])

    def _fpga_region(self, created: _Created, region_dir: Path, parent: Path) -> None:
        """An fpga_region class device (drivers/fpga/fpga-region.c) and its class link."""
        _link(region_dir / "subsystem", self.sysfs_root / "class/fpga_region")
        _link(region_dir / "device", parent)
        _write(region_dir / "uevent", "", newline=False)
        class_link = self.sysfs_root / "class/fpga_region" / region_dir.name
        _link(class_link, region_dir)
        created.paths.append(class_link)

    def _platform_device(self, created: _Created, device_dir: Path, driver: str | None) -> None:
        platform = self.sysfs_root / "bus/platform"
        _link(device_dir / "subsystem", platform)
        if driver is not None:
            _link(device_dir / "driver", platform / "drivers" / driver)
        bus_link = platform / "devices" / device_dir.name
        _link(bus_link, device_dir)
        created.paths.append(bus_link)
