"""Sharing full GPUs: memory units (gpushare's model, one device per unit of a GPU's memory)
and slices (HAMi's static split), with the limits a container gets and the placement that keeps
a container's units on one GPU or its slices on different GPUs. Time-slicing is only replicas
(``types.replicate``) and needs nothing here. docs/sharing.md compares the ways to share.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from devplugin_sdk import allocation
from devplugin_sdk.allocation import (
    Placement,
    matrix_score,
    numbered_list_bytes,
    place_together,
    spread_apart,
)
from devplugin_sdk.backends.nvidia.config import MemorySharing, NvidiaConfig, VgpuSharing
from devplugin_sdk.backends.nvidia.container import _with_limits, container_setup
from devplugin_sdk.backends.nvidia.discovery import GpuInfo, Inventory
from devplugin_sdk.backends.nvidia.topology import _NUMA_BONUS, _Topology
from devplugin_sdk.errors import AllocationError
from devplugin_sdk.types import Allocation, Device, Shareable

__all__ = [
    "Shares",
    "check_list_size",
    "check_replicas",
    "enforced",
    "memory_units",
    "shared_for_dra",
]

# gpushare's variables (AliyunContainerService/gpushare-device-plugin pkg/gpu/nvidia/const.go):
# the GPU's index, its memory and the container's share, both in units.
GPUSHARE_INDEX_ENV = "ALIYUN_COM_GPU_MEM_IDX"
GPUSHARE_DEVICE_ENV = "ALIYUN_COM_GPU_MEM_DEV"
GPUSHARE_CONTAINER_ENV = "ALIYUN_COM_GPU_MEM_CONTAINER"
# HAMi-core's (libvgpu.so) limits: CUDA_DEVICE_MEMORY_LIMIT_<i> ("<MiB>m") for the i-th visible
# GPU, CUDA_DEVICE_SM_LIMIT in percent of the SMs (HAMi pkg/device-plugin/.../plugin/server.go).
MEMORY_LIMIT_ENV = "CUDA_DEVICE_MEMORY_LIMIT_{}"
SM_LIMIT_ENV = "CUDA_DEVICE_SM_LIMIT"
# nvidia-container-toolkit's apply-cuda-memory-limits CDI hook (NVIDIA/nvidia-container-toolkit
# cmd/nvidia-cdi-hook/apply-cuda-memory-limits): reads both from the container's environment,
# whole MiB, does nothing unless both are set, refuses a request over the limit, and sets them
# on the container's cgroup for each of its GPUs through NVML (driver r615 and newer).
TOOLKIT_REQUEST_ENV = "NVIDIA_GPU_MEMORY_REQUEST"
TOOLKIT_LIMIT_ENV = "NVIDIA_GPU_MEMORY_LIMIT"


@dataclass(frozen=True)
class _Asked:
    """A GetPreferredAllocation of shares: its size, the IDs offered, the free shares by GPU."""

    size: int
    available: Sequence[str]  # a set only when a refusal needs it
    free: Mapping[str, int]


def _unit_keys(gpus: Sequence[str]) -> dict[str, str]:
    """The prefix of each GPU's memory-unit IDs: the first group of its UUID.

    ``GPU-8f3a2b1c-...`` gives ``8f3a2b1c``: short, because a node with MiB units lists tens of
    thousands of IDs against the kubelet's 4 MiB limit, and stable, because the kubelet's
    checkpoint keeps the IDs of running pods across plugin restarts and reboots (an NVML index
    can change when a GPU goes missing). A GPU whose first group another GPU of the node shares
    uses its whole UUID.
    """
    first = {uuid: uuid.removeprefix("GPU-").split("-", 1)[0] or uuid for uuid in gpus}
    seen: dict[str, int] = {}
    for key in first.values():
        seen[key] = seen.get(key, 0) + 1
    return {uuid: key if seen[key] == 1 else uuid for uuid, key in first.items()}


def memory_units(
    units: Sequence[Device], memory: MemorySharing
) -> tuple[list[Device], dict[str, str]]:
    """The memory units of the GPUs ``units``, and the GPU of each unit-ID prefix."""
    keys = _unit_keys([g.id for g in units])
    # DRA publishes each GPU once, its memory consumable in units (dra/_claims/shares.py); the
    # GPU count (countResourceName) is that same device, so a claim asking no memory takes all.
    shareable = Shareable("memory", memory.unit_mib << 20, whole_by_default=True)
    devices = [
        # Children of their GPU: its faults (reported by GPU UUID) take them all out.
        replace(gpu, id=f"{keys[gpu.id]}-{n}", parent=gpu.id, shareable=shareable)
        for gpu in units
        for n in range(gpu.number("memoryMiB") // memory.unit_mib)
    ]
    return devices, {key: uuid for uuid, key in keys.items()}


def check_list_size(config: NvidiaConfig, gpus: Sequence[GpuInfo]) -> None:
    """Refuse memory units whose ListAndWatch list could pass the kubelet's limit.

    Raises:
        ConfigError: on ``sharing.memory.unit``, naming the size.
    """
    memory = config.memory
    assert memory is not None
    served = [g for g in gpus if not (config.mig_strategy == "mixed" and g.mig_enabled)]
    keys = _unit_keys([g.uuid for g in served])
    size = count = 0
    for gpu in served:
        units = (gpu.memory_bytes >> 20) // memory.unit_mib
        numa = () if gpu.numa_node is None else (gpu.numa_node,)
        count += units
        size += numbered_list_bytes(f"{keys[gpu.uuid]}-", units, numa)
    allocation.check_list_size(
        "sharing.memory.unit",
        size,
        f"{memory.unit} units",
        "use GiB",
        where=f"here ({count:,} devices on {len(served)} GPUs)",
    )


def check_replicas(config: NvidiaConfig, units: Sequence[Device], served: str) -> None:
    """Refuse time-slicing replicas whose ListAndWatch list could pass the kubelet's limit.

    Args:
        config: Backend settings.
        units: The GPUs or MIG devices of one resource (each replicated ``config.replicas``
            times).
        served: What a unit is, for the message (``GPU``, ``1g.10gb MIG device``).

    Raises:
        ConfigError: on ``sharing.timeSlicing.replicas``, naming the size.
    """
    replicas = config.replicas

    def size(count: int) -> int:
        return sum(numbered_list_bytes(f"{u.id}::", count, u.numa_nodes) for u in units)

    allocation.check_list_size(
        "sharing.timeSlicing.replicas",
        size(replicas),
        f"{replicas:,} replicas",
        f"at most {allocation.most_that_fit(size, replicas):,} fit",
        where=(
            f"here ({replicas * len(units):,} devices on {len(units)} {served}"
            f"{'' if len(units) == 1 else 's'})"
        ),
    )


class Shares:
    """Allocation and placement of memory units and slices for one resource.

    Args:
        config: Backend settings (``memory`` or ``vgpu`` set).
        resource_name: For messages.
    """

    def __init__(
        self, config: NvidiaConfig, resource_name: str, inventory: Callable[[], Inventory]
    ) -> None:
        self.config = config
        self.resource_name = resource_name
        self._inventory = inventory
        self._asked: _Asked | None = None  # the last GetPreferredAllocation of shares

    @property
    def _gpu_index(self) -> Mapping[str, str]:
        return self._inventory().gpu_index

    @property
    def _gpu_order(self) -> tuple[str, ...]:
        return self._inventory().gpu_order

    @property
    def _gpu_of_key(self) -> Mapping[str, str]:
        return self._inventory().gpu_of_key

    def place_units(self, ids: Sequence[str], must: Sequence[str], size: int) -> Sequence[str]:
        """Memory units: all on one GPU, chosen by ``placement``; when none can hold them, on
        as few GPUs as possible."""
        assert self.config.memory is not None
        placed = place_together(
            ids,
            size,
            self._gpu_of_unit,
            must_include=must,
            placement=self.config.memory.placement,
            unit_order=self._gpu_order,
        )
        return self._remember(ids, size, placed)

    def place_slices(
        self,
        available: Sequence[Device],
        must: Sequence[str],
        size: int,
        topology: _Topology,
    ) -> Sequence[str]:
        """Slices: on different GPUs, those with the most free slices first, then the best
        connected."""
        ids = [d.id for d in available]
        numa = {d.text("gpuUUID"): d.numa_nodes for d in available}
        links = matrix_score(topology.scores)

        def link(a: str, b: str) -> float:
            same_numa = bool(numa.get(a)) and numa.get(a) == numa.get(b)
            return links(a, b) + (_NUMA_BONUS if same_numa else 0.0)

        placed = spread_apart(
            ids,
            size,
            {d.id: d.text("gpuUUID") for d in available},
            must_include=must,
            link_score=link,
            unit_order=self._gpu_order,
        )
        return self._remember(ids, size, placed)

    def allocate_memory(self, devices: Sequence[Device]) -> Allocation:
        memory = self.config.memory
        assert memory is not None
        by_gpu = self._by_gpu(devices)
        if len(by_gpu) > 1 and not memory.multi_gpu:
            # The kubelet fails the pod's admission on an Allocate error, for good: better than
            # a container whose memory is on GPUs it was not meant to use.
            raise AllocationError(self._units_apart(devices, by_gpu))
        # One unit per GPU carries the GPU's nodes: merging 40,000 identical ones would not.
        allocation = container_setup(
            self.config, list(by_gpu), [units[0] for units in by_gpu.values()]
        )
        env = dict(allocation.env)
        gpu_units = (u[0].number("memoryMiB") // memory.unit_mib for u in by_gpu.values())
        env[GPUSHARE_INDEX_ENV] = ",".join(self._gpu_index[g] for g in by_gpu)
        env[GPUSHARE_DEVICE_ENV] = ",".join(str(n) for n in gpu_units)
        env[GPUSHARE_CONTAINER_ENV] = str(len(devices))
        for i, units in enumerate(by_gpu.values()):
            env[MEMORY_LIMIT_ENV.format(i)] = f"{len(units) * memory.unit_mib}m"
        return _with_limits(allocation, env, memory.interceptor)

    def allocate_slices(self, devices: Sequence[Device], vgpu: VgpuSharing) -> Allocation:
        by_gpu = self._by_gpu(devices)
        if len(by_gpu) < len(devices):
            raise AllocationError(self._slices_together(devices, by_gpu))
        allocation = container_setup(
            self.config, list(by_gpu), [slices[0] for slices in by_gpu.values()]
        )
        env = dict(allocation.env)
        if vgpu.memory_limit:
            for i, slices in enumerate(by_gpu.values()):
                share = slices[0].number("memoryMiB") // vgpu.slices
                env[MEMORY_LIMIT_ENV.format(i)] = f"{share}m"
        if vgpu.core_limit:
            env[SM_LIMIT_ENV] = str(100 // vgpu.slices)
        return _with_limits(allocation, env, vgpu.interceptor)

    def _by_gpu(self, devices: Sequence[Device]) -> dict[str, list[Device]]:
        """``devices`` grouped by GPU, GPUs in NVML index order (the order of the limits)."""
        groups: dict[str, list[Device]] = {}
        for device in devices:
            groups.setdefault(device.text("gpuUUID"), []).append(device)
        return {g: groups[g] for g in sorted(groups, key=lambda g: int(self._gpu_index[g]))}

    def _free_when_asked(self, devices: Sequence[Device]) -> Mapping[str, int] | None:
        """Free shares by GPU in the preferred-allocation call that chose ``devices``, if known.

        The kubelet admits one container at a time and asks for a preference just before it
        allocates, so the last call is this container's when it offered these devices.
        """
        asked = self._asked
        if asked is None or asked.size != len(devices):
            return None
        offered = set(asked.available)
        if not all(d.id in offered for d in devices):
            return None
        return asked.free

    def _units_apart(self, devices: Sequence[Device], by_gpu: Mapping[str, list[Device]]) -> str:
        """Why memory units on several GPUs are refused, with the largest free block per GPU."""
        unit = self.config.memory.unit if self.config.memory else "units"
        asked = len(devices)
        spread = ", ".join(
            f"{len(u)} {unit} on GPU {self._gpu_index[g]}" for g, u in by_gpu.items()
        )
        free = self._free_when_asked(devices)
        if free is None:
            why = (
                f"{asked} {unit} requested, and the kubelet chose units on several GPUs ({spread})"
            )
        else:
            best = max(self._gpu_order, key=lambda g: free.get(g, 0))  # the first on a tie
            most = free.get(best, 0)
            if most >= asked:
                why = (
                    f"{asked} {unit} requested, and the kubelet chose units on several GPUs"
                    f" ({spread}) although GPU {self._gpu_index[best]} had {most} {unit} free"
                )
            else:
                table = " ".join(f"{self._gpu_index[g]}:{free.get(g, 0)}" for g in self._gpu_order)
                why = (
                    f"no single GPU has {asked} {unit} free; largest free: {most} {unit} on GPU"
                    f" {self._gpu_index[best]} (free {unit} by GPU: {table})"
                )
        return (
            f"{self.resource_name}: {why}; a container's memory must be on one GPU"
            " (sharing.memory.multiGpu allows several)"
        )

    def _slices_together(
        self, devices: Sequence[Device], by_gpu: Mapping[str, list[Device]]
    ) -> str:
        """Why slices sharing a GPU are refused."""
        spread = ", ".join(f"{len(s)} on GPU {self._gpu_index[g]}" for g, s in by_gpu.items())
        why = f"{len(devices)} slices requested, got {spread}"
        free = self._free_when_asked(devices)
        if free is not None:
            why += f"; {sum(1 for n in free.values() if n)} GPUs had a free slice"
        return f"{self.resource_name}: {why}; each slice of a container must be on a different GPU"

    def _gpu_of_unit(self, device_id: str) -> str:
        """The GPU of a memory unit, from its ID (``<key>-<n>``)."""
        key = device_id.rpartition("-")[0]
        return self._gpu_of_key.get(key, key)

    def _remember(self, ids: Sequence[str], size: int, placed: Placement) -> tuple[str, ...]:
        self._asked = _Asked(size, ids, placed.free)
        return placed.device_ids


def shared_for_dra(
    shares: Sequence[Device], config: NvidiaConfig, vgpu: VgpuSharing | None
) -> list[Device]:
    """Time-slicing replicas or slices of full GPUs, described for DRA: each GPU published once
    for several claims, a claim taking one slice (its memory share, the limits ``allocate``
    sets) or, for replicas, one of ``shares`` (more unless ``failRequestsGreaterThanOne``).
    Replicas of MIG devices are left as they are (a MIG device's parent is its GPU)."""
    described: dict[str, Shareable] = {}
    out = []
    for share in shares:
        if share.parent is None or share.attributes.get("type") != "gpu":
            out.append(share)
            continue
        shareable = described.get(share.parent)
        if shareable is None:
            if vgpu is not None:
                unit = (share.number("memoryMiB") // vgpu.slices) << 20
                shareable = Shareable("memory", max(unit, 1), most=1)
            else:
                most = 1 if config.fail_requests_greater_than_one else None
                shareable = Shareable("shares", 1, most=most)
            described[share.parent] = shareable
        out.append(replace(share, shareable=shareable))
    return out


def enforced(allocation: Allocation) -> Allocation:
    """``allocation`` with the toolkit hook's variables beside HAMi-core's limits (DRA).

    The hook sets one limit for every GPU of the container, so the variables are set only when
    the container's memory limits (``CUDA_DEVICE_MEMORY_LIMIT_<i>``, ``<MiB>m``) are one amount:
    a share of one GPU, or equal shares of several. Request and limit are that amount: a share
    is reserved whole.
    """
    limits = {v for k, v in allocation.env.items() if k.startswith(MEMORY_LIMIT_ENV.format(""))}
    if len(limits) != 1:
        return allocation
    mib = next(iter(limits)).removesuffix("m")
    env = {**allocation.env, TOOLKIT_REQUEST_ENV: mib, TOOLKIT_LIMIT_ENV: mib}
    return replace(allocation, env=env)
