"""``GpuConfig``, the NVIDIA backend's kind of DRA claim configuration: how a claim shares its GPUs.

A claim (or its DeviceClass) says ``apiVersion: <driver>/v1alpha1, kind: GpuConfig`` with a
``sharing`` section, in the shape of NVIDIA's DRA driver (``api/nvidia.com/resource/v1beta1``
``GpuConfig``), so a file written for it needs only its apiVersion changed:

- ``strategy: TimeSlicing`` with ``timeSlicingConfig.interval`` (``Default``, ``Short``,
  ``Medium``, ``Long``) sets the GPUs' compute time slice at prepare, as NVIDIA's driver does
  (``nvidia-smi compute-policy -i <uuids> --set-timeslice=<0-3>``; NVML has no public call for
  it). The container's edits do not change: the time slice is a property of the GPU.
- ``strategy: MPS`` with ``mpsConfig`` limits gives the container CUDA's MPS client variables:
  ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` (``defaultActiveThreadPercentage``) and
  ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` (``<ordinal>=<MiB>M`` per GPU, in the order of
  ``NVIDIA_VISIBLE_DEVICES``, from ``defaultPinnedDeviceMemoryLimit`` and
  ``defaultPerDevicePinnedMemoryLimit`` by UUID or index). The MPS control daemon is the
  node's (the operator's), not started here: without one, CUDA ignores the variables.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

import anyio

from devplugin_sdk.config import ConfigReader, shown
from devplugin_sdk.dra.config import ConfigKind
from devplugin_sdk.errors import AllocationError, ConfigError
from devplugin_sdk.types import Allocation, Device, Quantity

__all__ = ["GPU_CONFIG", "GpuConfig", "MpsConfig", "apply_gpu_config"]

#: ``nvidia-smi compute-policy --set-timeslice`` values (NVIDIA's DRA driver,
#: ``api/nvidia.com/resource/v1beta1/sharing.go``: Default 0, Short 1, Medium 2, Long 3).
TIMESLICE_INTERVALS = {"Default": 0, "Short": 1, "Medium": 2, "Long": 3}
ACTIVE_THREAD_ENV = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
PINNED_MEMORY_ENV = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"
_MIB = 1 << 20


@dataclass(frozen=True, slots=True)
class MpsConfig:
    """MPS limits for a claim's containers.

    Attributes:
        active_thread_percentage: Percent of the SMs a client may use (1-100); None: no limit.
        pinned_memory_limit: Device memory each GPU may pin for a client; None: no limit.
        per_device: Overrides of ``pinned_memory_limit`` by GPU UUID or index.
    """

    active_thread_percentage: int | None = None
    pinned_memory_limit: Quantity | None = None
    per_device: Mapping[str, Quantity] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class GpuConfig:
    """A claim's ``GpuConfig``: its sharing strategy and that strategy's settings.

    Attributes:
        strategy: ``TimeSlicing`` or ``MPS``.
        interval: The time slice (``TimeSlicing``).
        mps: The limits (``MPS``).
    """

    strategy: Literal["TimeSlicing", "MPS"] = "TimeSlicing"
    interval: str = "Default"
    mps: MpsConfig = field(default_factory=MpsConfig)


def _quantity(reader: ConfigReader, name: str) -> Quantity | None:
    value = reader.data.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise ConfigError(reader.key(name), f"must be a quantity like 10Gi, got {shown(value)}")
    try:
        return Quantity.parse(str(value))
    except ValueError as exc:
        raise ConfigError(reader.key(name), str(exc)) from None


def read_gpu_config(reader: ConfigReader) -> GpuConfig:
    """Read a ``GpuConfig`` (its ``apiVersion`` and ``kind`` already read).

    Raises:
        ConfigError: naming the key (``sharing.mpsConfig.defaultActiveThreadPercentage``).
    """
    reader.known("apiVersion", "kind", "sharing")
    sharing = reader.section("sharing")
    sharing.known("strategy", "timeSlicingConfig", "mpsConfig")
    strategy = sharing.choice("strategy", ("TimeSlicing", "MPS"), "TimeSlicing")
    if strategy == "TimeSlicing":
        if sharing.has("mpsConfig"):
            raise ConfigError(sharing.key("mpsConfig"), "is for strategy MPS, not TimeSlicing")
        slicing = sharing.section("timeSlicingConfig")
        slicing.known("interval")
        interval = slicing.choice("interval", tuple(TIMESLICE_INTERVALS), "Default")
        return GpuConfig("TimeSlicing", interval=interval)
    if sharing.has("timeSlicingConfig"):
        raise ConfigError(sharing.key("timeSlicingConfig"), "is for strategy TimeSlicing, not MPS")
    mps = sharing.section("mpsConfig")
    mps.known(
        "defaultActiveThreadPercentage",
        "defaultPinnedDeviceMemoryLimit",
        "defaultPerDevicePinnedMemoryLimit",
    )
    percentage = (
        mps.integer("defaultActiveThreadPercentage", 100, minimum=1, maximum=100)
        if mps.has("defaultActiveThreadPercentage")
        else None
    )
    per_device: dict[str, Quantity] = {}
    limits = mps.section("defaultPerDevicePinnedMemoryLimit")
    for key in list(limits.data):
        if not isinstance(key, str) or not key:
            raise ConfigError(limits.prefix, f"keys must be GPU UUIDs or indexes, got {shown(key)}")
        value = _quantity(limits, key)
        if value is not None:
            per_device[key] = value
    return GpuConfig(
        "MPS",
        mps=MpsConfig(percentage, _quantity(mps, "defaultPinnedDeviceMemoryLimit"), per_device),
    )


#: The kind: ``<driver>/v1alpha1`` ``GpuConfig``.
GPU_CONFIG: ConfigKind[GpuConfig] = ConfigKind("GpuConfig", "v1alpha1", read_gpu_config)


async def apply_gpu_config(
    config: GpuConfig,
    devices: Sequence[Device],
    allocation: Allocation,
    nvidia_smi: Sequence[str],
) -> Allocation:
    """``allocation`` (the request's edits) under ``config``: the time slice set on the GPUs, or
    the MPS variables added.

    Raises:
        AllocationError: time-slicing asked for MIG devices, a per-device limit names no GPU of
            the request, or ``nvidia-smi`` failed.
    """
    gpus = list(dict.fromkeys(_gpu_of(d) for d in devices))
    if config.strategy == "TimeSlicing":
        if any(d.attributes.get("type") == "mig" for d in devices):
            raise AllocationError("sharing.strategy TimeSlicing applies to full GPUs, not MIG")
        await _set_timeslice(nvidia_smi, gpus, TIMESLICE_INTERVALS[config.interval])
        return allocation
    env = dict(allocation.env)
    mps = config.mps
    if mps.active_thread_percentage is not None:
        env[ACTIVE_THREAD_ENV] = str(mps.active_thread_percentage)
    limits = _pinned_limits(mps, devices, gpus)
    if limits:
        env[PINNED_MEMORY_ENV] = limits
    return replace(allocation, env=env)


def _gpu_of(device: Device) -> str:
    """The UUID of the GPU a device is (or is on)."""
    return str(device.attributes.get("gpuUUID") or device.parent or device.id)


def _pinned_limits(mps: MpsConfig, devices: Sequence[Device], gpus: Sequence[str]) -> str:
    """``0=10240M,1=5120M``: each visible GPU's ordinal and its limit in MiB."""
    index_of = {_gpu_of(d): str(d.attributes.get("index", "")) for d in devices}
    known = set(gpus) | set(index_of.values())
    for key in mps.per_device:
        if key not in known:
            raise AllocationError(
                f"sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit.{key}: no GPU of this "
                f"request has that UUID or index ({', '.join(gpus)})"
            )
    parts = []
    for ordinal, uuid in enumerate(gpus):
        limit = mps.per_device.get(uuid) or mps.per_device.get(index_of.get(uuid, ""))
        limit = limit or mps.pinned_memory_limit
        if limit is not None:
            parts.append(f"{ordinal}={max(1, limit.value // _MIB)}M")
    return ",".join(parts)


async def _set_timeslice(nvidia_smi: Sequence[str], gpus: Sequence[str], value: int) -> None:
    command = [*nvidia_smi, "compute-policy", "-i", ",".join(gpus), f"--set-timeslice={value}"]
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
