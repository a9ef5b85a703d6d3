"""What an Xid means for scheduling: NVIDIA's documented resolution for each Xid and our class.

Facts from NVIDIA's Xid catalog for Ampere and newer GPUs, "Resolution Bucket (Immediate
Action)" column (https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html, Xids
1-162). The page has no version number: read 2026-11-26, with NVIDIA/NVSentinel's copy of
its buckets (``xiderrorsmapping.csv`` at 6f8b0fc). Names are ours, in short. Our class:
``ignore`` (informational, the GPU and its work are fine), ``advisory`` (the application was
hit, the GPU is usable), ``no_schedule`` (the GPU needs a reset, a reboot or service). Each Xid
of 1-162 has a row or, for those the catalog files as unexpected on these GPUs, an explicit
``no_schedule``; an Xid past the catalog is ``no_schedule``, as every Xid was before this table.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal

__all__ = ["CATALOG", "XidClass", "XidInfo", "classify"]

XidClass = Literal["ignore", "advisory", "no_schedule"]

# NVIDIA's resolution buckets, in words.
_IGNORE = "ignore (IGNORE)"
_RESTART_APP = "restart the application (RESTART_APP)"
_RESET_GPU = "reset the GPU (RESET_GPU)"
_REBOOT = "reboot the node (RESTART_BM)"
_RESTART_VM = "restart the VM (RESTART_VM)"
_UNKNOWN = "unknown to this table: treated as needing a reset"
_MECHANICALS = "check power and cooling (CHECK_MECHANICALS)"
_UPDATE = "update driver or firmware (UPDATE_SWFW)"
_CHECK_UVM = "check UVM (CHECK_UVM)"
_WORKFLOW = "follow NVIDIA's workflow for this Xid (WORKFLOW_XID_{})"
_NVLINK_WORKFLOW = "follow NVIDIA's NVLink workflow (WORKFLOW_NVLINK_ERR)"
_NVLINK5_WORKFLOW = "follow NVIDIA's NVLink5 workflow (WORKFLOW_NVLINK5_ERR)"
_OTHER_XID = "follow the Xid it names (linked to another Xid)"
_REPORT = "not expected on Ampere and newer: report it to NVIDIA (UNEXPECTED_ERR_REPORT_ISSUE)"

# The Xids the catalog files under UNEXPECTED_ERR_REPORT_ISSUE (older GPUs' display, video
# encoder and silent-running errors, with no name worth keeping): no row of their own, an
# explicit ``no_schedule`` with that resolution, since nothing says the GPU is fine.
_UNEXPECTED_RANGES = (
    "1-7 9-10 12 15-24 26-30 33-36 42 47 49-53 55-59 61 65 73 81 87 90-91 108 111-118 122-125 "
    "138 142"
)
_UNEXPECTED = frozenset(
    xid
    for part in _UNEXPECTED_RANGES.split()
    for xid in range(int(part.split("-")[0]), int(part.split("-")[-1]) + 1)
)


@dataclass(frozen=True)
class XidInfo:
    """One Xid: its name, NVIDIA's documented resolution and what it does to a device here.

    Args:
        xid: The Xid number.
        name: What happened, in a few words.
        resolution: NVIDIA's immediate action, in words with the catalog's bucket.
        cls: ``ignore``, ``advisory`` or ``no_schedule``.
    """

    xid: int
    name: str
    resolution: str
    cls: XidClass


# (Xids, name, NVIDIA's resolution, our class)
_TABLE: tuple[tuple[tuple[int, ...], str, str, XidClass], ...] = (
    # Application-level faults: the driver resets the application's channel, the GPU is fine.
    ((8,), "GPU stopped processing (idle timeout)", _RESTART_APP, "advisory"),
    ((11,), "invalid or corrupted push buffer stream", _RESTART_APP, "advisory"),
    ((13,), "graphics engine exception", _RESTART_APP, "advisory"),
    ((25,), "illegal notify", _RESTART_APP, "advisory"),
    ((31,), "GPU memory page fault", _RESTART_APP, "advisory"),
    ((32,), "invalid or corrupted push buffer (PBDMA)", _RESTART_APP, "advisory"),
    # The catalog says IGNORE for 43; it still means an application's work was stopped, so
    # it is worth one line at info rather than debug.
    ((43,), "GPU stopped processing", _IGNORE, "advisory"),
    ((45,), "preemptive cleanup", _WORKFLOW.format(45), "advisory"),
    ((60,), "security engine exception", _RESTART_APP, "advisory"),
    ((68,), "video processor exception", _RESTART_APP, "advisory"),
    ((69,), "graphics engine class error", _RESTART_APP, "advisory"),
    ((80,), "push buffer CRC mismatch", _RESTART_APP, "advisory"),
    ((159,), "CHI non-data error", _CHECK_UVM, "advisory"),
    # Copy engine, video decoder, JPEG and optical flow exceptions: the application's.
    (
        (39, 40, 41, 70, 71, 72, 75, 76, 77, 85, *range(126, 136)),
        "copy engine exception",
        _RESTART_APP,
        "advisory",
    ),
    ((83, 84, 88, 89, 96, 97, 98), "video decoder exception", _RESTART_APP, "advisory"),
    ((82, *range(99, 106)), "JPEG engine exception", _RESTART_APP, "advisory"),
    ((86, 139), "optical flow engine exception", _RESTART_APP, "advisory"),
    # Informational: nothing to do.
    ((37, 38, 66, 67), "firmware (FECS) report", _IGNORE, "ignore"),
    ((14,), "test error (fake)", _IGNORE, "ignore"),
    ((44,), "graphics fault during context switch", _IGNORE, "ignore"),
    ((93,), "InfoROM erase limit exceeded", _IGNORE, "ignore"),
    ((106,), "SMBPBI test message", _IGNORE, "ignore"),
    ((107,), "SMBPBI test message (silent)", _IGNORE, "ignore"),
    ((121,), "C2C link error (corrected)", _IGNORE, "ignore"),
    ((137,), "NVLink FLA privilege error", _IGNORE, "ignore"),
    ((141,), "fast path error", _IGNORE, "ignore"),
    ((157,), "resource retirement failure", _IGNORE, "ignore"),
    ((161,), "channel retirement failure", _IGNORE, "ignore"),
    # Deep-learning accelerator faults (Jetson's DLA): nothing for a data-centre GPU to do.
    ((152,), "DLA SMMU error", _IGNORE, "ignore"),
    ((153,), "DLA timeout", _IGNORE, "ignore"),
    # The GPU needs a reset, a reboot or service: no new work until then.
    ((46,), "GPU timeout", _RESET_GPU, "no_schedule"),
    ((48,), "double-bit ECC error", _WORKFLOW.format(48), "no_schedule"),
    ((54,), "power-reduced clocking", _MECHANICALS, "no_schedule"),
    ((62,), "PMU halt", _RESET_GPU, "no_schedule"),
    # The catalog says IGNORE for 63 and 92, and RESTART_APP for 94; issue 26 takes each out
    # of scheduling: a row or page waits for a reset (63), memory is degrading (92), and a
    # contained ECC error leaves a row to remap at the next reset (94).
    ((63,), "row remapping or page retirement pending", _IGNORE, "no_schedule"),
    ((64,), "row remapping or page retirement failed", _RESET_GPU, "no_schedule"),
    ((74,), "NVLink error", _NVLINK_WORKFLOW, "no_schedule"),
    ((78,), "vGPU start error", _UPDATE, "no_schedule"),
    ((79,), "GPU has fallen off the bus", _REBOOT, "no_schedule"),
    ((92,), "high single-bit ECC error rate", _IGNORE, "no_schedule"),
    ((94,), "contained ECC error", _RESTART_APP, "no_schedule"),
    ((95,), "uncontained ECC error", _RESET_GPU, "no_schedule"),
    ((109,), "context switch timeout", _RESET_GPU, "no_schedule"),
    ((110,), "security fault", _RESET_GPU, "no_schedule"),
    ((119,), "GSP RPC timeout", _RESET_GPU, "no_schedule"),
    ((120,), "GSP error", _RESET_GPU, "no_schedule"),
    ((136,), "NVLink training failure", _RESET_GPU, "no_schedule"),
    ((140,), "unrecoverable ECC error escaped", _RESET_GPU, "no_schedule"),
    ((143,), "GPU initialization error", _RESET_GPU, "no_schedule"),
    ((151,), "key rotation error", _RESTART_VM, "no_schedule"),
    ((*range(144, 151),), "NVLink error", _NVLINK5_WORKFLOW, "no_schedule"),
    # Xid 154 says the GPU's recovery action changed (e.g. to "GPU reset required").
    ((154,), "GPU recovery action changed", _OTHER_XID, "no_schedule"),
    ((155,), "NVLink software-defined error", _RESET_GPU, "no_schedule"),
    ((156,), "resource retirement event", _RESET_GPU, "no_schedule"),
    ((158,), "GPU fatal timeout", _RESET_GPU, "no_schedule"),
    ((160,), "channel retirement event", _REBOOT, "no_schedule"),
    # The catalog gives 162 a bucket and no name.
    ((162,), "unnamed in the catalog", _RESET_GPU, "no_schedule"),
)


CATALOG: Mapping[int, XidInfo] = MappingProxyType(
    {xid: XidInfo(xid, name, how, cls) for xids, name, how, cls in _TABLE for xid in xids}
)


def classify(xid: int) -> XidInfo:
    """What ``xid`` is and does: its catalog row, or ``no_schedule`` for an Xid not listed
    (one the catalog files as unexpected on these GPUs, or one past the catalog)."""
    info = CATALOG.get(xid)
    if info is None:
        return XidInfo(xid, "", _REPORT if xid in _UNEXPECTED else _UNKNOWN, "no_schedule")
    return info
