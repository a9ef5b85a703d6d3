"""Alveo boards under XRT: a management function (xclmgmt) and a user function (xocl) per board,
their attributes and feature ROM sub-devices, the DRM render node and ``/dev/xclmgmt<N>``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from devplugin_sdk.testing.fpga_trees._tree import (
    _DRM_MAJOR,
    _Created,
    _link,
    _node,
    _Tree,
    _write,
)

# Shell of an Alveo U250 with the 2018.3 XDMA platform, as its feature ROM reports it.
U250_VBNV = "xilinx_u250_xdma_201830_2"
U250_TIMESTAMP = "1561465320"


def _xocl_instance(address: str) -> int:
    domain, bus, devfn = address.split(":")
    dev, fn = devfn.split(".")
    return (int(domain, 16) << 16) | (int(bus, 16) << 8) | (int(dev, 16) << 3) | int(fn, 16)


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


class _AlveoHost(_Tree):
    """``add_alveo``: the XRT part of ``FpgaHost``."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.alveo: dict[str, AlveoBoard] = {}

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
            mgmt_node=f"xclmgmt{_xocl_instance(mgmt_address)}",
            dev_root=self.dev_root,
            _created=created,
        )
        rom = (vbnv, timestamp, fpga_part)

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
            self._xclmgmt(created, board, mgmt_dir, rom)
            if user_driver == "xocl":
                self._xocl(created, board, user_dir, rom, card=card, render=render)

        created.build = build
        build()
        self.alveo[slot] = board
        return board

    def _xclmgmt(
        self, created: _Created, board: AlveoBoard, mgmt_dir: Path, rom: tuple[str, str, str]
    ) -> None:
        """The management function's attributes, feature ROM and /dev node."""
        instance = _xocl_instance(board.mgmt_address)
        # xclmgmt attributes (mgmtpf/mgmt-sysfs.c): mgmt_pf is empty, instance is
        # XOCL_DEV_ID, ready "%d", dev_offline "%d".
        _write(mgmt_dir / "mgmt_pf", "", newline=False)
        _write(mgmt_dir / "instance", str(instance))
        _write(mgmt_dir / "ready", "1")
        _write(mgmt_dir / "dev_offline", "0")
        _write(mgmt_dir / "board_name", "u250")
        self._rom(mgmt_dir / f"rom.m.{instance}", *rom)
        # /dev/xclmgmt<instance> (mgmt-core.c create_char: "xclmgmt%u", lro->instance).
        _node(self.dev_root / board.mgmt_node)
        created.paths.append(self.dev_root / board.mgmt_node)

    def _xocl(
        self,
        created: _Created,
        board: AlveoBoard,
        user_dir: Path,
        rom: tuple[str, str, str],
        *,
        card: int,
        render: int,
    ) -> None:
        """The user function's attributes, feature ROM and DRM nodes (xocl bound)."""
        # xocl attributes (userpf/xocl_sysfs.c): user_pf is empty, ready "0x%llx".
        _write(user_dir / "user_pf", "", newline=False)
        _write(user_dir / "ready", "0x1")
        _write(user_dir / "dev_offline", "0")
        _write(user_dir / "board_name", "u250")
        # xclbinuuid prints nothing until an xclbin is loaded.
        _write(user_dir / "xclbinuuid", "", newline=False)
        _link(user_dir / "root_dev", user_dir.parent)
        self._rom(user_dir / f"rom.u.{_xocl_instance(board.user_address)}", *rom)
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
