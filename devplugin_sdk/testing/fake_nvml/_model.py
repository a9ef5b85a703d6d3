"""The machine a fake NVML models: GPUs and MIG devices, the structures NVML returns, opaque
handles and event sets, and the sysfs, /dev and /proc trees a plugin reads beside NVML.
"""

from __future__ import annotations

import collections
import math
import uuid as uuid_module
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from devplugin_sdk.testing.fake_nvml._constants import (
    _NOT_ATTRIBUTED,
    NVML_AGGREGATE_ECC,
    NVML_DEVICE_ARCH_AMPERE,
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
    NVML_NVLINK_DEVICE_TYPE_SWITCH,
    NVML_VOLATILE_ECC,
    nvmlEventTypeClock,
    nvmlEventTypeDoubleBitEccError,
    nvmlEventTypePState,
    nvmlEventTypeSingleBitEccError,
    nvmlEventTypeXidCriticalError,
)

# ----------------------------------------------------------------------------- returned structs


@dataclass(frozen=True)
class PciInfo:
    """What ``nvmlDeviceGetPciInfo`` returns (the fields plugins read)."""

    busId: str
    domain: int
    bus: int
    device: int
    pciDeviceId: int
    pciSubSystemId: int = 0


@dataclass(frozen=True)
class Memory:
    """What ``nvmlDeviceGetMemoryInfo`` returns, in bytes."""

    total: int
    free: int
    used: int


@dataclass(frozen=True)
class DeviceAttributes:
    """What ``nvmlDeviceGetAttributes`` returns for a MIG device handle."""

    multiprocessorCount: int
    sharedCopyEngineCount: int
    sharedDecoderCount: int
    sharedEncoderCount: int
    sharedJpegCount: int
    sharedOfaCount: int
    gpuInstanceSliceCount: int
    computeInstanceSliceCount: int
    memorySizeMB: int


@dataclass(frozen=True)
class EventData:
    """What ``nvmlEventSetWait_v2`` returns."""

    device: Any
    eventType: int
    eventData: int
    gpuInstanceId: int = _NOT_ATTRIBUTED
    computeInstanceId: int = _NOT_ATTRIBUTED


# ----------------------------------------------------------------------------- the machine model


@dataclass
class FakeMIG:
    """One MIG device (a compute instance inside a GPU instance).

    Args:
        uuid: ``MIG-...`` UUID.
        gi: GPU instance ID.
        ci: Compute instance ID.
        gi_slices: GPU instance slices (the ``g`` of ``1g.10gb``).
        ci_slices: Compute instance slices (the ``c`` of ``1c.2g.20gb``).
        memory_mib: Memory of the instance, MiB (``memorySizeMB`` of its attributes).
        multiprocessors: SM count.
    """

    uuid: str
    gi: int
    ci: int
    gi_slices: int
    ci_slices: int
    memory_mib: int
    multiprocessors: int = 14


@dataclass
class FakeGPU:
    """One physical GPU as NVML would describe it.

    Args:
        index: NVML index.
        uuid: ``GPU-...`` UUID.
        name: Product name.
        memory_mib: Total framebuffer memory, MiB.
        bus_id: NVML bus ID (``00000000:07:00.0``).
        minor: Minor number of ``/dev/nvidia<minor>``.
        numa_node: NUMA node written to sysfs; ``None`` writes -1.
        pcie_path: PCIe switches from the root complex down to the GPU; decides
            ``nvmlDeviceGetTopologyCommonAncestor``.
        nvlinks: One entry per active NVLink: the remote end's bus ID and NVLink device type.
            Empty means the GPU has no NVLink (NVML answers Not Supported).
        mig_capable: MIG supported (``nvmlDeviceGetMigMode`` answers instead of Not Supported).
        mig_enabled: MIG mode currently enabled.
        migs: MIG devices (only when ``mig_enabled``).
        supported_events: Event mask ``nvmlDeviceGetSupportedEventTypes`` returns.
        temperature: Degrees C for ``nvmlDeviceGetTemperature``.
        lost: Fallen off the bus: every call on the GPU answers ``NVMLError_GpuIsLost``.
        ecc: ECC supported and enabled; without it the ECC counters answer Not Supported
            (consumer boards, or ECC switched off as L40S boards often ship).
        row_remapping: Ampere or newer: ``nvmlDeviceGetRemappedRows`` answers (Not Supported
            otherwise, and on a MIG-enabled GPU with instances, as nvml.h says).
        page_retirement: Dynamic page retirement (pre-Ampere boards with ECC, such as the T4):
            ``nvmlDeviceGetRetiredPagesPendingStatus`` answers (Not Supported otherwise).
        ecc_counts: ECC error counters by (``NVML_MEMORY_ERROR_TYPE_*``, ``NVML_*_ECC``).
        ecc_rising: Uncorrected errors added to both uncorrected counters at every read of
            one (a memory fault in progress; ``FakeNVML.ecc_uncorrected`` sets it).
        remapped_rows: Rows remapped for correctable and for uncorrectable errors.
        remap_pending: A row remapping waits for a GPU reset.
        remap_failed: A row remapping failed at some time (the flag stays set).
        pages_pending: Retired pages wait for a reboot or GPU reset to be blacklisted.
        architecture: ``NVML_DEVICE_ARCH_*`` for ``nvmlDeviceGetArchitecture``.
        compute_capability: CUDA compute capability (major, minor).
        fabric: The NVLink fabric's cluster UUID and clique ID (multi-node NVLink, or an
            NVSwitch system with the fabric manager); None answers Not Supported.
    """

    index: int
    uuid: str
    name: str
    memory_mib: int
    bus_id: str
    minor: int
    numa_node: int | None
    pcie_path: tuple[str, ...]
    nvlinks: list[tuple[str, int]] = field(default_factory=list)
    mig_capable: bool = False
    mig_enabled: bool = False
    migs: list[FakeMIG] = field(default_factory=list)
    supported_events: int = (
        nvmlEventTypeSingleBitEccError
        | nvmlEventTypeDoubleBitEccError
        | nvmlEventTypePState
        | nvmlEventTypeXidCriticalError
        | nvmlEventTypeClock
    )
    temperature: int = 34
    lost: bool = False
    ecc: bool = True
    row_remapping: bool = False
    page_retirement: bool = False
    ecc_counts: dict[tuple[int, int], int] = field(
        default_factory=lambda: {(t, c): 0 for t in (0, 1) for c in (0, 1)}
    )
    ecc_rising: int = 0
    remapped_rows: tuple[int, int] = (0, 0)
    remap_pending: bool = False
    remap_failed: bool = False
    pages_pending: bool = False
    architecture: int = NVML_DEVICE_ARCH_AMPERE
    compute_capability: tuple[int, int] = (8, 0)
    fabric: tuple[str, int] | None = None

    @property
    def sysfs_address(self) -> str:
        """The bus ID as sysfs spells it (``0000:07:00.0``)."""
        domain, rest = self.bus_id.split(":", 1)
        return f"{int(domain, 16):04x}:{rest.lower()}"


class _Handle:
    """Opaque device handle, like pynvml's ``c_nvmlDevice_t`` pointer."""

    def __init__(self, gpu: FakeGPU, mig: FakeMIG | None = None) -> None:
        self.gpu = gpu
        self.mig = mig

    def __repr__(self) -> str:
        what = f"gpu{self.gpu.index}" + (f"/gi{self.mig.gi}/ci{self.mig.ci}" if self.mig else "")
        return f"<fake nvmlDevice {what}>"


class _EventSet:
    """Opaque event set, like pynvml's ``c_nvmlEventSet_t``."""

    def __init__(self) -> None:
        self.registered: dict[int, int] = {}  # GPU index -> event mask
        self.pending: collections.deque[EventData] = collections.deque()
        self.freed = False


@dataclass
class _Failure:
    code: int
    remaining: int | None  # None: every call fails


@dataclass(frozen=True)
class HostRoots:
    """Where ``FakeNVML.write_host`` put the host trees (pass them to the plugin)."""

    sysfs_root: Path
    dev_root: Path
    proc_root: Path

    def config(self) -> dict[str, str]:
        """The NVIDIA backend's root keys pointing at these trees (``sysfsRoot`` ...)."""
        return {
            "sysfsRoot": str(self.sysfs_root),
            "devRoot": str(self.dev_root),
            "procRoot": str(self.proc_root),
        }


# ----------------------------------------------------------------------------- helpers


def _pci_info(bus_id: str) -> PciInfo:
    domain, bus, rest = bus_id.split(":")
    device = rest.split(".")[0]
    return PciInfo(
        busId=bus_id,
        domain=int(domain, 16),
        bus=int(bus, 16),
        device=int(device, 16),
        pciDeviceId=0x20B210DE,
    )


def _add_uncorrected(gpu: FakeGPU, count: int) -> None:
    for counter_type in (NVML_VOLATILE_ECC, NVML_AGGREGATE_ECC):
        gpu.ecc_counts[(NVML_MEMORY_ERROR_TYPE_UNCORRECTED, counter_type)] += count


def _nvlinked(a: FakeGPU, b: FakeGPU) -> bool:
    if any(remote == b.bus_id for remote, _ in a.nvlinks):
        return True
    on_switch = {t for _, t in a.nvlinks} | {t for _, t in b.nvlinks}
    return bool(a.nvlinks and b.nvlinks) and on_switch == {NVML_NVLINK_DEVICE_TYPE_SWITCH}


def _profile_name(gpu: FakeGPU, mig: FakeMIG) -> str:
    fraction = math.ceil(mig.memory_mib / gpu.memory_mib * 8) / 8
    gb = round(fraction * math.ceil(gpu.memory_mib / 1024))
    if mig.ci_slices == mig.gi_slices:
        return f"{mig.gi_slices}g.{gb}gb"
    return f"{mig.ci_slices}c.{mig.gi_slices}g.{gb}gb"


def mig_minors(gpu_minor: int) -> list[tuple[str, int]]:
    """The driver's mig-minors entries for one GPU: (capability name, nvidia-cap minor).

    The driver numbers them after ``config 1`` and ``monitor 2``: per GPU 15 GPU instances,
    each an ``access`` entry followed by 8 compute instance entries.
    """
    out: list[tuple[str, int]] = []
    minor = 3 + gpu_minor * 15 * 9
    for gi in range(15):
        out.append((f"gpu{gpu_minor}/gi{gi}/access", minor))
        minor += 1
        for ci in range(8):
            out.append((f"gpu{gpu_minor}/gi{gi}/ci{ci}/access", minor))
            minor += 1
    return out


def _uuid(prefix: str, *parts: object) -> str:
    name = "/".join(str(p) for p in parts)
    return f"{prefix}-{uuid_module.uuid5(uuid_module.NAMESPACE_URL, 'fake-nvml/' + name)}"


# ----------------------------------------------------------------------------- host trees


def write_host(gpus: Sequence[FakeGPU], root: Path) -> HostRoots:
    """Write the sysfs, /dev and /proc entries a plugin reads, under ``root``.

    ``sys/bus/pci/devices/<addr>/numa_node`` per GPU; ``dev/nvidia<minor>``, the control
    nodes and ``dev/nvidia-caps/nvidia-cap<N>`` of existing MIG instances (empty files);
    ``proc/driver/nvidia-caps/mig-minors`` listing every MIG-capable GPU's capabilities.

    Returns:
        The three roots.
    """
    roots = HostRoots(root / "sys", root / "dev", root / "proc")
    complexes = list(dict.fromkeys(gpu.pcie_path[0] for gpu in gpus if gpu.pcie_path))
    for gpu in gpus:
        # The kernel's layout: the device under its root bus and bridges in devices/, and
        # a bus/pci/devices/<address> link to it (how a PCIe root is found).
        domain = gpu.sysfs_address.split(":")[0]
        rc = complexes.index(gpu.pcie_path[0]) if gpu.pcie_path else 0
        parts = [f"pci{domain}:{0x10 * rc:02x}"]
        parts += [f"{domain}:{0x10 * rc:02x}:{i + 1:02x}.0" for i in range(len(gpu.pcie_path) - 1)]
        pci_dir = roots.sysfs_root.joinpath("devices", *parts, gpu.sysfs_address)
        pci_dir.mkdir(parents=True, exist_ok=True)
        link = roots.sysfs_root / "bus" / "pci" / "devices" / gpu.sysfs_address
        link.parent.mkdir(parents=True, exist_ok=True)
        if not link.is_symlink():
            link.symlink_to(Path("../../..", "devices", *parts, gpu.sysfs_address))
        # The kernel writes -1 when the platform reports no NUMA affinity.
        numa = -1 if gpu.numa_node is None else gpu.numa_node
        (pci_dir / "numa_node").write_text(f"{numa}\n")
    roots.dev_root.mkdir(parents=True, exist_ok=True)
    for name in ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset"):
        (roots.dev_root / name).touch()
    for gpu in gpus:
        (roots.dev_root / f"nvidia{gpu.minor}").touch()
    lines = ["config 1", "monitor 2"]
    caps = roots.dev_root / "nvidia-caps"
    for gpu in gpus:
        if not gpu.mig_capable:
            continue
        table = mig_minors(gpu.minor)
        lines += [f"{name} {minor}" for name, minor in table]
        # The driver creates a capability node only once its instance exists.
        present = dict(table)
        for mig in gpu.migs:
            for name in (f"gi{mig.gi}/access", f"gi{mig.gi}/ci{mig.ci}/access"):
                caps.mkdir(exist_ok=True)
                (caps / f"nvidia-cap{present[f'gpu{gpu.minor}/{name}']}").touch()
    minors = roots.proc_root / "driver" / "nvidia-caps" / "mig-minors"
    minors.parent.mkdir(parents=True, exist_ok=True)
    minors.write_text("\n".join(lines) + "\n")
    return roots
