"""Fake sysfs/devfs trees of FPGA hosts (AMD/Xilinx Alveo under XRT, Intel FPGAs under DFL).

Builds, under a temporary directory, the files, symlinks and /dev nodes a real host shows: PCI
functions under ``sys/devices/pci*`` with their ``bus``/``class``/``dev/char`` symlinks,
``driver``/``subsystem``/``device`` links, the xocl/xclmgmt attributes and ROM sub-device, the
DRM render node, and the DFL base region with its FME, FME PR region and ports. Layouts follow
the sources cited in ``devplugin_sdk.backends.fpga``; character devices are regular files.

The modules: ``_tree`` (the plumbing every card shares), ``_alveo`` (Alveo boards under XRT) and
``_dfl`` (DFL cards, their FME, ports and VFs).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from devplugin_sdk.testing.fpga_trees._alveo import U250_VBNV, AlveoBoard, _AlveoHost
from devplugin_sdk.testing.fpga_trees._dfl import (
    DFL_INTERFACE_ID,
    NLB0_AFU_ID,
    NLB3_AFU_ID,
    DflCard,
    _DflHost,
)

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


class FpgaHost(_AlveoHost, _DflHost):
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
