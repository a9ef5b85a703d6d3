"""Discovery: every GPU read through NVML (and sysfs for NUMA nodes and PCIe roots), and the
devices a resource advertises for them: full GPUs or MIG devices, with their nodes and facts.

``Inventory`` is what the last discovery found, the state the health, sharing and placement
pieces read.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import uuid as uuid_module
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from devplugin_sdk.backends import _sysfs
from devplugin_sdk.backends.nvidia.config import NvidiaConfig
from devplugin_sdk.backends.nvidia.library import (
    _nvml_fault,
    _optional,
    _text,
    pci_address,
)
from devplugin_sdk.backends.nvidia.mig import MigInfo, _read_mig_minors, scan_migs
from devplugin_sdk.errors import BackendError
from devplugin_sdk.types import Device, DeviceNode, Health, Partition, Quantity, Version

__all__ = ["GpuFacts", "GpuInfo", "Inventory"]

log = logging.getLogger(__name__)

# Driver control nodes a CUDA container needs besides /dev/nvidia<minor>, when present.
CONTROL_NODES = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset")

# nvml.h nvmlDeviceArchitecture_t, as NVIDIA's tools name them.
_ARCHITECTURES = {
    2: "Kepler",
    3: "Maxwell",
    4: "Pascal",
    5: "Volta",
    6: "Turing",
    7: "Ampere",
    8: "Ada Lovelace",
    9: "Hopper",
    10: "Blackwell",
}


@dataclass(frozen=True)
class GpuFacts:
    """What a GPU is, for a scheduler: published as DRA attributes, unknown ones left out.

    Each comes from an NVML call that older drivers or boards may not answer (Not Supported,
    Function Not Found); such a fact is None.
    """

    architecture: str | None = None
    compute_capability: Version | None = None
    driver_version: Version | None = None
    cuda_driver_version: Version | None = None
    pcie_root: str | None = None
    #: GPUs joined by NVLink (directly or through NVSwitches) share it; from the NVLink fabric
    #: (cluster UUID and clique) where NVML reports one.
    nvlink_domain: str | None = None
    fabric_cluster: str | None = None
    fabric_clique: int | None = None


@dataclass(frozen=True)
class GpuInfo:
    """One GPU as discovered through NVML (and sysfs for the NUMA node).

    ``fault`` is set when NVML could not read the GPU this time; the data are then the last
    ones read.
    """

    index: int
    uuid: str
    name: str
    memory_bytes: int
    pci_bus_id: str
    minor: int
    numa_node: int | None
    mig_enabled: bool
    migs: tuple[MigInfo, ...] = ()
    fault: str | None = None
    facts: GpuFacts = field(default_factory=GpuFacts)


@dataclass(frozen=True)
class Inventory:
    """What the last discovery found: the devices, and the GPUs they are on."""

    devices: Sequence[Device] = ()
    gpu_order: tuple[str, ...] = ()  # the GPUs of the devices, in NVML index order
    gpu_index: Mapping[str, str] = field(default_factory=dict)  # GPU UUID -> NVML index
    gpu_of_key: Mapping[str, str] = field(default_factory=dict)  # memory units: ID prefix -> GPU
    gpu_set: frozenset[str] = frozenset()  # the same GPUs, as a set


class Scanner:
    """The blocking NVML reads (run in a worker thread)."""

    def __init__(self, nvml: Any, config: NvidiaConfig) -> None:
        self.nvml = nvml
        self.config = config

    def gpus(self, known: Mapping[int, GpuInfo]) -> list[GpuInfo]:
        nvml = self.nvml
        try:
            count = nvml.nvmlDeviceGetCount()
        except nvml.NVMLError as exc:
            raise BackendError(f"NVML could not count GPUs: {exc}") from exc
        mig_minors = _read_mig_minors(self.config.proc_root)
        driver, cuda = self.system_facts()
        out: list[GpuInfo] = []
        links: dict[str, list[str]] = {}
        for index in range(count):
            try:
                gpu = self.gpu(index, mig_minors)
                links[pci_address(gpu.pci_bus_id)] = self.nvlink_remotes(index)
                facts = replace(gpu.facts, driver_version=driver, cuda_driver_version=cuda)
                out.append(replace(gpu, facts=facts))
            except nvml.NVMLError as exc:
                # One unreadable GPU never hides the others.
                previous = known.get(index)
                if previous is None:
                    log.warning("GPU %d cannot be read (%s); it is not advertised", index, exc)
                    continue
                log.warning("GPU %d (%s) cannot be read: %s", index, previous.uuid, exc)
                out.append(replace(previous, fault=_nvml_fault(nvml, exc, "discovery")))
        return _with_nvlink_domains(out, links)

    def system_facts(self) -> tuple[Version | None, Version | None]:
        """The driver's and CUDA's versions (the same for every GPU)."""
        nvml = self.nvml
        driver = _optional(nvml, nvml.nvmlSystemGetDriverVersion)
        cuda = _optional(nvml, getattr(nvml, "nvmlSystemGetCudaDriverVersion", None))
        return (
            _loose_version(_text(driver)) if driver is not None else None,
            # nvml.h: major * 1000 + minor * 10.
            Version(f"{cuda // 1000}.{cuda % 1000 // 10}.0")
            if isinstance(cuda, int) and cuda > 0
            else None,
        )

    def nvlink_remotes(self, index: int) -> list[str]:
        """PCI addresses of the far ends of GPU ``index``'s active NVLinks (GPUs, switches)."""
        nvml = self.nvml
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
        except nvml.NVMLError:
            return []
        remotes: list[str] = []
        for link in range(nvml.NVML_NVLINK_MAX_LINKS):
            try:
                if nvml.nvmlDeviceGetNvLinkState(handle, link) != nvml.NVML_FEATURE_ENABLED:
                    continue
                remotes.append(
                    pci_address(_text(nvml.nvmlDeviceGetNvLinkRemotePciInfo(handle, link).busId))
                )
            except nvml.NVMLError_NotSupported:
                if link == 0:
                    break  # no NVLink at all (PCIe-only boards)
            except (nvml.NVMLError, ValueError):
                continue
        return remotes

    def gpu(self, index: int, mig_minors: Mapping[str, int]) -> GpuInfo:
        nvml = self.nvml
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        uuid = _text(nvml.nvmlDeviceGetUUID(handle))
        bus_id = _text(nvml.nvmlDeviceGetPciInfo(handle).busId)
        minor = int(nvml.nvmlDeviceGetMinorNumber(handle))
        memory = int(nvml.nvmlDeviceGetMemoryInfo(handle).total)
        try:
            # kernel sysfs-bus-pci: numa_node is -1 when the platform reports no affinity.
            numa = _sysfs.numa_node(
                _sysfs.pci_device_dir(self.config.sysfs_root, pci_address(bus_id))
            )
        except ValueError:
            numa = None
        try:
            current, _pending = nvml.nvmlDeviceGetMigMode(handle)
            mig_enabled = current == nvml.NVML_DEVICE_MIG_ENABLE
        except nvml.NVMLError_NotSupported:
            mig_enabled = False  # not MIG-capable (pre-Ampere, consumer boards)
        migs: tuple[MigInfo, ...] = ()
        if mig_enabled:
            migs = tuple(
                scan_migs(
                    nvml,
                    handle,
                    parent_uuid=uuid,
                    minor=minor,
                    memory=memory,
                    mig_minors=mig_minors,
                )
            )
        try:
            root = _sysfs.pcie_root(self.config.sysfs_root, pci_address(bus_id))
        except ValueError:
            root = None
        return GpuInfo(
            index=index,
            uuid=uuid,
            name=_text(nvml.nvmlDeviceGetName(handle)),
            memory_bytes=memory,
            pci_bus_id=bus_id,
            minor=minor,
            numa_node=numa,
            mig_enabled=mig_enabled,
            migs=migs,
            facts=replace(self.device_facts(handle), pcie_root=root),
        )

    def device_facts(self, handle: Any) -> GpuFacts:
        """Architecture, compute capability and NVLink fabric of one GPU, where NVML says."""
        nvml = self.nvml
        arch = _optional(nvml, getattr(nvml, "nvmlDeviceGetArchitecture", None), handle)
        capability = _optional(
            nvml, getattr(nvml, "nvmlDeviceGetCudaComputeCapability", None), handle
        )
        cluster: str | None = None
        clique: int | None = None
        info_type = getattr(nvml, "c_nvmlGpuFabricInfo_t", None)
        if info_type is not None:
            info = info_type()
            done = _optional(
                nvml, getattr(nvml, "nvmlDeviceGetGpuFabricInfo", None), handle, ctypes.byref(info)
            )
            # nvml.h: the fabric is known once its state is COMPLETED and its status SUCCESS.
            if (
                done is not None
                and info.state == getattr(nvml, "NVML_GPU_FABRIC_STATE_COMPLETED", 3)
                and info.status == nvml.NVML_SUCCESS
                and any(info.clusterUuid)
            ):
                cluster = str(uuid_module.UUID(bytes=bytes(info.clusterUuid)))
                clique = int(info.cliqueId)
        return GpuFacts(
            architecture=_ARCHITECTURES.get(arch) if isinstance(arch, int) else None,
            compute_capability=Version(f"{capability[0]}.{capability[1]}.0")
            if isinstance(capability, tuple) and len(capability) == 2
            else None,
            nvlink_domain=f"{cluster}.{clique}" if cluster is not None else None,
            fabric_cluster=cluster,
            fabric_clique=clique,
        )


def _loose_version(text: str) -> Version | None:
    try:
        return Version.loose(text)
    except ValueError:
        return None


def _facts(gpu: GpuInfo) -> dict[str, str | int | Version]:
    """A GPU's facts as DRA attributes (``resource.kubernetes.io/`` ones as Kubernetes names
    them); unknown facts are left out."""
    facts = gpu.facts
    out: dict[str, str | int | Version | None] = {
        "architecture": facts.architecture,
        "cudaComputeCapability": facts.compute_capability,
        "driverVersion": facts.driver_version,
        "cudaDriverVersion": facts.cuda_driver_version,
        "numaNode": gpu.numa_node,
        "nvlinkDomain": facts.nvlink_domain,
        "fabricClusterUUID": facts.fabric_cluster,
        "fabricCliqueID": facts.fabric_clique,
        "resource.kubernetes.io/pcieRoot": facts.pcie_root,
    }
    with contextlib.suppress(ValueError):
        out["resource.kubernetes.io/pciBusID"] = pci_address(gpu.pci_bus_id)
    out.update(_sysfs.numa_attribute(gpu.numa_node))
    return {k: v for k, v in out.items() if v is not None}


def _with_nvlink_domains(gpus: list[GpuInfo], links: Mapping[str, Sequence[str]]) -> list[GpuInfo]:
    """Give GPUs joined by NVLink (directly, or through the same NVSwitches) one domain: the
    lowest PCI address among them. A fabric's own domain (cluster and clique) is kept."""
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for gpu_address, remotes in links.items():
        for remote in remotes:
            a, b = find(gpu_address), find(remote)
            if a != b:
                parent[max(a, b)] = min(a, b)
    linked = {address for address, remotes in links.items() if remotes}
    members: dict[str, list[str]] = {}
    for address in linked:
        members.setdefault(find(address), []).append(address)
    domain = {a: min(group) for group in members.values() for a in group}
    out = []
    for gpu in gpus:
        try:
            address = pci_address(gpu.pci_bus_id)
        except ValueError:
            address = ""
        if gpu.facts.nvlink_domain is None and address in domain:
            joined = replace(gpu.facts, nvlink_domain=f"nvlink-{domain[address]}")
            out.append(replace(gpu, facts=joined))
        else:
            out.append(gpu)
    return out


def _units(device: Device) -> tuple[str, ...]:
    """The units whose faults a device suffers: its MIG instance (if any) and its GPU."""
    return tuple(dict.fromkeys((device.text("uuid"), device.text("gpuUUID"))))


def control_nodes(config: NvidiaConfig) -> tuple[DeviceNode, ...]:
    """The driver's control nodes present on the host."""
    return tuple(
        DeviceNode(f"/dev/{name}") for name in CONTROL_NODES if (config.dev_root / name).exists()
    )


def select(
    gpus: Sequence[GpuInfo],
    config: NvidiaConfig,
    mig_profile: str | None,
    health: Callable[[Sequence[str]], Health],
) -> list[Device]:
    """The GPUs or MIG devices a resource serves under ``config.mig_strategy``, one device each.

    Args:
        gpus: Every GPU of the node.
        config: Backend settings.
        mig_profile: The MIG profile served (``mixed``), or None.
        health: The health of a device on these units (its MIG instance, its GPU).

    Raises:
        BackendError: ``single`` meets a mixed MIG layout.
    """
    control = control_nodes(config)
    by_uuid = {g.uuid: g for g in gpus}
    strategy = config.mig_strategy
    if mig_profile is not None:
        migs = [m for g in gpus for m in g.migs if m.profile == mig_profile]
        return [mig_device(m, by_uuid[m.parent_uuid], control, health) for m in migs]
    enabled = [g for g in gpus if g.mig_enabled]
    if strategy == "single" and enabled:
        disabled = [g.index for g in gpus if not g.mig_enabled]
        if disabled:
            raise BackendError(
                f"migStrategy single: GPUs {disabled} have MIG disabled while others have it"
                " enabled; enable MIG everywhere or use migStrategy mixed"
            )
        profiles = sorted({m.profile for g in gpus for m in g.migs})
        if len(profiles) > 1:
            raise BackendError(
                f"migStrategy single needs one MIG profile on every GPU, found {profiles};"
                " use migStrategy mixed"
            )
        return [mig_device(m, g, control, health) for g in gpus for m in g.migs]
    if strategy == "mixed":
        gpus = [g for g in gpus if not g.mig_enabled]
    return [gpu_device(g, control, health) for g in gpus]


def gpu_device(
    gpu: GpuInfo, control: tuple[DeviceNode, ...], health: Callable[[Sequence[str]], Health]
) -> Device:
    """A full GPU as a device."""
    return Device(
        id=gpu.uuid,
        health=health((gpu.uuid,)),
        numa_nodes=() if gpu.numa_node is None else (gpu.numa_node,),
        device_nodes=(DeviceNode(f"/dev/nvidia{gpu.minor}"), *control),
        attributes={
            "type": "gpu",
            "uuid": gpu.uuid,
            "gpuUUID": gpu.uuid,
            "index": gpu.index,
            "name": gpu.name,
            "memoryMiB": gpu.memory_bytes >> 20,
            "pciBusID": gpu.pci_bus_id,
            "minor": gpu.minor,
            **_facts(gpu),
        },
        capacity={"memory": Quantity(gpu.memory_bytes)},
    )


def mig_device(
    mig: MigInfo,
    gpu: GpuInfo,
    control: tuple[DeviceNode, ...],
    health: Callable[[Sequence[str]], Health],
) -> Device:
    """A MIG device as a device: its GPU's node, its capability nodes, a child of its GPU, and
    for DRA a partition of it (static MIG: the instance exists; its memory is counted against
    the GPU's, so DRA gives the GPU or its instances, never both)."""
    nodes = (DeviceNode(f"/dev/nvidia{gpu.minor}"), *(DeviceNode(c) for c in mig.cap_nodes))
    partition = Partition(
        gpu_device(gpu, control, health),
        counters={"memory": Quantity(gpu.memory_bytes)},
        consumes={"memory": Quantity(mig.memory_bytes)},
    )
    return Device(
        id=mig.uuid,
        health=health((mig.uuid, gpu.uuid)),
        numa_nodes=() if gpu.numa_node is None else (gpu.numa_node,),
        device_nodes=(*nodes, *control),
        parent=gpu.uuid,
        attributes={
            "type": "mig",
            "uuid": mig.uuid,
            "gpuUUID": gpu.uuid,
            "index": gpu.index,
            "name": f"{gpu.name} MIG {mig.profile}",
            "memoryMiB": mig.memory_bytes >> 20,
            "pciBusID": gpu.pci_bus_id,
            "minor": gpu.minor,
            "migProfile": mig.profile,
            "gi": mig.gi,
            "ci": mig.ci,
            **_facts(gpu),
        },
        capacity={"memory": Quantity(mig.memory_bytes)},
        partition=partition,
    )
