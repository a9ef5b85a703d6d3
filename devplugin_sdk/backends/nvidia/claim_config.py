"""NVIDIA's DRA claim configuration kinds, ``GpuConfig`` and ``MigDeviceConfig``, read and applied
with the semantics of NVIDIA's DRA driver (kubernetes-sigs/dra-driver-nvidia-gpu,
``api/nvidia.com/resource/v1beta1/{gpuconfig,migconfig,sharing,validate}.go`` and
``cmd/gpu-kubelet-plugin/{device_state,sharing,nvlib}.go``), so that its users' claims need no
edit. What differs, and why, is the table "NVIDIA's driver / ours" in docs/dra.md. The MPS control
daemon is not started here: ``MPS`` gives the containers CUDA's client variables only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal, TypeVar

import anyio

from devplugin_sdk.config import ConfigReader, shown
from devplugin_sdk.dra.config import ConfigKind, RequestConfig
from devplugin_sdk.errors import AllocationError, ConfigError
from devplugin_sdk.types import Allocation, Device, Quantity

__all__ = [
    "GPU_CONFIG",
    "MIG_DEVICE_CONFIG",
    "NVIDIA_GPU_CONFIG",
    "NVIDIA_MIG_DEVICE_CONFIG",
    "ClaimSharing",
    "GpuConfig",
    "MigDeviceConfig",
    "MpsConfig",
    "apply_mps",
    "reset_timeslice",
    "set_timeslice",
]

#: NVIDIA's API group and version (``api/nvidia.com/resource/v1beta1/register.go``).
NVIDIA_GROUP = "resource.nvidia.com"
NVIDIA_VERSION = "v1beta1"
#: ``nvidia-smi compute-policy --set-timeslice`` values (``sharing.go`` ``TimeSliceInterval.Int``).
TIMESLICE_INTERVALS = {"Default": 0, "Short": 1, "Medium": 2, "Long": 3}
STRATEGIES = ("TimeSlicing", "MPS")
ACTIVE_THREAD_ENV = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
PINNED_MEMORY_ENV = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"
_MIB = 1 << 20

Strategy = Literal["TimeSlicing", "MPS"]
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class MpsConfig:
    """MPS limits for a claim's containers (NVIDIA's ``MpsConfig``).

    Attributes:
        active_thread_percentage: Percent of the SMs a client may use (0-100); None: no limit.
        pinned_memory_limit: Device memory each device may pin for a client; None: no limit.
        per_device: Overrides of ``pinned_memory_limit``, keyed by device UUID or by position in
            the sorted list of the request's device UUIDs (NVIDIA's ``uuidSet.Normalize``).
        multi_user: NVIDIA's ``multiUser`` (its daemon's multi-user mode); read, and without a
            daemon of our own it changes nothing.
    """

    active_thread_percentage: int | None = None
    pinned_memory_limit: Quantity | None = None
    per_device: Mapping[str, Quantity] = field(default_factory=dict)
    multi_user: bool | None = None


@dataclass(frozen=True, slots=True)
class GpuConfig:
    """A ``GpuConfig``: how a request's full GPUs are shared.

    Attributes:
        strategy: ``TimeSlicing``, ``MPS``, or None (no ``sharing``: nothing is done).
        interval: The time slice (``TimeSlicing``).
        mps: The limits (``MPS``).
    """

    strategy: Strategy | None = None
    interval: str = "Default"
    mps: MpsConfig = field(default_factory=MpsConfig)


@dataclass(frozen=True, slots=True)
class MigDeviceConfig:
    """A ``MigDeviceConfig``: how a request's MIG devices are shared (``TimeSlicing`` is
    accepted and does nothing, as in NVIDIA's driver: a MIG device has no time slice of its own).

    Attributes:
        strategy: ``TimeSlicing``, ``MPS``, or None (no ``sharing``).
        mps: The limits (``MPS``).
    """

    strategy: Strategy | None = None
    mps: MpsConfig = field(default_factory=MpsConfig)


def _limit(reader: ConfigReader, name: str) -> Quantity | None:
    """A pinned-memory limit: a quantity of at least 1 MiB (NVIDIA's ``limit.Megabyte``
    refuses what rounds down to 0 MiB: "value set too low")."""
    value = reader.data.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise ConfigError(reader.key(name), f"must be a quantity like 10Gi, got {shown(value)}")
    try:
        quantity = Quantity.parse(str(value))
    except ValueError as exc:
        raise ConfigError(reader.key(name), str(exc)) from None
    if quantity.value < _MIB:
        raise ConfigError(reader.key(name), f"value set too low: {value} is under 1Mi")
    return quantity


def _read_mps(sharing: ConfigReader) -> MpsConfig:
    mps = sharing.section("mpsConfig")
    mps.known(
        "defaultActiveThreadPercentage",
        "defaultPinnedDeviceMemoryLimit",
        "defaultPerDevicePinnedMemoryLimit",
        "multiUser",
    )
    percentage = (
        mps.integer("defaultActiveThreadPercentage", 100, minimum=0, maximum=100)
        if mps.has("defaultActiveThreadPercentage")
        else None
    )
    per_device: dict[str, Quantity] = {}
    limits = mps.section("defaultPerDevicePinnedMemoryLimit")
    for key in list(limits.data):
        if not isinstance(key, str) or not key:
            raise ConfigError(limits.prefix, f"keys must be UUIDs or indexes, got {shown(key)}")
        value = _limit(limits, key)
        if value is not None:
            per_device[key] = value
    multi_user = mps.boolean("multiUser", False) if mps.has("multiUser") else None
    return MpsConfig(
        percentage, _limit(mps, "defaultPinnedDeviceMemoryLimit"), per_device, multi_user
    )


def _strategy(sharing: ConfigReader) -> Strategy:
    """``sharing.strategy``: required once ``sharing`` is given (``validate.go``
    ``validateSharingStrategy``: an empty strategy is an unknown one)."""
    value = sharing.data.get("strategy")
    if value == "TimeSlicing":
        return "TimeSlicing"
    if value == "MPS":
        return "MPS"
    raise ConfigError(
        sharing.key("strategy"),
        f"unknown GPU sharing strategy: {shown(value)}, supported GPU sharing strategies: "
        "TimeSlicing, MPS",
    )


def read_gpu_config(reader: ConfigReader) -> GpuConfig:
    """Read a ``GpuConfig`` (its ``apiVersion`` and ``kind`` already read).

    Raises:
        ConfigError: naming the key (``sharing.mpsConfig.defaultActiveThreadPercentage``).
    """
    reader.known("apiVersion", "kind", "sharing")
    if reader.data.get("sharing") is None:
        return GpuConfig()
    sharing = reader.section("sharing")
    sharing.known("strategy", "timeSlicingConfig", "mpsConfig")
    strategy = _strategy(sharing)
    if strategy == "TimeSlicing":
        # sharing.go GpuSharing.GetTimeSlicingConfig refuses an mpsConfig beside it.
        if sharing.has("mpsConfig"):
            raise ConfigError(sharing.key("mpsConfig"), "cannot be used with strategy TimeSlicing")
        slicing = sharing.section("timeSlicingConfig")
        slicing.known("interval")
        interval = slicing.choice("interval", tuple(TIMESLICE_INTERVALS), "Default")
        return GpuConfig("TimeSlicing", interval=interval)
    if sharing.has("timeSlicingConfig"):
        raise ConfigError(sharing.key("timeSlicingConfig"), "cannot be used with strategy MPS")
    return GpuConfig("MPS", mps=_read_mps(sharing))


def read_mig_device_config(reader: ConfigReader) -> MigDeviceConfig:
    """Read a ``MigDeviceConfig`` (``sharing.strategy`` and ``sharing.mpsConfig``).

    Raises:
        ConfigError: naming the key.
    """
    reader.known("apiVersion", "kind", "sharing")
    if reader.data.get("sharing") is None:
        return MigDeviceConfig()
    sharing = reader.section("sharing")
    sharing.known("strategy", "mpsConfig")
    strategy = _strategy(sharing)
    if strategy == "TimeSlicing":
        # sharing.go/validate.go: MigDeviceSharing accepts TimeSlicing and checks nothing else.
        return MigDeviceConfig("TimeSlicing")
    return MigDeviceConfig("MPS", mps=_read_mps(sharing))


#: NVIDIA's kinds, ``resource.nvidia.com/v1beta1``: claims written for NVIDIA's driver.
NVIDIA_GPU_CONFIG: ConfigKind[GpuConfig] = ConfigKind(
    "GpuConfig", NVIDIA_VERSION, read_gpu_config, group=NVIDIA_GROUP
)
NVIDIA_MIG_DEVICE_CONFIG: ConfigKind[MigDeviceConfig] = ConfigKind(
    "MigDeviceConfig", NVIDIA_VERSION, read_mig_device_config, group=NVIDIA_GROUP
)
#: The same kinds under the driver's own group (``<driver>/v1alpha1``), read the same way.
GPU_CONFIG: ConfigKind[GpuConfig] = ConfigKind("GpuConfig", "v1alpha1", read_gpu_config)
MIG_DEVICE_CONFIG: ConfigKind[MigDeviceConfig] = ConfigKind(
    "MigDeviceConfig", "v1alpha1", read_mig_device_config
)


#: The kinds the NVIDIA backend reads, NVIDIA's first.
KINDS: tuple[ConfigKind[GpuConfig] | ConfigKind[MigDeviceConfig], ...] = (
    NVIDIA_GPU_CONFIG,
    NVIDIA_MIG_DEVICE_CONFIG,
    GPU_CONFIG,
    MIG_DEVICE_CONFIG,
)


class ClaimSharing:
    """Applies a request's ``GpuConfig``/``MigDeviceConfig`` and undoes its time slices.

    Which GPUs this process set a time slice on is kept in memory: a GPU is reset to Default
    when the last prepared claim holding it is unprepared (NVIDIA keeps ``timeSliceApplied`` in
    its checkpoint; after a restart of ours, a claim prepared before it is not reset).
    """

    def __init__(self) -> None:
        self._sliced: set[str] = set()

    async def apply(
        self,
        devices: Sequence[Device],
        config: RequestConfig,
        allocation: Allocation,
        nvidia_smi: Sequence[str],
    ) -> Allocation:
        """``allocation`` (the request's edits) under its configuration.

        GpuConfig applies to full GPUs and MigDeviceConfig to MIG devices; an entry that names
        the request and does not fit its devices fails the claim, one that names no request is
        skipped for them (``device_state.go`` ``validateDeviceConfigType``,
        ``matchesDeviceType``).

        Raises:
            AllocationError: the configuration does not fit, or ``nvidia-smi`` failed.
        """
        migs = [d for d in devices if d.attributes.get("type") == "mig"]
        gpus = [d for d in devices if d.attributes.get("type") != "mig"]
        gpu: GpuConfig | None = _fitting(config, GPU_CONFIG, gpus, migs)
        mig: MigDeviceConfig | None = _fitting(config, MIG_DEVICE_CONFIG, migs, gpus)
        if gpu is not None and gpu.strategy == "MPS" and mig is not None and mig.strategy == "MPS":
            raise AllocationError(
                f"request {config.request}: MPS on both full GPUs and MIG devices in one request "
                "is not supported; split the request"
            )
        if gpu is not None and gpu.strategy == "TimeSlicing":
            uuids = sorted({uuid_of(d) for d in gpus})  # allocatable.go GpuUUIDs: sorted
            await set_timeslice(nvidia_smi, uuids, gpu.interval)
            self._sliced.update(uuids)
        if gpu is not None and gpu.strategy == "MPS":
            allocation = apply_mps(gpu.mps, gpus, allocation)
        if mig is not None and mig.strategy == "MPS":
            allocation = apply_mps(mig.mps, migs, allocation)
        return allocation

    async def release(
        self, devices: Sequence[Device], others: Sequence[Device], nvidia_smi: Sequence[str]
    ) -> None:
        """Reset to Default the time slice of ``devices``' GPUs that this process set and that
        no other prepared claim holds (``device_state.go`` ``unprepareDevices``).

        Raises:
            AllocationError: ``nvidia-smi`` failed.
        """
        held = {uuid_of(d) for d in others}
        uuids = sorted({uuid_of(d) for d in devices} & self._sliced - held)
        if uuids:
            await reset_timeslice(nvidia_smi, uuids)
            self._sliced.difference_update(uuids)


def _fitting(
    config: RequestConfig, kind: ConfigKind[T], fit: Sequence[Device], misfit: Sequence[Device]
) -> T | None:
    """The request's value of ``kind`` for the devices it fits (``fit``); an entry naming the
    request fails it when some of its devices do not fit (``misfit``)."""
    value = config.get(kind)
    if value is None:
        return None
    name = kind.kind
    if misfit and name not in config.general:
        device = misfit[0]
        raise AllocationError(
            f"cannot apply {name} to device {device.id} of type "
            f"{device.attributes.get('type') or 'gpu'} (request: {config.request})"
        )
    return value if fit else None


def uuid_of(device: Device) -> str:
    """The device's own UUID (a MIG device's, not its GPU's), as NVIDIA's ``UUIDs()``."""
    return str(device.attributes.get("uuid") or device.id)


def apply_mps(mps: MpsConfig, devices: Sequence[Device], allocation: Allocation) -> Allocation:
    """``allocation`` with CUDA's MPS client variables for ``devices``.

    Raises:
        AllocationError: a per-device key names no device of the request, or the limits differ
            between devices (CUDA's client variable keys devices by an ordinal whose order is
            CUDA's, not the claim's; NVIDIA sets them by UUID through its daemon, which we do not
            start yet).
    """
    env = dict(allocation.env)
    if mps.active_thread_percentage is not None:
        env[ACTIVE_THREAD_ENV] = str(mps.active_thread_percentage)
    limits = _pinned_limits(mps, sorted({uuid_of(d) for d in devices}))
    if limits:
        env[PINNED_MEMORY_ENV] = limits
    return replace(allocation, env=env)


def _pinned_limits(mps: MpsConfig, uuids: Sequence[str]) -> str:
    """``0=10240M,1=10240M``: the same limit on every visible device, or nothing."""
    where = "sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit"
    limits: dict[str, int] = {}
    if mps.pinned_memory_limit is not None:
        limits = dict.fromkeys(uuids, mps.pinned_memory_limit.value // _MIB)
    for key, value in mps.per_device.items():
        # sharing.go uuidSet.Normalize: a UUID of the set, else a position in the sorted list.
        if key in uuids:
            limits[key] = value.value // _MIB
        elif key.isdigit() and int(key) < len(uuids):
            limits[uuids[int(key)]] = value.value // _MIB
        else:
            raise AllocationError(
                f"{where}.{key}: invalid device: not a UUID of this request's devices nor a "
                f"position in their sorted UUID list ({', '.join(uuids)})"
            )
    if not limits:
        return ""
    if len(limits) != len(uuids) or len(set(limits.values())) != 1:
        raise AllocationError(
            f"{where}: limits that differ between the request's devices "
            f"({', '.join(f'{u}={m}M' for u, m in limits.items())}) need the MPS control daemon "
            "(set by UUID), which this driver does not start; CUDA's client variable keys "
            "devices by CUDA's own order. Give every device the same limit"
        )
    megabytes = next(iter(limits.values()))
    return ",".join(f"{ordinal}={megabytes}M" for ordinal in range(len(uuids)))


async def set_timeslice(nvidia_smi: Sequence[str], uuids: Sequence[str], interval: str) -> None:
    """As NVIDIA's ``TimeSlicingManager.SetTimeSlice`` (``sharing.go``): compute mode DEFAULT on
    each GPU (``nvlib.go`` ``setComputeMode``), then the time slice on each
    (``nvlib.go`` ``setTimeSlice``), one ``nvidia-smi`` per GPU and step (NVML has no public
    call for the time slice).

    Raises:
        AllocationError: ``nvidia-smi`` could not run or failed.
    """
    for uuid in uuids:
        await _run([*nvidia_smi, "-i", uuid, "-c", "DEFAULT"])
    for uuid in uuids:
        value = str(TIMESLICE_INTERVALS[interval])
        await _run([*nvidia_smi, "compute-policy", "-i", uuid, "--set-timeslice", value])


async def reset_timeslice(nvidia_smi: Sequence[str], uuids: Sequence[str]) -> None:
    """Back to ``Default`` (``device_state.go`` ``unprepareDevices``)."""
    await set_timeslice(nvidia_smi, uuids, "Default")


async def _run(command: list[str]) -> None:
    try:
        done = await anyio.run_process(command, check=False)
    except OSError as exc:
        raise AllocationError(f"cannot run {command[0]}: {exc.strerror or exc}") from None
    if done.returncode != 0:
        said = b""
        with contextlib.suppress(Exception):
            said = (done.stderr or done.stdout or b"").strip()[:200]
        raise AllocationError(
            f"{' '.join(command)} failed with exit code {done.returncode}: "
            f"{said.decode(errors='replace')}"
        )
