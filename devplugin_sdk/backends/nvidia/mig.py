"""MIG: the instances of a MIG-enabled GPU, their profile names and capability nodes.

Facts from nvml.h, NVIDIA/go-nvlib ``pkg/nvlib/device/mig_profile.go`` (profile names) and
nvidia-container-toolkit ``internal/nvcaps`` (capability minors).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from devplugin_sdk.backends import _sysfs
from devplugin_sdk.backends.nvidia.library import _text

__all__ = ["MigInfo", "mig_profile_name"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MigInfo:
    """One MIG device as discovered: UUID, parent GPU, GPU/compute instance, profile, nodes."""

    uuid: str
    parent_uuid: str
    gi: int
    ci: int
    profile: str
    memory_bytes: int
    cap_nodes: tuple[str, ...]


def mig_profile_name(
    gi_slices: int, ci_slices: int, mig_memory_mib: int, gpu_memory_bytes: int
) -> str:
    """The MIG profile name (``1g.10gb``, ``1c.2g.20gb``) NVIDIA's tools give an instance.

    Memory is the instance's share of the GPU rounded up to eighths, times the GPU's memory in
    whole GiB, rounded (go-nvlib ``getMigMemorySizeGB``). Media-extension suffixes (``+me``) are
    not derived.
    """
    fraction = math.ceil(mig_memory_mib * 2**20 / gpu_memory_bytes * 8) / 8
    gb = round(fraction * math.ceil(gpu_memory_bytes / 2**30))
    if ci_slices == gi_slices:
        return f"{gi_slices}g.{gb}gb"
    return f"{ci_slices}c.{gi_slices}g.{gb}gb"


# The most of mig-minors read: 135 lines (about 3.5 KB) per GPU the driver lists, more than a
# sysfs page from the second GPU on; 1 MiB holds hundreds.
_MIG_MINORS_BYTES = 1 << 20


def _read_mig_minors(proc_root: Path) -> dict[str, int]:
    # /proc/driver/nvidia-caps/mig-minors: "gpu<minor>/gi<gi>/ci<ci>/access <cap minor>" per
    # line; the node is /dev/nvidia-caps/nvidia-cap<cap minor> (nvidia-container-toolkit
    # internal/nvcaps, Slurm gpu_nvml.c).
    text = _sysfs.read_attr(proc_root / "driver" / "nvidia-caps" / "mig-minors", _MIG_MINORS_BYTES)
    out: dict[str, int] = {}
    for line in (text or "").splitlines():
        name, _, minor = line.strip().partition(" ")
        if minor.strip().isdigit():
            out[name] = int(minor)
    return out


def scan_migs(
    nvml: Any,
    handle: Any,
    *,
    parent_uuid: str,
    minor: int,
    memory: int,
    mig_minors: Mapping[str, int],
) -> list[MigInfo]:
    """The MIG devices of the GPU ``handle`` (``parent_uuid``, ``/dev/nvidia<minor>``,
    ``memory`` bytes) (blocking)."""
    out: list[MigInfo] = []
    for slot in range(nvml.nvmlDeviceGetMaxMigDeviceCount(handle)):
        try:
            mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
        except nvml.NVMLError_NotFound:
            continue  # nvml.h: an empty slot answers Not Found
        gi = int(nvml.nvmlDeviceGetGpuInstanceId(mig))
        ci = int(nvml.nvmlDeviceGetComputeInstanceId(mig))
        attrs = nvml.nvmlDeviceGetAttributes(mig)
        profile = mig_profile_name(
            attrs.gpuInstanceSliceCount,
            attrs.computeInstanceSliceCount,
            attrs.memorySizeMB,
            memory,
        )
        caps: list[str] = []
        for cap in (f"gpu{minor}/gi{gi}/access", f"gpu{minor}/gi{gi}/ci{ci}/access"):
            if cap in mig_minors:
                caps.append(f"/dev/nvidia-caps/nvidia-cap{mig_minors[cap]}")
            else:
                log.warning("MIG capability %s not listed in mig-minors", cap)
        out.append(
            MigInfo(
                uuid=_text(nvml.nvmlDeviceGetUUID(mig)),
                parent_uuid=parent_uuid,
                gi=gi,
                ci=ci,
                profile=profile,
                memory_bytes=int(nvml.nvmlDeviceGetMemoryInfo(mig).total),
                cap_nodes=tuple(caps),
            )
        )
    return out
