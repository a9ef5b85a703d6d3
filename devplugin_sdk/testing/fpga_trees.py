"""Fake sysfs/devfs trees of FPGA hosts (AMD/Xilinx Alveo under XRT, Intel FPGAs under DFL).

Builds, under a temporary directory, the files, symlinks and /dev nodes a real host shows: PCI
functions under ``sys/devices/pci*`` with their ``bus``/``class``/``dev/char`` symlinks,
``driver``/``subsystem``/``device`` links, the xocl/xclmgmt attributes and ROM sub-device, the
DRM render node, and the DFL base region with its FME, FME PR region and ports. Layouts follow
the sources cited in ``devplugin_sdk/backends/fpga.py``; character devices are regular files.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "DFL_INTERFACE_ID",
    "NLB0_AFU_ID",
    "NLB3_AFU_ID",
    "U250_VBNV",
    "AlveoBoard",
    "DflCard",
    "FpgaHost",
    "alveo_u250_host",
    "dfl_pac_host",
]

# Shell of an Alveo U250 with the 2018.3 XDMA platform, as its feature ROM reports it.
U250_VBNV = "xilinx_u250_xdma_201830_2"
U250_TIMESTAMP = "1561465320"
# AFU IDs of Intel's native loopback samples (OPAE quick start: nlb_mode_0 reads
# d8424dc4a4a3c413f89e433683f9040b from /sys/class/fpga_region/region0/dfl-port.0/afu_id).
NLB0_AFU_ID = "d8424dc4a4a3c413f89e433683f9040b"
NLB3_AFU_ID = "f7df405cbd7acf7222f144b0b93acd18"
DFL_INTERFACE_ID = "69528db6eb31577a8c3668f9faa081f6"

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


def _xocl_instance(address: str) -> int:
    domain, bus, devfn = address.split(":")
    dev, fn = devfn.split(".")
    return (int(domain, 16) << 16) | (int(bus, 16) << 8) | (int(dev, 16) << 3) | int(fn, 16)


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


@dataclass
class AlveoBoard:
    """An Alveo board of a fake host: a management and a user PCI function.

    Attributes:
        slot: ``domain:bus:device`` shared by both functions.
        mgmt_address: The management function (xclmgmt), ``<slot>.0``.
        user_address: The user function (xocl), ``<slot>.1``.
        mgmt_dir: Real sysfs directory of the management function.
        user_dir: Real sysfs directory of the user function.
        render_node: Render node name (``renderD128``); its /dev node is ``dri/<name>``.
        mgmt_node: Management node name (``xclmgmt<instance>``).
        dev_root: The host's /dev directory.
    """

    slot: str
    mgmt_address: str
    user_address: str
    mgmt_dir: Path
    user_dir: Path
    render_node: str
    mgmt_node: str
    dev_root: Path
    _created: _Created = field(default_factory=_Created, repr=False)

    def set_offline(self, offline: bool) -> None:
        """Write ``dev_offline`` on both functions, as the drivers do around a reset."""
        for function_dir in (self.mgmt_dir, self.user_dir):
            _write(function_dir / "dev_offline", "1" if offline else "0")

    def set_ready(self, ready: bool) -> None:
        """Write ``ready``: xocl prints ``0x%llx`` (mailbox up), xclmgmt ``%d``."""
        _write(self.user_dir / "ready", "0x1" if ready else "0x0")
        _write(self.mgmt_dir / "ready", "1" if ready else "0")

    def set_vbnv(self, vbnv: str) -> None:
        """Change the shell name both ROM sub-devices report (a new shell was flashed)."""
        for function_dir in (self.mgmt_dir, self.user_dir):
            for entry in function_dir.iterdir():
                if entry.name.startswith("rom."):
                    _write(entry / "VBNV", vbnv)

    def unplug(self) -> None:
        """Remove both functions from sysfs and their nodes from /dev (hot-unplug)."""
        self._created.remove()

    def replug(self) -> None:
        """Add the board back as it was first built."""
        if self._created.build is not None and not self._created.paths:
            self._created.build()


@dataclass
class DflCard:
    """A DFL FPGA card of a fake host: one PCI function, its base region, FME and ports.

    Attributes:
        pci_address: The card's PCI function.
        pci_dir: Its real sysfs directory.
        base_region: Base region name (``regionN``) under /sys/class/fpga_region.
        fme: FME name (``dfl-fme.N``).
        fme_regions: The FME's PR region names (one per port).
        ports: Port names (``dfl-port.N``), in port-ID order.
        dev_root: The host's /dev directory.
    """

    pci_address: str
    pci_dir: Path
    base_region: str
    fme: str
    fme_regions: list[str]
    ports: list[str]
    dev_root: Path
    _created: _Created = field(default_factory=_Created, repr=False)

    @property
    def region_dir(self) -> Path:
        """The base region's real sysfs directory."""
        return self.pci_dir / "fpga_region" / self.base_region

    def set_afu_id(self, port: int, afu_id: str) -> None:
        """Change the AFU ID port ``port`` (index in ``ports``) reports (PR, or a crash)."""
        _write(self.region_dir / self.ports[port] / "afu_id", afu_id)

    def set_interface_id(self, interface_id: str) -> None:
        """Change the compat_id of every FME PR region of the card."""
        fme_dir = self.region_dir / self.fme
        for entry in fme_dir.iterdir():
            if entry.name.startswith("dfl-fme-region."):
                for region in (entry / "fpga_region").iterdir():
                    _write(region / "compat_id", interface_id)

    def remove_port_node(self, port: int) -> None:
        """Delete ``/dev/dfl-port.N`` (the node vanished, e.g. a udev rule or a bad mount)."""
        (self.dev_root / self.ports[port]).unlink()

    def restore_port_node(self, port: int) -> None:
        """Create ``/dev/dfl-port.N`` again."""
        _node(self.dev_root / self.ports[port])

    def unplug(self) -> None:
        """Remove the card from sysfs and its nodes from /dev (hot-unplug)."""
        self._created.remove()

    def replug(self) -> None:
        """Add the card back as it was first built."""
        if self._created.build is not None and not self._created.paths:
            self._created.build()


class FpgaHost:
    """A fake FPGA host: ``<root>/sys`` and ``<root>/dev``, filled by ``add_alveo`` and
    ``add_dfl_card``.

    Every path a real host has as a symlink is one here (``/sys/bus/pci/devices/<addr>``,
    ``/sys/class/<class>/<name>``, ``/sys/bus/platform/devices/<name>``, ``/sys/dev/char/M:m``,
    ``driver``, ``subsystem``, ``device``). A base region's ``compat_id``, which exists on a
    real host but fails to read with ENOENT (sysfs-class-fpga-region), is a dangling symlink,
    which fails the same way.

    Args:
        root: An empty directory (e.g. pytest's ``tmp_path``).
    """

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.sysfs_root = self.root / "sys"
        self.dev_root = self.root / "dev"
        self.alveo: dict[str, AlveoBoard] = {}
        self.dfl: dict[str, DflCard] = {}
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

    def _base_region(self, created: _Created, pci_dir: Path, name: str) -> Path:
        # dfl-pci registers the base region under the PCI device; the feature devices
        # (FME, ports) are platform devices under it (dfl.c build_info_create_dev).
        region_dir = pci_dir / "fpga_region" / name
        self._fpga_region(created, region_dir, pci_dir)
        # No compat_id on a base region: the attribute exists but reads fail with ENOENT.
        os.symlink("compat_id.ENOENT", region_dir / "compat_id")
        return region_dir

    def _dfl_port(self, created: _Created, port_dir: Path, port_id: int, afu_id: str) -> None:
        port = port_dir.name
        minor = int(port.rsplit(".", 1)[1])
        self._platform_device(created, port_dir, "dfl-port")
        _write(
            port_dir / "uevent",
            f"MAJOR={_DFL_PORT_MAJOR}\nMINOR={minor}\n"
            f"DEVNAME={port}\nDRIVER=dfl-port\nMODALIAS=platform:dfl-port",
        )
        # sysfs-platform-dfl-port: id "%d", afu_id "%016llx%016llx", power_state, ap1_event,
        # ap2_event, ltr; errors/ "0x%llx".
        _write(port_dir / "id", str(port_id))
        _write(port_dir / "afu_id", afu_id)
        _write(port_dir / "power_state", "0")
        _write(port_dir / "ap1_event", "0")
        _write(port_dir / "ap2_event", "0")
        _write(port_dir / "ltr", "0")
        for name in ("errors", "first_error", "first_malformed_req"):
            _write(port_dir / "errors" / name, "0x0")
        self._char_node(created, port_dir, _DFL_PORT_MAJOR, minor, port)

    def add_dfl_vf(
        self, card: DflCard, vf_address: str, *, port: int = 0, device: str = "0x0b2c"
    ) -> DflCard:
        """Move port ``port`` of ``card`` to a new SR-IOV VF, as after DFL_FPGA_FME_PORT_RELEASE
        and ``echo 1 > sriov_numvfs`` (Documentation/fpga/dfl.rst "FPGA virtualization").

        The PF keeps its FME and loses the port; the VF gets a base region of its own holding
        the port and no FME. Not undone by ``card.replug()``.

        Args:
            card: The PF's card.
            vf_address: The VF's PCI address (same bus as the PF).
            port: Index in ``card.ports`` of the port to move.
            device: The VF's PCI device ID (0x0b2c: PAC D5005 VF, 0x0b31: PAC N3000 VF).

        Returns:
            The VF as a card without FME.
        """
        name = card.ports[port]
        afu_id = _read(card.region_dir / name / "afu_id")
        port_id = int(_read(card.region_dir / name / "id"))
        created = card._created
        for link in (self.dev_root / name, self.sysfs_root / "bus/platform/devices" / name):
            _remove(link)
        for char in (self.sysfs_root / "dev/char").iterdir():
            if char.is_symlink() and char.resolve() == (card.region_dir / name).resolve():
                _remove(char)
        shutil.rmtree(card.region_dir / name)
        card.ports.remove(name)
        base = f"region{self._next_region}"
        self._next_region += 1
        root_port = card.pci_dir.parent.name
        vf_dir = self._pci_function(
            created,
            vf_address,
            root_port=root_port,
            vendor="0x8086",
            device=device,
            subsystem_device="0x0000",
            driver="dfl-pci",
            numa_node=int(_read(card.pci_dir / "numa_node")),
        )
        # SR-IOV links: <vf>/physfn -> ../<pf>, <pf>/virtfnN -> ../<vf> (drivers/pci/iov.c).
        _link(vf_dir / "physfn", card.pci_dir)
        index = int(_read(card.pci_dir / "sriov_numvfs"))
        _link(card.pci_dir / f"virtfn{index}", vf_dir)
        _write(card.pci_dir / "sriov_numvfs", str(index + 1))
        region_dir = self._base_region(created, vf_dir, base)
        self._dfl_port(created, region_dir / name, port_id, afu_id)
        vf = DflCard(
            pci_address=vf_address,
            pci_dir=vf_dir,
            base_region=base,
            fme="",
            fme_regions=[],
            ports=[name],
            dev_root=self.dev_root,
            _created=created,
        )
        self.dfl[vf_address] = vf
        return vf

    # ------------------------------------------------------------------ Alveo

    def add_alveo(
        self,
        slot: str,
        *,
        vbnv: str = U250_VBNV,
        timestamp: str = U250_TIMESTAMP,
        fpga_part: str = "xcu250-figd2104-2L-e",
        mgmt_device: str = "0x5004",
        user_device: str = "0x5005",
        numa_node: int = 0,
        root_port: str | None = None,
        user_driver: str | None = "xocl",
    ) -> AlveoBoard:
        """Add an Alveo board: management function ``<slot>.0``, user function ``<slot>.1``.

        Args:
            slot: ``domain:bus:device``, e.g. ``0000:3b:00``.
            vbnv: Shell name the feature ROM reports.
            timestamp: Shell timestamp the feature ROM reports.
            fpga_part: FPGA part name the feature ROM reports.
            mgmt_device: PCI device ID of the management function (U250: 0x5004).
            user_device: PCI device ID of the user function (U250: 0x5005).
            numa_node: NUMA node of both functions.
            root_port: Upstream root port address; defaults to ``<domain>:<bus-1>:00.0``.
            user_driver: Driver bound to the user function; None for unbound (no xocl
                attributes, no render node).

        Returns:
            The new board.
        """
        if slot in self.alveo:
            raise ValueError(f"board {slot} already exists")
        domain, bus, _ = slot.split(":")
        port = root_port or f"{domain}:{int(bus, 16) - 1:02x}:00.0"
        mgmt_address, user_address = f"{slot}.0", f"{slot}.1"
        mgmt_instance, user_instance = _xocl_instance(mgmt_address), _xocl_instance(user_address)
        card, render = self._next_card, self._next_render
        self._next_card += 1
        self._next_render += 1
        created = _Created()
        root_dir = self._root_port_dir(port)
        board = AlveoBoard(
            slot=slot,
            mgmt_address=mgmt_address,
            user_address=user_address,
            mgmt_dir=root_dir / mgmt_address,
            user_dir=root_dir / user_address,
            render_node=f"renderD{render}",
            mgmt_node=f"xclmgmt{mgmt_instance}",
            dev_root=self.dev_root,
            _created=created,
        )

        def build() -> None:
            mgmt_dir, user_dir = (
                self._pci_function(
                    created,
                    address,
                    root_port=port,
                    vendor="0x10ee",
                    device=device_id,
                    subsystem_device="0x000e",
                    driver=driver,
                    numa_node=numa_node,
                )
                for address, device_id, driver in (
                    (mgmt_address, mgmt_device, "xclmgmt"),
                    (user_address, user_device, user_driver),
                )
            )
            # xclmgmt attributes (mgmtpf/mgmt-sysfs.c): mgmt_pf is empty, instance is
            # XOCL_DEV_ID, ready "%d", dev_offline "%d".
            _write(mgmt_dir / "mgmt_pf", "", newline=False)
            _write(mgmt_dir / "instance", str(mgmt_instance))
            _write(mgmt_dir / "ready", "1")
            _write(mgmt_dir / "dev_offline", "0")
            _write(mgmt_dir / "board_name", "u250")
            self._rom(mgmt_dir / f"rom.m.{mgmt_instance}", vbnv, timestamp, fpga_part)
            # /dev/xclmgmt<instance> (mgmt-core.c create_char: "xclmgmt%u", lro->instance).
            _node(self.dev_root / board.mgmt_node)
            created.paths.append(self.dev_root / board.mgmt_node)
            if user_driver != "xocl":
                return
            # xocl attributes (userpf/xocl_sysfs.c): user_pf is empty, ready "0x%llx".
            _write(user_dir / "user_pf", "", newline=False)
            _write(user_dir / "ready", "0x1")
            _write(user_dir / "dev_offline", "0")
            _write(user_dir / "board_name", "u250")
            # xclbinuuid prints nothing until an xclbin is loaded.
            _write(user_dir / "xclbinuuid", "", newline=False)
            _link(user_dir / "root_dev", user_dir.parent)
            self._rom(user_dir / f"rom.u.{user_instance}", vbnv, timestamp, fpga_part)
            # xocl registers a DRM device: drm/card<N> and drm/renderD<M> under the function.
            for name, minor in ((f"card{card}", card), (board.render_node, render)):
                drm_dir = user_dir / "drm" / name
                _write(
                    drm_dir / "uevent",
                    f"MAJOR={_DRM_MAJOR}\nMINOR={minor}\nDEVNAME=dri/{name}\nDEVTYPE=drm_minor",
                )
                _link(drm_dir / "device", user_dir)
                _link(drm_dir / "subsystem", self.sysfs_root / "class/drm")
                class_link = self.sysfs_root / "class/drm" / name
                _link(class_link, drm_dir)
                created.paths.append(class_link)
                self._char_node(created, drm_dir, _DRM_MAJOR, minor, f"dri/{name}")

        created.build = build
        build()
        self.alveo[slot] = board
        return board

    def _rom(self, rom_dir: Path, vbnv: str, timestamp: str, fpga_part: str) -> None:
        # Feature ROM sub-device attributes (xocl/subdev/feature_rom.c rom_attrs).
        _write(rom_dir / "VBNV", vbnv)
        _write(rom_dir / "timestamp", timestamp)
        _write(rom_dir / "FPGA", fpga_part)
        _write(rom_dir / "uuid", "")
        _write(rom_dir / "ddr_bank_count_max", "4")
        _write(rom_dir / "ddr_bank_size", "16")
        _write(rom_dir / "dr_base_addr", "0")
        _link(rom_dir / "subsystem", self.sysfs_root / "bus/platform")

    # ------------------------------------------------------------------ DFL

    def add_dfl_card(
        self,
        pci_address: str,
        *,
        afu_ids: Sequence[str] = (NLB0_AFU_ID,),
        interface_id: str = DFL_INTERFACE_ID,
        device: str = "0x0b2b",
        numa_node: int = 0,
        root_port: str | None = None,
    ) -> DflCard:
        """Add a DFL card: base region, FME with one PR region per port, and the ports.

        Numbering follows probe order as on a real host: the base region, then the FME's PR
        regions, then the next card's base region (Documentation/fpga/dfl.rst lists region0
        and region3 as the base regions of two cards with two ports each).

        Args:
            pci_address: The card's PCI function, e.g. ``0000:5e:00.0``.
            afu_ids: AFU ID of each port (one port per entry).
            interface_id: The FME's PR interface ID (compat_id of its PR regions).
            device: PCI device ID (0x0b2b: PAC D5005, 0x0b30: PAC N3000, 0x09c4: PAC A10).
            numa_node: NUMA node of the card.
            root_port: Upstream root port; defaults to ``<domain>:<bus-1>:00.0``.

        Returns:
            The new card.
        """
        if pci_address in self.dfl:
            raise ValueError(f"card {pci_address} already exists")
        domain, bus, _ = pci_address.split(":")
        port_addr = root_port or f"{domain}:{int(bus, 16) - 1:02x}:00.0"
        base = f"region{self._next_region}"
        self._next_region += 1
        fme = f"dfl-fme.{self._next_fme}"
        fme_minor = self._next_fme
        self._next_fme += 1
        bridges = list(range(self._next_bridge, self._next_bridge + len(afu_ids)))
        self._next_bridge += len(afu_ids)
        fme_regions = [f"region{self._next_region + i}" for i in range(len(afu_ids))]
        self._next_region += len(afu_ids)
        ports = [f"dfl-port.{self._next_port + i}" for i in range(len(afu_ids))]
        self._next_port += len(afu_ids)
        root_dir = self._root_port_dir(port_addr)
        created = _Created()
        card = DflCard(
            pci_address=pci_address,
            pci_dir=root_dir / pci_address,
            base_region=base,
            fme=fme,
            fme_regions=fme_regions,
            ports=list(ports),
            dev_root=self.dev_root,
            _created=created,
        )

        def build() -> None:
            pci_dir = self._pci_function(
                created,
                pci_address,
                root_port=port_addr,
                vendor="0x8086",
                device=device,
                subsystem_device="0x0000",
                driver="dfl-pci",
                numa_node=numa_node,
            )
            _write(pci_dir / "sriov_totalvfs", str(len(afu_ids)))
            _write(pci_dir / "sriov_numvfs", "0")
            region_dir = self._base_region(created, pci_dir, base)
            fme_dir = region_dir / fme
            self._platform_device(created, fme_dir, "dfl-fme")
            _write(
                fme_dir / "uevent",
                f"MAJOR={_DFL_FME_MAJOR}\nMINOR={fme_minor}\n"
                f"DEVNAME={fme}\nDRIVER=dfl-fme\nMODALIAS=platform:dfl-fme",
            )
            # sysfs-platform-dfl-fme: ports_num "%d", bitstream_id/metadata "0x%llx".
            _write(fme_dir / "ports_num", str(len(ports)))
            _write(fme_dir / "bitstream_id", "0x23000410010309")
            _write(fme_dir / "bitstream_metadata", "0x1180701")
            _write(fme_dir / "cache_size", "0")
            _write(fme_dir / "fabric_version", "0")
            for name in (
                "pcie0_errors",
                "pcie1_errors",
                "nonfatal_errors",
                "catfatal_errors",
                "inject_errors",
                "fme_errors",
                "first_error",
                "next_error",
            ):
                _write(fme_dir / "errors" / name, "0x0")
            self._char_node(created, fme_dir, _DFL_FME_MAJOR, fme_minor, fme)
            # dfl-fme-pr.c: one manager per FME (id of the FME), then per port a bridge
            # (PLATFORM_DEVID_AUTO, hence ".auto") and a region with the bridge's id.
            mgr_dir = fme_dir / f"dfl-fme-mgr.{fme_minor}"
            self._platform_device(created, mgr_dir, "dfl-fme-mgr")
            _write(mgr_dir / "fpga_manager" / f"fpga{fme_minor}" / "name", "DFL FME FPGA Manager")
            _write(mgr_dir / "fpga_manager" / f"fpga{fme_minor}" / "state", "operating")
            for bridge, fme_region in zip(bridges, fme_regions, strict=True):
                br_dir = fme_dir / f"dfl-fme-bridge.{bridge}.auto"
                self._platform_device(created, br_dir, "dfl-fme-bridge")
                _write(br_dir / "fpga_bridge" / f"br{bridge}" / "name", "DFL FPGA FME Bridge")
                _write(br_dir / "fpga_bridge" / f"br{bridge}" / "state", "enabled")
                holder = fme_dir / f"dfl-fme-region.{bridge}"
                self._platform_device(created, holder, "dfl-fme-region")
                pr_region = holder / "fpga_region" / fme_region
                self._fpga_region(created, pr_region, holder)
                # compat_id_show prints "%016llx%016llx\n" (fpga-region.c).
                _write(pr_region / "compat_id", interface_id)
            for index, (port, afu_id) in enumerate(zip(ports, afu_ids, strict=True)):
                self._dfl_port(created, region_dir / port, index, afu_id)

        created.build = build
        build()
        self.dfl[pci_address] = card
        return card


def alveo_u250_host(root: Path) -> tuple[FpgaHost, list[AlveoBoard]]:
    """A host with two Alveo U250 boards on two NUMA nodes (0000:3b:00 and 0000:d8:00).

    Returns:
        The host and its boards.
    """
    host = FpgaHost(root)
    boards = [
        host.add_alveo("0000:3b:00", numa_node=0),
        host.add_alveo("0000:d8:00", numa_node=1),
    ]
    return host, boards


def dfl_pac_host(
    root: Path, *, afu_ids: Sequence[str] = (NLB0_AFU_ID, NLB3_AFU_ID)
) -> tuple[FpgaHost, list[DflCard]]:
    """A host with one single-port DFL card (PAC D5005) per AFU ID, on NUMA nodes 0, 1, ...

    Returns:
        The host and its cards; with the default, two ports on two cards.
    """
    host = FpgaHost(root)
    addresses = ("0000:5e:00.0", "0000:af:00.0", "0000:d9:00.0", "0000:3d:00.0")
    if len(afu_ids) > len(addresses):
        raise ValueError(f"at most {len(addresses)} cards")
    cards = [
        host.add_dfl_card(address, afu_ids=[afu_id], numa_node=i % 2)
        for i, (address, afu_id) in enumerate(zip(addresses, afu_ids, strict=False))
    ]
    return host, cards
