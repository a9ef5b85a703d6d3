"""Fake sysfs/devfs trees of hosts with GPUs, USB devices and plain device nodes, for tests of the
generic backend (and of any plugin that reads DRM, USB or PCI sysfs).

Builds, under a temporary directory, what a real host shows: PCI functions under
``/sys/devices/pci*`` with the ``bus``/``class``/``dev`` symlinks that point at them, DRM class
devices (``card<N>``, ``renderD<N>``) below their PCI function, USB devices and interfaces below
their host controller with their tty and hidraw class devices, virtual devices
(``/sys/devices/virtual/kfd/kfd``), and the matching ``/dev`` nodes (regular files standing in for
character devices). Layouts follow the kernel: ``Documentation/ABI/stable/sysfs-bus-usb``,
``drivers/base/core.c`` (``dev``, ``uevent``, ``/sys/dev/char``), ``drivers/gpu/drm/drm_sysfs.c``
and ``drm_drv.c`` (DRM minors), ``drivers/usb/core/usb.c``, ``drivers/usb/serial/usb-serial.c``,
``drivers/usb/class/cdc-acm.c``, ``drivers/hid/hidraw.c``.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

__all__ = ["DeviceHost", "UsbPlug", "amd_gpu_host", "solarflare_host", "usb_host"]

# Character device majors: DRM 226 (card minors from 0, render minors from 128, drm_drv.c),
# usb_device 189 (minor (bus-1)*128 + dev-1, usb.c), ttyUSB 188, ttyACM 166; hidraw, kfd and
# the onload devices get dynamic majors, shown here as a typical boot gives them.
DRM_MAJOR = 226
_USB_DEVICE_MAJOR = 189
_TTY_USB_MAJOR = 188
_TTY_ACM_MAJOR = 166
_HIDRAW_MAJOR = 241
# PCI class codes (sysfs "class"): 0x030000 VGA controller, 0x038000 display controller (AMD
# Instinct), 0x020000 Ethernet, 0x0c0330 USB xHCI, 0x060400 PCI bridge.
_PCI_CLASS_VGA = "0x030000"
_PCI_CLASS_DISPLAY = "0x038000"
_PCI_CLASS_ETHERNET = "0x020000"
_PCI_CLASS_XHCI = "0x0c0330"
_PCI_CLASS_BRIDGE = "0x060400"


@dataclass(frozen=True, slots=True)
class UsbPlug:
    """A USB device plugged into a fake host.

    Attributes:
        port: Its kernel name, the bus and port path (``1-4.2``).
        devname: Its usbfs node relative to /dev (``bus/usb/001/004``).
        nodes: Class nodes on its interfaces, relative to /dev (``ttyUSB0``, ``hidraw0``).
    """

    port: str
    devname: str
    nodes: tuple[str, ...] = ()


class DeviceHost:
    """A fake host: ``<root>/sys`` and ``<root>/dev``, filled by the ``add_*`` methods.

    Every path a real host has as a symlink is a symlink here (``/sys/bus/*/devices/<name>``,
    ``/sys/class/*/<name>``, ``/sys/dev/char/<major>:<minor>``, ``device``, ``driver``,
    ``subsystem``); ``/dev`` nodes are regular files standing in for character devices.

    Args:
        root: An empty directory (e.g. pytest's ``tmp_path``).
    """

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.sysfs_root = self.root / "sys"
        self.dev_root = self.root / "dev"
        self.usb: dict[str, UsbPlug] = {}
        self._usb_dirs: dict[str, Path] = {}
        self._next_devnum: dict[int, int] = {}
        self._hid_instances = 0
        for directory in ("bus/pci/devices", "bus/usb/devices", "class", "dev/char"):
            (self.sysfs_root / directory).mkdir(parents=True, exist_ok=True)
        self.dev_root.mkdir(parents=True, exist_ok=True)

    # ------------------------------------------------------------------ PCI and DRM

    def add_pci_function(
        self,
        address: str,
        *,
        vendor: str,
        device: str,
        pci_class: str,
        driver: str | None,
        numa_node: int = -1,
        upstream: tuple[str, ...] = (),
    ) -> Path:
        """Add a PCI function (and the bridges above it); return its sysfs directory.

        Args:
            address: Its address, e.g. ``0000:03:00.0``.
            vendor: Vendor ID as sysfs prints it (``0x1002`` AMD, ``0x1a03`` ASPEED).
            device: Device ID (``0x740f`` Instinct MI210).
            pci_class: Class code (``0x038000``).
            driver: Bound driver, or None.
            numa_node: Its NUMA node (-1: the platform reports none).
            upstream: Addresses of the root port and switch ports above it, top first.
        """
        # The root bus is the bus of the topmost function: pci0000:00 holds 0000:00:01.1.
        domain, bus = (upstream[0] if upstream else address).split(":")[:2]
        parent = self.sysfs_root / "devices" / f"pci{domain}:{bus}"
        for bridge in upstream:
            parent = parent / bridge
            if not parent.exists():
                self._pci_files(
                    parent,
                    address=bridge,
                    vendor="0x1022",
                    device="0x1483",
                    pci_class=_PCI_CLASS_BRIDGE,
                    driver="pcieport",
                    numa_node=numa_node,
                )
        directory = parent / address
        self._pci_files(
            directory,
            address=address,
            vendor=vendor,
            device=device,
            pci_class=pci_class,
            driver=driver,
            numa_node=numa_node,
        )
        return directory

    def _pci_files(
        self,
        directory: Path,
        *,
        address: str,
        vendor: str,
        device: str,
        pci_class: str,
        driver: str | None,
        numa_node: int,
    ) -> None:
        up = self._up(directory)
        # Documentation/ABI/testing/sysfs-bus-pci.
        _write(directory / "vendor", vendor)
        _write(directory / "device", device)
        _write(directory / "class", pci_class)
        _write(directory / "numa_node", str(numa_node))
        _write(directory / "enable", "1")
        uevent = (
            f"PCI_CLASS={pci_class[2:].upper()}\nPCI_ID={vendor[2:].upper()}:{device[2:].upper()}"
        )
        uevent += f"\nPCI_SLOT_NAME={address}"
        _write(directory / "uevent", f"DRIVER={driver}\n{uevent}" if driver else uevent)
        _link(directory / "subsystem", f"{up}/bus/pci")
        if driver is not None:
            _link(directory / "driver", f"{up}/bus/pci/drivers/{driver}")
        relative = directory.relative_to(self.sysfs_root)
        _link(self.sysfs_root / "bus/pci/devices" / address, f"../../../{relative}")

    def add_drm_card(self, address: str, *, card: int, render: int | None) -> None:
        """Add the DRM minors of the PCI function at ``address``: ``card<card>`` and, for a
        driver with render nodes, ``renderD<render>`` (128 and up), with their /dev/dri nodes."""
        function = Path(os.path.realpath(self.sysfs_root / "bus/pci/devices" / address))
        minors = [f"card{card}"] + ([f"renderD{render}"] if render is not None else [])
        for name in minors:
            minor = card if name.startswith("card") else render
            assert minor is not None
            self._class_device(
                function / "drm" / name,
                "drm",
                f"dri/{name}",
                DRM_MAJOR,
                minor,
                devtype="drm_minor",
            )
            # <minor>/device -> the PCI function (drm_sysfs.c: the minor's parent).
            _link(function / "drm" / name / "device", f"../../../{address}")
            # udev's by-path links (60-drm.rules): /dev/dri/by-path/pci-<address>-card.
            kind = "card" if name.startswith("card") else "render"
            _link(self.dev_root / "dri" / "by-path" / f"pci-{address}-{kind}", f"../{name}")
        _write(self.sysfs_root / "class" / "drm" / "version", "drm 1.1.0 20060810")

    def add_virtual_node(self, class_name: str, name: str, major: int, minor: int = 0) -> None:
        """Add a class device with no parent (``/sys/devices/virtual/<class>/<name>``) and its
        node ``/dev/<name>``: ``kfd``, misc devices such as ``onload``."""
        directory = self.sysfs_root / "devices" / "virtual" / class_name / name
        self._class_device(directory, class_name, name, major, minor)

    # ------------------------------------------------------------------ USB

    def add_usb_controller(self, address: str = "0000:00:14.0", *, bus: int = 1) -> None:
        """Add an xHCI controller with its USB 2 root hub ``usb<bus>`` (1d6b:0002)."""
        function = self.add_pci_function(
            address,
            vendor="0x8086",
            device="0xa36d",
            pci_class=_PCI_CLASS_XHCI,
            driver="xhci_hcd",
            numa_node=0,
        )
        # The root hub's serial is the controller's PCI address (hcd.c).
        devname = self._usb_device(
            function / f"usb{bus}",
            port=f"usb{bus}",
            bus=bus,
            vendor="1d6b",
            product="0002",
            serial=address,
            name="xHCI Host Controller",
        )
        _write(self.dev_root / devname, "")

    def plug_usb(
        self,
        port: str,
        *,
        vendor: str,
        product: str,
        serial: str | None = None,
        name: str = "",
        tty: str | None = None,
        hidraw: str | None = None,
        hub: bool = False,
    ) -> UsbPlug:
        """Plug a USB device into ``port`` (``1-1``, or ``1-4.2`` behind the hub at ``1-4``).

        Args:
            port: Bus and port path; the bus's controller, and a hub at a parent port, must be
                there already.
            vendor: ``idVendor``, four hex digits.
            product: ``idProduct``, four hex digits.
            serial: Its ``serial`` attribute, or None for a device that reports none.
            name: Its ``product`` string.
            tty: A serial port on interface 0: ``ttyUSB<N>`` (usb-serial, e.g. FTDI) or
                ``ttyACM<N>`` (cdc-acm, e.g. an Arduino).
            hidraw: A HID interface 0 with this ``hidraw<N>`` node.
            hub: Interface 0 is a hub's (devices can then be plugged in behind it).

        Returns:
            The plugged device: its usbfs node and class nodes.
        """
        bus = int(port.split("-", 1)[0])
        parent_port = port.rsplit(".", 1)[0] if "." in port else f"usb{bus}"
        parent = self._usb_dirs[parent_port]
        directory = parent / port
        devname = self._usb_device(
            directory,
            port=port,
            bus=bus,
            vendor=vendor,
            product=product,
            serial=serial,
            name=name,
        )
        interface = directory / f"{port}:1.0"
        nodes: list[str] = []
        if tty is not None and tty.startswith("ttyUSB"):
            # usb-serial: the port device ttyUSB<N>, then its tty class device (usb-serial.c).
            self._usb_interface(interface, "ffffff", "ftdi_sio")
            tty_dir = interface / tty / "tty" / tty
            self._class_device(tty_dir, "tty", tty, _TTY_USB_MAJOR, int(tty[6:]), node=False)
            nodes.append(tty)
        elif tty is not None:
            # cdc-acm: the tty class device right under the interface (cdc-acm.c).
            self._usb_interface(interface, "020201", "cdc_acm")
            tty_dir = interface / "tty" / tty
            self._class_device(tty_dir, "tty", tty, _TTY_ACM_MAJOR, int(tty[6:]), node=False)
            nodes.append(tty)
        if tty is None and hidraw is None:
            self._usb_interface(interface, "090000" if hub else "ff0000", "hub" if hub else None)
        if hidraw is not None:
            # A HID device named BUS:VENDOR:PRODUCT.INSTANCE, then hidraw (hid-core.c, hidraw.c).
            self._usb_interface(interface, "030000", "usbhid")
            self._hid_instances += 1
            hid = interface / f"0003:{vendor.upper()}:{product.upper()}.{self._hid_instances:04X}"
            minor = int(hidraw[6:])
            self._class_device(
                hid / "hidraw" / hidraw, "hidraw", hidraw, _HIDRAW_MAJOR, minor, node=False
            )
            nodes.append(hidraw)
        # udev makes the nodes once the kernel has announced the device: class nodes, then
        # the usbfs node last, so that a watcher woken by it reads a complete device.
        for node in (*nodes, devname):
            _write(self.dev_root / node, "")
        plug = UsbPlug(port, devname, tuple(nodes))
        self.usb[port] = plug
        return plug

    def unplug_usb(self, port: str) -> None:
        """Unplug the device at ``port``: its sysfs directories, links and /dev nodes go, nodes
        first (udev removes a node when the kernel reports the device gone)."""
        plug = self.usb.pop(port)
        for devname in (*plug.nodes, plug.devname):
            (self.dev_root / devname).unlink(missing_ok=True)
        shutil.rmtree(self._usb_dirs.pop(port))
        # The links to what went (its interfaces, class devices, /sys/dev/char entries).
        for link in (
            *self.sysfs_root.glob("class/*/*"),
            *(self.sysfs_root / "bus/usb/devices").iterdir(),
            *(self.sysfs_root / "dev/char").iterdir(),
        ):
            if link.is_symlink() and not link.exists():
                link.unlink()
        for name in [name for name, path in self._usb_dirs.items() if not path.exists()]:
            del self._usb_dirs[name]

    def _usb_device(
        self,
        directory: Path,
        *,
        port: str,
        bus: int,
        vendor: str,
        product: str,
        serial: str | None,
        name: str,
    ) -> str:
        devnum = self._next_devnum.get(bus, 1)
        self._next_devnum[bus] = devnum + 1
        devname = f"bus/usb/{bus:03d}/{devnum:03d}"
        # Documentation/ABI/stable/sysfs-bus-usb and usb.c (usb_dev_uevent).
        _write(directory / "idVendor", vendor)
        _write(directory / "idProduct", product)
        _write(directory / "bcdDevice", "0100")
        _write(directory / "busnum", str(bus))
        _write(directory / "devnum", str(devnum))
        _write(directory / "speed", "12")
        if name:
            _write(directory / "product", name)
        if serial is not None:
            _write(directory / "serial", serial)
        minor = (bus - 1) * 128 + devnum - 1
        _write(directory / "dev", f"{_USB_DEVICE_MAJOR}:{minor}")
        _write(
            directory / "uevent",
            f"MAJOR={_USB_DEVICE_MAJOR}\nMINOR={minor}\nDEVNAME={devname}\nDEVTYPE=usb_device\n"
            f"DRIVER=usb\nPRODUCT={int(vendor, 16):x}/{int(product, 16):x}/100\nTYPE=0/0/0\n"
            f"BUSNUM={bus:03d}\nDEVNUM={devnum:03d}",
        )
        up = self._up(directory)
        _link(directory / "subsystem", f"{up}/bus/usb")
        _link(directory / "driver", f"{up}/bus/usb/drivers/usb")
        relative = directory.relative_to(self.sysfs_root)
        _link(self.sysfs_root / "bus/usb/devices" / port, f"../../../{relative}")
        _link(self.sysfs_root / "dev/char" / f"{_USB_DEVICE_MAJOR}:{minor}", f"../../{relative}")
        self._usb_dirs[port] = directory
        return devname

    def _usb_interface(self, interface: Path, klass: str, driver: str | None) -> None:
        _write(interface / "bInterfaceNumber", "00")
        _write(interface / "bInterfaceClass", klass[:2])
        _write(interface / "bInterfaceSubClass", klass[2:4])
        _write(interface / "bInterfaceProtocol", klass[4:])
        driven = f"\nDRIVER={driver}" if driver is not None else ""
        _write(interface / "uevent", f"DEVTYPE=usb_interface{driven}")
        up = self._up(interface)
        _link(interface / "subsystem", f"{up}/bus/usb")
        if driver is not None:
            _link(interface / "driver", f"{up}/bus/usb/drivers/{driver}")
        relative = interface.relative_to(self.sysfs_root)
        _link(self.sysfs_root / "bus/usb/devices" / interface.name, f"../../../{relative}")

    # ------------------------------------------------------------------ nodes

    def remove_node(self, devname: str) -> None:
        """Remove ``/dev/<devname>`` (a driver unloaded, a node deleted)."""
        (self.dev_root / devname).unlink()

    def restore_node(self, devname: str) -> None:
        """Create ``/dev/<devname>`` again."""
        _write(self.dev_root / devname, "")

    def _class_device(
        self,
        directory: Path,
        class_name: str,
        devname: str,
        major: int,
        minor: int,
        *,
        devtype: str | None = None,
        node: bool = True,
    ) -> None:
        """A class device with a node: ``dev``, ``uevent`` (MAJOR, MINOR, DEVNAME), the class
        and ``/sys/dev/char`` links, and (with ``node``) ``/dev/<devname>``
        (drivers/base/core.c)."""
        _write(directory / "dev", f"{major}:{minor}")
        uevent = f"MAJOR={major}\nMINOR={minor}\nDEVNAME={devname}"
        _write(directory / "uevent", uevent + (f"\nDEVTYPE={devtype}" if devtype else ""))
        up = self._up(directory)
        _link(directory / "subsystem", f"{up}/class/{class_name}")
        relative = directory.relative_to(self.sysfs_root)
        _link(self.sysfs_root / "class" / class_name / directory.name, f"../../{relative}")
        _link(self.sysfs_root / "dev/char" / f"{major}:{minor}", f"../../{relative}")
        if node:
            _write(self.dev_root / devname, "")

    def _up(self, directory: Path) -> str:
        """``..`` as many times as ``directory`` is deep below /sys."""
        return "/".join([".."] * len(directory.relative_to(self.sysfs_root).parts))


def amd_gpu_host(root: Path) -> DeviceHost:
    """A server with two AMD Instinct MI210 GPUs and a BMC display.

    The GPUs (``0000:03:00.0`` on NUMA node 0, ``0000:83:00.0`` on node 1, each behind a root
    port and a switch, amdgpu bound) have ``card1``/``renderD128`` and ``card2``/``renderD129``;
    the ASPEED BMC display (``0000:c4:00.0``, ast) has ``card0`` and no render node, as ast
    drives no render node; ``/dev/kfd`` is the virtual kfd device ROCm opens.
    """
    host = DeviceHost(root)
    host.add_pci_function(
        "0000:c4:00.0",
        vendor="0x1a03",
        device="0x2000",
        pci_class=_PCI_CLASS_VGA,
        driver="ast",
        numa_node=1,
        upstream=("0000:c0:07.1", "0000:c3:00.0"),
    )
    host.add_drm_card("0000:c4:00.0", card=0, render=None)
    for index, (address, node, ports) in enumerate(
        [
            ("0000:03:00.0", 0, ("0000:00:01.1", "0000:01:00.0", "0000:02:00.0")),
            ("0000:83:00.0", 1, ("0000:80:01.1", "0000:81:00.0", "0000:82:00.0")),
        ]
    ):
        host.add_pci_function(
            address,
            vendor="0x1002",
            device="0x740f",
            pci_class=_PCI_CLASS_DISPLAY,
            driver="amdgpu",
            numa_node=node,
            upstream=ports,
        )
        host.add_drm_card(address, card=index + 1, render=128 + index)
    host.add_virtual_node("kfd", "kfd", 234)
    return host


def solarflare_host(root: Path) -> DeviceHost:
    """A host with a Solarflare X2522 NIC (sfc) and Onload loaded: ``/dev/onload``,
    ``/dev/onload_epoll`` (onload.ko) and ``/dev/sfc_char`` (sfc_char.ko), misc-class devices."""
    host = DeviceHost(root)
    for function in ("0000:3b:00.0", "0000:3b:00.1"):
        host.add_pci_function(
            function,
            vendor="0x1924",
            device="0x1b03",
            pci_class=_PCI_CLASS_ETHERNET,
            driver="sfc",
            numa_node=0,
            upstream=("0000:3a:00.0",),
        )
    for minor, name in enumerate(("onload", "onload_epoll", "sfc_char"), start=60):
        host.add_virtual_node("misc", name, 10, minor)
    return host


def usb_host(root: Path) -> DeviceHost:
    """A host with one xHCI controller (bus 1) and four devices plugged in: a BlinkStick
    (20a0:41e5, hidraw0) at ``1-1``, an Arduino Uno (2341:0043, ttyACM0) at ``1-3``, a hub
    (05e3:0610) at ``1-4`` and an FTDI FT232R serial adapter (0403:6001, ttyUSB0) behind it at
    ``1-4.2``."""
    host = DeviceHost(root)
    host.add_usb_controller()
    host.plug_usb(
        "1-1",
        vendor="20a0",
        product="41e5",
        serial="BS030514-3.1",
        name="BlinkStick",
        hidraw="hidraw0",
    )
    host.plug_usb(
        "1-3",
        vendor="2341",
        product="0043",
        serial="85036313530351D0E1D1",
        name="Arduino Uno",
        tty="ttyACM0",
    )
    host.plug_usb("1-4", vendor="05e3", product="0610", name="USB2.1 Hub", hub=True)
    host.plug_usb(
        "1-4.2",
        vendor="0403",
        product="6001",
        serial="A50285BI",
        name="FT232R USB UART",
        tty="ttyUSB0",
    )
    return host


def _write(path: Path, text: str) -> None:
    """Write an attribute the way sysfs shows it: the value and a newline."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n" if text else "", encoding="utf-8")


def _link(path: Path, target: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_symlink():
        path.unlink()
    os.symlink(target, path)
