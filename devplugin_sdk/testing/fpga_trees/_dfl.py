"""DFL cards (Intel PAC and friends under the kernel's dfl drivers): the base region under the PCI
function, the FME with its PR manager, bridges and regions, the ports with their AFU IDs, and SR-IOV
VFs that take a port over.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from devplugin_sdk.testing.fpga_trees._tree import (
    _DFL_FME_MAJOR,
    _DFL_PORT_MAJOR,
    _Created,
    _link,
    _node,
    _read,
    _remove,
    _Tree,
    _write,
)

# AFU IDs of Intel's native loopback samples (OPAE quick start: nlb_mode_0 reads
# d8424dc4a4a3c413f89e433683f9040b from /sys/class/fpga_region/region0/dfl-port.0/afu_id).
NLB0_AFU_ID = "d8424dc4a4a3c413f89e433683f9040b"
NLB3_AFU_ID = "f7df405cbd7acf7222f144b0b93acd18"
DFL_INTERFACE_ID = "69528db6eb31577a8c3668f9faa081f6"


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


class _DflHost(_Tree):
    """``add_dfl_card`` and ``add_dfl_vf``: the DFL part of ``FpgaHost``."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.dfl: dict[str, DflCard] = {}

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
            self._fme(created, fme_dir, fme_minor, len(ports))
            self._fme_pr(
                created,
                fme_dir,
                fme_minor,
                bridges=bridges,
                regions=fme_regions,
                interface_id=interface_id,
            )
            for index, (port, afu_id) in enumerate(zip(ports, afu_ids, strict=True)):
                self._dfl_port(created, region_dir / port, index, afu_id)

        created.build = build
        build()
        self.dfl[pci_address] = card
        return card

    def _fme(self, created: _Created, fme_dir: Path, minor: int, ports: int) -> None:
        """The FME platform device: its attributes, error registers and char device."""
        fme = fme_dir.name
        self._platform_device(created, fme_dir, "dfl-fme")
        _write(
            fme_dir / "uevent",
            f"MAJOR={_DFL_FME_MAJOR}\nMINOR={minor}\n"
            f"DEVNAME={fme}\nDRIVER=dfl-fme\nMODALIAS=platform:dfl-fme",
        )
        # sysfs-platform-dfl-fme: ports_num "%d", bitstream_id/metadata "0x%llx".
        _write(fme_dir / "ports_num", str(ports))
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
        self._char_node(created, fme_dir, _DFL_FME_MAJOR, minor, fme)

    def _fme_pr(
        self,
        created: _Created,
        fme_dir: Path,
        minor: int,
        *,
        bridges: Sequence[int],
        regions: Sequence[str],
        interface_id: str,
    ) -> None:
        """The FME's partial reconfiguration: its manager, and a bridge and region per port."""
        # dfl-fme-pr.c: one manager per FME (id of the FME), then per port a bridge
        # (PLATFORM_DEVID_AUTO, hence ".auto") and a region with the bridge's id.
        mgr_dir = fme_dir / f"dfl-fme-mgr.{minor}"
        self._platform_device(created, mgr_dir, "dfl-fme-mgr")
        _write(mgr_dir / "fpga_manager" / f"fpga{minor}" / "name", "DFL FME FPGA Manager")
        _write(mgr_dir / "fpga_manager" / f"fpga{minor}" / "state", "operating")
        for bridge, fme_region in zip(bridges, regions, strict=True):
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
