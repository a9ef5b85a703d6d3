"""NVIDIA GPUs through NVML: discovery, MIG, container setup, health by stated rules, placement.

``NvmlPlugin`` serves one resource (``nvidia.com/gpu``, ``nvidia.com/mig-1g.10gb``, ...);
``from_config`` builds the plugins a node needs from a YAML mapping. NVML comes from nvidia-ml-py
(``pynvml``), imported when a plugin is built, never when the SDK is imported; tests install the
fake of ``devplugin_sdk.testing.fake_nvml`` in its place. Facts were learned from nvml.h and
nvidia-ml-py's ``pynvml.py``; NVIDIA/k8s-device-plugin ``internal/rm/{nvml_devices.go,health.go}``
and ``internal/plugin/server.go`` (device-list strategies, ignored Xids, MIG capability paths);
NVIDIA/go-nvlib ``pkg/nvlib/device/mig_profile.go`` (MIG profile names); NVIDIA/go-gpuallocator
``besteffort_policy.go`` (pair scores); the kernel's ``Documentation/ABI/testing/sysfs-bus-pci``.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import itertools
import logging
import math
import re
import threading
import time
import uuid as uuid_module
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
from typing_extensions import Self

from devplugin_sdk.allocation import (
    PLACEMENTS,
    Placement,
    TopologyScorer,
    list_entry_bytes,
    matrix_score,
    place_together,
    spread_apart,
)
from devplugin_sdk.api import constants
from devplugin_sdk.backends import _sysfs
from devplugin_sdk.config import ConfigReader, shown
from devplugin_sdk.errors import AllocationError, BackendError, ConfigError, MissingDependencyError
from devplugin_sdk.plugin import DevicePlugin
from devplugin_sdk.types import (
    Allocation,
    Device,
    DeviceNode,
    Health,
    HealthEvent,
    HealthReport,
    Mount,
    Quantity,
    RescanEvent,
    Version,
    replicate,
)

__all__ = [
    "DEFAULT_IGNORED_XIDS",
    "GpuFacts",
    "GpuInfo",
    "Interceptor",
    "MemorySharing",
    "MigInfo",
    "NvidiaConfig",
    "NvmlPlugin",
    "VgpuSharing",
    "from_config",
    "load_nvml",
    "mig_profile_name",
    "pci_address",
]

log = logging.getLogger(__name__)

# Application-caused Xids that leave the GPU usable, as NVIDIA's plugin ignores them
# (internal/rm/health.go): 13 graphics engine exception, 31 GPU memory page fault, 43 GPU
# stopped processing, 45 preemptive cleanup, 68 video processor exception, 109 context
# switch timeout.
DEFAULT_IGNORED_XIDS = frozenset({13, 31, 43, 45, 68, 109})

# For log lines only (NVIDIA's Xid catalogue).
_XID_NAMES = {
    13: "graphics engine exception",
    31: "GPU memory page fault",
    43: "GPU stopped processing",
    45: "preemptive cleanup",
    48: "double-bit ECC error",
    68: "video processor exception",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    94: "contained ECC error",
    95: "uncontained ECC error",
    109: "context switch timeout",
}

MIG_STRATEGIES = ("none", "single", "mixed")
DEVICE_LIST_STRATEGIES = ("envvar", "volume-mounts", "cdi")

# NVIDIA's container runtime reads the GPUs to inject from this variable.
VISIBLE_DEVICES_ENV = "NVIDIA_VISIBLE_DEVICES"
# volume-mounts strategy (k8s-device-plugin internal/plugin/server.go): one /dev/null bind
# mount per device under this directory, and the variable points at the directory.
VOLUME_MOUNTS_ROOT = "/var/run/nvidia-container-devices"
# Driver control nodes a CUDA container needs besides /dev/nvidia<minor>, when present.
CONTROL_NODES = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset")

# nvml.h, nvmlEventData_t: gpuInstanceId/computeInstanceId are 0xFFFFFFFF when the event is
# not attributable to one MIG instance (the whole GPU is affected).
_NOT_ATTRIBUTED = 0xFFFFFFFF
# One blocking nvmlEventSetWait_v2 call at most this long, so cancellation is never far off.
_EVENT_WAIT_MS = 1000

# go-gpuallocator best-effort pair scores: 100 per NVLink, and by the NVML_TOPOLOGY_* level of
# the pair's PCIe common ancestor: same board 60, one switch 50, several switches 40, host
# bridge 30, same CPU 20, across CPUs 10.
_NVLINK_SCORE = 100.0
_PCIE_SCORES = {
    "INTERNAL": 60.0,
    "SINGLE": 50.0,
    "MULTIPLE": 40.0,
    "HOSTBRIDGE": 30.0,
    "NODE": 20.0,
    "SYSTEM": 10.0,
}
_STRATEGY_CONFLICT = "envvar and volume-mounts both set NVIDIA_VISIBLE_DEVICES; pick one"
# TopologyScorer's default bonus for two GPUs on one NUMA node, for slices too.
_NUMA_BONUS = 10.0

# Memory units (sharing.memory): MiB per unit.
MEMORY_UNITS = {"GiB": 1024, "MiB": 1}
# gpushare's variables (AliyunContainerService/gpushare-device-plugin pkg/gpu/nvidia/const.go):
# the GPU's index, its memory and the container's share, both in units.
GPUSHARE_INDEX_ENV = "ALIYUN_COM_GPU_MEM_IDX"
GPUSHARE_DEVICE_ENV = "ALIYUN_COM_GPU_MEM_DEV"
GPUSHARE_CONTAINER_ENV = "ALIYUN_COM_GPU_MEM_CONTAINER"
# HAMi-core's (libvgpu.so) limits: CUDA_DEVICE_MEMORY_LIMIT_<i> ("<MiB>m") for the i-th visible
# GPU, CUDA_DEVICE_SM_LIMIT in percent of the SMs (HAMi pkg/device-plugin/.../plugin/server.go).
MEMORY_LIMIT_ENV = "CUDA_DEVICE_MEMORY_LIMIT_{}"
SM_LIMIT_ENV = "CUDA_DEVICE_SM_LIMIT"
# Where HAMi mounts its interceptor in a container; ld.so.preload lists the library there.
INTERCEPTOR_LIBRARY = "/usr/local/vgpu/libvgpu.so"
INTERCEPTOR_PRELOAD = "/etc/ld.so.preload"
INTERCEPTOR_LOCKS = "/tmp/vgpulock"
_ONE_WAY_TO_SHARE = ("timeSlicing", "memory", "vgpu")

_CDI_KIND = re.compile(r"^[a-z0-9]([a-z0-9.-]*[a-z0-9])?/[a-zA-Z0-9]([a-zA-Z0-9_.-]*[a-zA-Z0-9])?$")


# ----------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class Interceptor:
    """A HAMi-core compatible interceptor (``libvgpu.so``) that enforces the memory and SM
    limits inside the container, mounted from the host.

    Args:
        host_path: Host directory holding ``libvgpu.so``, ``ld.so.preload`` (which lists
            ``/usr/local/vgpu/libvgpu.so``) and a ``vgpulock`` directory; mounted at
            ``/usr/local/vgpu/libvgpu.so``, ``/etc/ld.so.preload`` and ``/tmp/vgpulock``.
    """

    host_path: Path = Path("/usr/local/vgpu")

    def __post_init__(self) -> None:
        object.__setattr__(self, "host_path", Path(self.host_path))
        if not self.host_path.is_absolute():
            raise ValueError(f"host_path must be absolute, got {str(self.host_path)!r}")

    def mounts(self) -> tuple[Mount, ...]:
        """The container's mounts."""
        return (
            Mount(str(self.host_path / "libvgpu.so"), INTERCEPTOR_LIBRARY, read_only=True),
            Mount(str(self.host_path / "ld.so.preload"), INTERCEPTOR_PRELOAD, read_only=True),
            Mount(str(self.host_path / "vgpulock"), INTERCEPTOR_LOCKS),
        )


@dataclass(frozen=True)
class MemorySharing:
    """GPUs shared by memory (gpushare's model): one device per unit of each GPU's memory.

    Args:
        resource_name: Resource of the memory units.
        unit: ``GiB`` or ``MiB``.
        placement: Which GPU a container's units go to when several can hold them:
            ``binpack`` (the fewest free units) or ``spread`` (the most).
        count_resource_name: Also advertise each GPU once under this resource (a count, as
            gpushare's ``aliyun.com/gpu-count``); a container asking for it gets no GPU.
        multi_gpu: Let one container's units span GPUs (one memory limit per GPU); otherwise
            Allocate refuses them.
        interceptor: Mount a HAMi-core compatible interceptor that enforces the memory limit.
    """

    resource_name: str = "nvidia.com/gpu-memory"
    unit: str = "GiB"
    placement: str = "binpack"
    count_resource_name: str | None = None
    multi_gpu: bool = False
    interceptor: Interceptor | None = None

    def __post_init__(self) -> None:
        if self.unit not in MEMORY_UNITS:
            raise ValueError(f"unit must be one of {', '.join(MEMORY_UNITS)}, got {self.unit!r}")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {', '.join(PLACEMENTS)}")
        if self.count_resource_name == self.resource_name:
            raise ValueError("count_resource_name must differ from resource_name")

    @property
    def unit_mib(self) -> int:
        """MiB per unit."""
        return MEMORY_UNITS[self.unit]


@dataclass(frozen=True)
class VgpuSharing:
    """GPUs split into slices (HAMi's static split): each GPU is advertised ``slices`` times.

    Args:
        slices: Devices per GPU; a container's slices are on different GPUs.
        memory_limit: Set ``CUDA_DEVICE_MEMORY_LIMIT_<i>`` to the GPU's memory / ``slices``.
        core_limit: Set ``CUDA_DEVICE_SM_LIMIT`` to 100 / ``slices`` percent.
        interceptor: Mount a HAMi-core compatible interceptor that enforces the limits.
    """

    slices: int
    memory_limit: bool = True
    core_limit: bool = True
    interceptor: Interceptor | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.slices <= 100:
            raise ValueError(f"slices must be between 1 and 100, got {self.slices}")


@dataclass(frozen=True)
class NvidiaConfig:
    """Everything the NVML backend can be told. ``from_mapping`` reads the YAML form.

    Args:
        resource_name: Resource of full GPUs (and of MIG devices under ``single``).
        mig_strategy: ``none`` (MIG ignored, full GPUs), ``single`` (every MIG device is a
            ``resource_name`` device) or ``mixed`` (one ``nvidia.com/mig-<profile>`` resource
            per MIG profile, full GPUs stay ``resource_name``).
        device_list_strategy: How the container learns its GPUs: ``envvar``
            (``NVIDIA_VISIBLE_DEVICES=<uuids>``), ``volume-mounts`` (``/dev/null`` mounted at
            ``/var/run/nvidia-container-devices/<uuid>``) and/or ``cdi`` (CDI device names
            ``<cdi_kind>=<uuid>``).
        cdi_kind: CDI vendor/class of the device names, as in the node's CDI spec.
        pass_device_specs: Also return the device nodes (``/dev/nvidia<N>``, control nodes,
            MIG capability nodes), for runtimes that do not add them.
        replicas: Time-slicing: each device is advertised this many times (``<id>::<n>``).
        memory: Share full GPUs by memory units instead of advertising them whole.
        vgpu: Advertise full GPUs as slices with memory and SM limits.
        rename_by_default: With replicas, advertise ``<resource>.shared`` instead.
        fail_requests_greater_than_one: With replicas, refuse containers asking for more
            than one device (a shared GPU cannot give more).
        health_disabled: No Xid events and no probe; devices stay Healthy.
        ignored_xids: Xids that do not make a GPU unhealthy.
        probe_interval: Seconds between NVML probes of every GPU, the plugin's
            ``health_interval`` (finds lost GPUs and rising ECC counts without an event, and
            drives recovery).
        recovery_period: Seconds a faulted GPU must probe clean before it is Healthy again
            (0: at the first clean probe); ``None`` never recovers (NVIDIA's own plugin's
            behaviour).
        sysfs_root: Where sysfs is mounted (NUMA nodes).
        dev_root: Where the host's /dev is visible (control nodes present or not).
        proc_root: Where the host's /proc is visible (MIG capability minors).
    """

    resource_name: str = "nvidia.com/gpu"
    mig_strategy: str = "none"
    device_list_strategy: tuple[str, ...] = ("envvar",)
    cdi_kind: str = "nvidia.com/gpu"
    pass_device_specs: bool = True
    replicas: int = 1
    memory: MemorySharing | None = None
    vgpu: VgpuSharing | None = None
    rename_by_default: bool = False
    fail_requests_greater_than_one: bool = False
    health_disabled: bool = False
    ignored_xids: frozenset[int] = DEFAULT_IGNORED_XIDS
    probe_interval: float = 5.0
    recovery_period: float | None = 60.0
    sysfs_root: Path = Path("/sys")
    dev_root: Path = Path("/dev")
    proc_root: Path = Path("/proc")

    def __post_init__(self) -> None:
        if self.mig_strategy not in MIG_STRATEGIES:
            raise ValueError(f"mig_strategy must be one of {MIG_STRATEGIES}")
        strategies = tuple(self.device_list_strategy)
        object.__setattr__(self, "device_list_strategy", strategies)
        if not strategies or set(strategies) - set(DEVICE_LIST_STRATEGIES):
            raise ValueError(f"device_list_strategy must be made of {DEVICE_LIST_STRATEGIES}")
        if {"envvar", "volume-mounts"} <= set(strategies):
            raise ValueError(_STRATEGY_CONFLICT)
        if not _CDI_KIND.match(self.cdi_kind):
            raise ValueError(f"cdi_kind must look like vendor.com/class, got {self.cdi_kind!r}")
        if self.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.replicas}")
        ways = [w for w in (self.replicas > 1, self.memory, self.vgpu) if w]
        if len(ways) > 1:
            raise ValueError("replicas, memory and vgpu are three ways to share: pick one")
        if ways and self.replicas == 1 and self.mig_strategy == "single":
            raise ValueError(_SHARING_UNDER_SINGLE)
        if self.probe_interval <= 0:
            raise ValueError(f"probe_interval must be > 0, got {self.probe_interval}")
        if self.recovery_period is not None and self.recovery_period < 0:
            raise ValueError(f"recovery_period must be >= 0, got {self.recovery_period}")
        object.__setattr__(self, "ignored_xids", frozenset(self.ignored_xids))
        for name in ("sysfs_root", "dev_root", "proc_root"):
            object.__setattr__(self, name, Path(getattr(self, name)))

    @classmethod
    def from_mapping(
        cls, config: Mapping[str, Any], *, extra_keys: Sequence[str] = ()
    ) -> NvidiaConfig:
        """Read the YAML form (NVIDIA-like camelCase keys)::

            migStrategy: none            # none | single | mixed
            deviceListStrategy: envvar   # or a list: [envvar, cdi]
            cdiKind: nvidia.com/gpu
            passDeviceSpecs: true
            resourceName: nvidia.com/gpu
            sharing:                     # one of timeSlicing, memory, vgpu
              timeSlicing: {replicas: 4, renameByDefault: false, failRequestsGreaterThanOne: false}
              memory:                    # full GPUs as memory units (gpushare)
                resourceName: nvidia.com/gpu-memory
                unit: GiB                # or MiB
                placement: binpack       # or spread
                countResourceName: null  # e.g. aliyun.com/gpu-count
                multiGpu: false
                interceptor: {hostPath: /usr/local/vgpu}   # optional
              vgpu:                      # full GPUs as slices (HAMi)
                slices: 4
                memoryLimit: true
                coreLimit: true
                interceptor: {hostPath: /usr/local/vgpu}   # optional
            health:
              disabled: false
              ignoredXids: [13, 31, 43, 45, 68, 109]   # replaces the default list
              probeInterval: 5
              recoveryPeriod: 60         # null: never recover
            sysfsRoot: /sys
            devRoot: /dev
            procRoot: /proc

        Args:
            config: The mapping.
            extra_keys: Top-level keys the caller reads itself (a subclass's own options):
                accepted here, and named in the unknown-key message.

        Raises:
            ConfigError: naming the dotted key and what is wrong with it.
        """
        r = ConfigReader(config)
        r.known(*_TOP_KEYS, *extra_keys)
        r.choice("version", ("v1",), "v1")
        strategies = r.choices("deviceListStrategy", DEVICE_LIST_STRATEGIES, ("envvar",))
        if {"envvar", "volume-mounts"} <= set(strategies):
            raise ConfigError(r.key("deviceListStrategy"), _STRATEGY_CONFLICT)
        cdi_kind = r.string("cdiKind", cls.cdi_kind)
        if not _CDI_KIND.match(cdi_kind):
            raise ConfigError(
                r.key("cdiKind"), f"must look like vendor.com/class, got {shown(cdi_kind)}"
            )

        sharing = r.section("sharing")
        sharing.known(*_ONE_WAY_TO_SHARE, hint={"mps": "MPS sharing is not supported"})
        ways = [w for w in _ONE_WAY_TO_SHARE if sharing.has(w)]
        if len(ways) > 1:
            raise ConfigError(
                sharing.key(ways[1]),
                f"cannot be combined with sharing.{ways[0]}: one way of sharing GPUs per node",
            )
        mig_strategy = r.choice("migStrategy", MIG_STRATEGIES, cls.mig_strategy)
        if ways and ways[0] != "timeSlicing" and mig_strategy == "single":
            raise ConfigError(sharing.key(ways[0]), _SHARING_UNDER_SINGLE)
        slicing = sharing.section("timeSlicing")
        slicing.known(
            "replicas",
            "renameByDefault",
            "failRequestsGreaterThanOne",
            hint={"resources": "use sharing.timeSlicing.replicas (one count for every resource)"},
        )

        health = r.section("health")
        health.known("disabled", "ignoredXids", "probeInterval", "recoveryPeriod")
        return cls(
            resource_name=r.resource_name("resourceName", cls.resource_name),
            mig_strategy=mig_strategy,
            device_list_strategy=strategies,
            cdi_kind=cdi_kind,
            pass_device_specs=r.boolean("passDeviceSpecs", cls.pass_device_specs),
            replicas=slicing.integer("replicas", cls.replicas, minimum=1),
            memory=_memory_sharing(sharing) if sharing.has("memory") else None,
            vgpu=_vgpu_sharing(sharing) if sharing.has("vgpu") else None,
            rename_by_default=slicing.boolean("renameByDefault", cls.rename_by_default),
            fail_requests_greater_than_one=slicing.boolean(
                "failRequestsGreaterThanOne", cls.fail_requests_greater_than_one
            ),
            health_disabled=health.boolean("disabled", cls.health_disabled),
            ignored_xids=health.integers("ignoredXids", DEFAULT_IGNORED_XIDS, minimum=1),
            probe_interval=health.interval("probeInterval", cls.probe_interval),
            recovery_period=health.number("recoveryPeriod", cls.recovery_period, nullable=True),
            sysfs_root=r.path("sysfsRoot", cls.sysfs_root),
            dev_root=r.path("devRoot", cls.dev_root),
            proc_root=r.path("procRoot", cls.proc_root),
        )


_SHARING_UNDER_SINGLE = (
    "needs migStrategy none or mixed: under single every GPU is already split by MIG"
)


def _memory_sharing(sharing: ConfigReader) -> MemorySharing:
    memory = sharing.section("memory")
    memory.known(
        "resourceName", "unit", "placement", "countResourceName", "multiGpu", "interceptor"
    )
    name = memory.resource_name("resourceName", MemorySharing.resource_name)
    count = memory.resource_name("countResourceName") if memory.has("countResourceName") else None
    if count == name:
        raise ConfigError(
            memory.key("countResourceName"), f"must differ from {memory.key('resourceName')}"
        )
    return MemorySharing(
        resource_name=name,
        unit=memory.choice("unit", tuple(MEMORY_UNITS), MemorySharing.unit),
        placement=memory.choice("placement", PLACEMENTS, MemorySharing.placement),
        count_resource_name=count,
        multi_gpu=memory.boolean("multiGpu", MemorySharing.multi_gpu),
        interceptor=_interceptor(memory),
    )


def _vgpu_sharing(sharing: ConfigReader) -> VgpuSharing:
    vgpu = sharing.section("vgpu")
    vgpu.known("slices", "memoryLimit", "coreLimit", "interceptor")
    if not vgpu.has("slices"):
        raise ConfigError(vgpu.key("slices"), "is required: how many devices each GPU becomes")
    return VgpuSharing(
        # CUDA_DEVICE_SM_LIMIT is a whole percent: at most 100 slices of 1 %.
        slices=vgpu.integer("slices", 1, minimum=1, maximum=100),
        memory_limit=vgpu.boolean("memoryLimit", VgpuSharing.memory_limit),
        core_limit=vgpu.boolean("coreLimit", VgpuSharing.core_limit),
        interceptor=_interceptor(vgpu),
    )


def _interceptor(section: ConfigReader) -> Interceptor | None:
    if not section.has("interceptor"):
        return None
    interceptor = section.section("interceptor")
    interceptor.known("hostPath")
    return Interceptor(interceptor.path("hostPath", Interceptor.host_path))


_TOP_KEYS = (
    "version",
    "resourceName",
    "migStrategy",
    "deviceListStrategy",
    "cdiKind",
    "passDeviceSpecs",
    "sharing",
    "health",
    "sysfsRoot",
    "devRoot",
    "procRoot",
)


# ----------------------------------------------------------------------------- NVML access


def load_nvml() -> Any:
    """Import ``pynvml`` (the ``nvidia-ml-py`` distribution).

    Raises:
        MissingDependencyError: naming the extra to install.
    """
    try:
        return importlib.import_module("pynvml")
    except ImportError as exc:
        raise MissingDependencyError(
            "the NVIDIA backend needs NVML's Python bindings: pip install 'devplugin-sdk[nvidia]'"
            " (nvidia-ml-py)"
        ) from exc


def _init_error(nvml: Any, exc: Exception) -> BackendError:
    code = getattr(exc, "value", None)
    hints = {
        getattr(nvml, "NVML_ERROR_LIBRARY_NOT_FOUND", -1): (
            "libnvidia-ml.so.1 was not found: install the NVIDIA driver on the node and run the"
            " plugin with the NVIDIA container runtime (or mount the driver's libraries)"
        ),
        getattr(nvml, "NVML_ERROR_DRIVER_NOT_LOADED", -1): (
            "the NVIDIA kernel driver is not loaded on this node"
        ),
        getattr(nvml, "NVML_ERROR_NO_PERMISSION", -1): (
            "no permission to open /dev/nvidiactl: run the plugin privileged or with the"
            " device nodes mounted"
        ),
        getattr(nvml, "NVML_ERROR_LIB_RM_VERSION_MISMATCH", -1): (
            "libnvidia-ml and the kernel driver have different versions: reload the driver or"
            " reboot the node"
        ),
    }
    hint = hints.get(code) if code is not None else None
    return BackendError(f"NVML initialisation failed: {exc}" + (f" ({hint})" if hint else ""))


def _text(value: object) -> str:
    # nvidia-ml-py 12+ decodes char arrays to str; older releases return bytes.
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    return str(value)


def pci_address(bus_id: str) -> str:
    """NVML's bus ID (``00000000:3B:00.0``) as sysfs names the device (``0000:3b:00.0``).

    Raises:
        ValueError: the bus ID is malformed.
    """
    domain, sep, rest = bus_id.strip().partition(":")
    if not sep or not rest:
        raise ValueError(f"malformed PCI bus ID {bus_id!r}")
    # NVML pads the domain to 8 hex digits; sysfs uses 4 (more only for domains > 0xffff).
    return f"{int(domain, 16):04x}:{rest.lower()}"


def _handle_key(handle: object) -> object:
    # pynvml handles are ctypes pointers that compare by address, not identity; NVML hands out
    # the same address for a GPU every time. Other handles (the fake's) compare by identity.
    try:
        return ("ptr", ctypes.cast(handle, ctypes.c_void_p).value)  # type: ignore[arg-type]
    except (ctypes.ArgumentError, TypeError):
        return ("obj", id(handle))


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


def _read_mig_minors(proc_root: Path) -> dict[str, int]:
    # /proc/driver/nvidia-caps/mig-minors: "gpu<minor>/gi<gi>/ci<ci>/access <cap minor>" per
    # line; the node is /dev/nvidia-caps/nvidia-cap<cap minor> (nvidia-container-toolkit
    # internal/nvcaps, Slurm gpu_nvml.c).
    text = _sysfs.read_attr(proc_root / "driver" / "nvidia-caps" / "mig-minors")
    out: dict[str, int] = {}
    for line in (text or "").splitlines():
        name, _, minor = line.strip().partition(" ")
        if minor.strip().isdigit():
            out[name] = int(minor)
    return out


class _Scanner:
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
            migs = tuple(self.migs(handle, uuid, minor, memory, mig_minors))
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

    def migs(
        self, handle: Any, parent_uuid: str, minor: int, memory: int, mig_minors: Mapping[str, int]
    ) -> list[MigInfo]:
        nvml = self.nvml
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


# ----------------------------------------------------------------------------- health


@dataclass
class _Fault:
    since: float  # when the unit went out
    last: float  # the last bad signal: the clean period starts here
    reason: str  # what took it out


class _HealthTracker:
    """The backend's own fault signals by unit (GPU or MIG UUID), and recovery after a clean
    period. Not the engine's device health: it decides what to report, the engine keeps it.
    Event-loop only."""

    def __init__(self, recovery_period: float | None, clock: Callable[[], float]) -> None:
        self.recovery_period = recovery_period
        self.clock = clock
        self.faults: dict[str, _Fault] = {}

    def fault(self, unit: str, reason: str) -> None:
        """Record a bad signal: the unit is out (for its first reason), clean period restarted."""
        now = self.clock()
        fault = self.faults.get(unit)
        if fault is None:
            self.faults[unit] = _Fault(now, now, reason)
        else:
            fault.last = now

    def clean(self, unit: str) -> _Fault | None:
        """Record a clean probe; the fault it ends, if the unit has just recovered."""
        fault = self.faults.get(unit)
        if fault is None or self.recovery_period is None:
            return None
        if self.clock() - fault.last < self.recovery_period:
            return None
        return self.faults.pop(unit)

    def reason(self, units: Sequence[str]) -> str | None:
        """Why a device on ``units`` (its MIG instance, then its GPU) is out; None if it is not."""
        return next((self.faults[u].reason for u in units if u in self.faults), None)

    def health(self, units: Sequence[str]) -> Health:
        """Unhealthy while any of ``units`` (a device's MIG instance and its GPU) is faulted."""
        return Health.UNHEALTHY if self.reason(units) is not None else Health.HEALTHY


class _EventWaiter:
    """An NVML event set whose blocking wait may be abandoned; freed by whoever finishes last."""

    def __init__(self, nvml: Any, event_set: Any, keys: Mapping[object, str]) -> None:
        self.nvml = nvml
        self.event_set = event_set
        self.uuid_by_handle = dict(keys)
        self._lock = threading.Lock()
        self._busy = False
        self._closed = False
        self._freed = threading.Event()

    def wait(self, timeout_ms: int) -> Any:
        """One blocking wait; returns the event or None on timeout (worker thread)."""
        with self._lock:
            if self._closed:
                return None
            self._busy = True
        try:
            return self.nvml.nvmlEventSetWait_v2(self.event_set, timeout_ms)
        except self.nvml.NVMLError_Timeout:
            return None  # pynvml raises Timeout when nothing arrived in time
        finally:
            self._release()

    def _release(self) -> None:
        with self._lock:
            self._busy = False
            if self._closed:
                self._free()

    def close(self) -> None:
        """Free now, or when the abandoned wait returns (never blocks the event loop)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if not self._busy:
                self._free()

    def wait_freed(self, timeout: float) -> bool:
        """Block until the set is freed (after ``close``); False if ``timeout`` passed first."""
        return self._freed.wait(timeout)

    def _free(self) -> None:
        try:
            self.nvml.nvmlEventSetFree(self.event_set)
        except self.nvml.NVMLError as exc:
            log.warning("freeing the NVML event set failed: %s", exc)
        finally:
            self._freed.set()


@dataclass
class _Topology:
    gpus: tuple[str, ...]
    scores: dict[tuple[str, str], float] = field(default_factory=dict)


@dataclass(frozen=True)
class _Asked:
    """A GetPreferredAllocation of shares: its size, the IDs offered, the free shares by GPU."""

    size: int
    available: Sequence[str]  # a set only when a refusal needs it
    free: Mapping[str, int]


def _with_limits(
    allocation: Allocation, env: Mapping[str, str], interceptor: Interceptor | None
) -> Allocation:
    mounts = allocation.mounts + (interceptor.mounts() if interceptor is not None else ())
    return replace(allocation, env=dict(env), mounts=mounts)


# ----------------------------------------------------------------------------- the plugin


class NvmlPlugin(DevicePlugin):
    """NVIDIA GPUs (or MIG devices of one profile) as one extended resource.

    Devices are GPU or MIG UUIDs (``<uuid>::<n>`` with time-slicing); each carries its device
    nodes and NUMA node. Health has one source per signal: Xid and double-bit ECC events are
    pushed from ``watch()`` as NVML delivers them; a probe of every GPU and MIG device (a lost
    GPU sends no event; a failing memory shows in counters) is polled through ``check_health``
    every ``probe_interval``. A faulted GPU (and every replica and MIG device on it) is reported
    Healthy again once it has probed clean for ``recovery_period``: it answers, its
    uncorrected ECC count stopped rising, no row remapping or page retirement is pending, no
    row remapping failed. Every report carries its reason (docs/backends.md, "GPU health").
    Preferred allocation picks the best-connected GPUs (NVLink, PCIe, NUMA) and spreads
    replicas across physical GPUs. ``on_stop`` frees the event set and balances this plugin's
    ``nvmlInit`` with ``nvmlShutdown`` (NVML counts them per process).

    With ``config.memory`` full GPUs are served as memory units (``serves="memory"``,
    ``<first group of the GPU UUID>-<n>``, children of their GPU, health reported per GPU), a
    container's units kept on one GPU by preferred allocation and checked by ``allocate``; and
    optionally counted whole (``serves="count"``). With ``config.vgpu`` they are served as
    slices (``<uuid>::<n>``) spread over distinct GPUs, with HAMi-core's limits. docs/sharing.md
    compares the ways to share.

    Args:
        config: Backend settings.
        nvml: The NVML module, or a stand-in with the same functions such as
            ``devplugin_sdk.testing.fake_nvml.FakeNVML``; default: ``import pynvml`` now.
        mig_profile: Serve the MIG devices of this profile (``mixed`` strategy) instead of
            ``config.resource_name``'s devices.
        serves: What this plugin advertises of the full GPUs: ``gpus`` (whole, time-sliced or
            sliced), ``memory`` (memory units) or ``count`` (each GPU once, giving nothing);
            default ``memory`` when ``config.memory`` is set, else ``gpus``.
        resource_name: Override the resource name derived from the config.
        socket_name: Override the socket file name.
        clock: Monotonic clock for recovery periods (tests pass their own).

    Raises:
        MissingDependencyError: no ``nvml`` given and nvidia-ml-py is not installed.
        ValueError: bad names, ``mig_profile`` without the mixed strategy, or ``serves`` that
            the configuration does not offer.
    """

    def __init__(
        self,
        config: NvidiaConfig | None = None,
        *,
        nvml: Any = None,
        mig_profile: str | None = None,
        serves: str | None = None,
        resource_name: str | None = None,
        socket_name: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config or NvidiaConfig()
        memory = self.config.memory
        if mig_profile is not None and self.config.mig_strategy != "mixed":
            raise ValueError("mig_profile needs mig_strategy 'mixed'")
        self.mig_profile = mig_profile
        if serves is None:
            serves = "memory" if memory is not None and mig_profile is None else "gpus"
        if serves not in ("gpus", "memory", "count") or (serves != "gpus") != (
            memory is not None and mig_profile is None
        ):
            raise ValueError(f"serves={serves!r} does not match the configuration's sharing")
        if serves == "count" and memory is not None and memory.count_resource_name is None:
            raise ValueError("serves='count' needs config.memory.count_resource_name")
        self.serves = serves
        if resource_name is None:
            resource_name = self._default_resource_name()
        super().__init__(resource_name=resource_name, socket_name=socket_name)
        # The engine polls check_health (the probe) on this period.
        self.health_interval = self.config.probe_interval
        # Resolved now: `import pynvml` at plugin construction, never at SDK import.
        self._nvml = nvml if nvml is not None else load_nvml()
        self._init_lock = threading.Lock()
        self._initialized = False
        self._waiter: _EventWaiter | None = None
        self._known: dict[int, GpuInfo] = {}
        self._devices: list[Device] = []
        self._topology: _Topology | None = None
        self._health = _HealthTracker(self.config.recovery_period, clock)
        self._probe_lock = threading.Lock()
        self._ecc_seen: dict[str, int] = {}  # GPU -> volatile uncorrected ECC count, last probe
        self._gpu_set: frozenset[str] = frozenset()  # the GPUs of this plugin's devices
        self._gpu_order: tuple[str, ...] = ()  # the same, in NVML index order
        self._gpu_index: dict[str, str] = {}  # GPU UUID -> NVML index, for messages
        self._gpu_of_key: dict[str, str] = {}  # memory units: ID prefix -> GPU UUID
        self._asked: _Asked | None = None  # the last GetPreferredAllocation of shares

    def _default_resource_name(self) -> str:
        memory = self.config.memory
        if self.serves == "memory" and memory is not None:
            return memory.resource_name
        if self.serves == "count" and memory is not None and memory.count_resource_name:
            return memory.count_resource_name
        if self.mig_profile is not None:
            base = f"nvidia.com/mig-{self.mig_profile}"
        else:
            base = self.config.resource_name
        shared = self.config.replicas > 1 and self.config.rename_by_default
        return f"{base}.shared" if shared else base

    @property
    def _sliced(self) -> VgpuSharing | None:
        """The vgpu sharing when this plugin serves slices of full GPUs."""
        return self.config.vgpu if self.mig_profile is None else None

    # ------------------------------------------------------------------ building

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> list[Self]:
        """The plugins a node needs, from the YAML mapping (see ``NvidiaConfig.from_mapping``).

        Raises:
            ConfigError: invalid configuration (names the dotted key).
            BackendError: NVML unusable while listing MIG profiles (``mixed``).
            MissingDependencyError: nvidia-ml-py is not installed.
        """
        return cls.build(NvidiaConfig.from_mapping(config))

    @classmethod
    def build(cls, config: NvidiaConfig, **kwargs: Any) -> list[Self]:
        """One plugin per resource: ``config.resource_name`` (or with ``config.memory``, its
        memory units and its count resource), and with the mixed strategy one
        ``nvidia.com/mig-<profile>`` per MIG profile present (NVML is read once, here).

        Args:
            config: Backend settings.
            **kwargs: Passed to every plugin's constructor (a subclass's own options, ``nvml``,
                ``clock``).

        Raises:
            ConfigError: ``config.resource_name`` gives a resource or socket name the kubelet
                would refuse (``<name>.shared`` too long, say); memory units whose list would
                pass the kubelet's 4 MiB message limit on this node (on
                ``sharing.memory.unit``, with the size).
            BackendError: NVML unusable while reading the GPUs.
            MissingDependencyError: nvidia-ml-py is not installed.
        """
        try:
            first = cls(config, **kwargs)
        except ConfigError:
            raise
        except ValueError as exc:
            # The names are all derived from resourceName (MIG profile names are NVML's).
            key = "sharing.memory.resourceName" if config.memory else "resourceName"
            raise ConfigError(key, str(exc)) from None
        plugins = [first]
        if config.memory is not None and config.memory.count_resource_name is not None:
            plugins.append(cls(config, serves="count", **kwargs))
        if config.mig_strategy == "mixed" or config.memory is not None:
            gpus = first._scan_once()
            if config.memory is not None:
                first._check_list_size(gpus)
            if config.mig_strategy == "mixed":
                profiles = sorted({m.profile for g in gpus for m in g.migs})
                plugins += [cls(config, mig_profile=p, **kwargs) for p in profiles]
        return plugins

    def _check_list_size(self, gpus: Sequence[GpuInfo]) -> None:
        """Refuse memory units whose ListAndWatch list could pass the kubelet's limit.

        Raises:
            ConfigError: on ``sharing.memory.unit``, naming the size.
        """
        memory = self.config.memory
        assert memory is not None
        served = [g for g in gpus if not (self.config.mig_strategy == "mixed" and g.mig_enabled)]
        keys = _unit_keys([g.uuid for g in served])
        size = count = 0
        for gpu in served:
            units = (gpu.memory_bytes >> 20) // memory.unit_mib
            numa = () if gpu.numa_node is None else (gpu.numa_node,)
            count += units
            # An entry's size depends on the ID's length only: one per number of digits. The
            # largest the list gets is with every unit Unhealthy (a longer health string), and
            # that list must reach the kubelet too.
            for digits in range(1, len(str(max(units - 1, 0))) + 1):
                first, last = (0 if digits == 1 else 10 ** (digits - 1)), 10**digits - 1
                n = min(last, units - 1) - first + 1
                entry = list_entry_bytes(f"{keys[gpu.uuid]}-{first}", numa, Health.UNHEALTHY)
                size += n * entry
        # The kubelet's grpc-go client refuses any ListAndWatch message over 4 MiB.
        if size > constants.MAX_MESSAGE_BYTES:
            raise ConfigError(
                "sharing.memory.unit",
                f"{memory.unit} units make a ListAndWatch list of up to {size:,} bytes here"
                f" ({count:,} devices on {len(served)} GPUs), over the kubelet's limit of"
                f" {constants.MAX_MESSAGE_BYTES:,} bytes (4 MiB); use GiB",
            )

    # ------------------------------------------------------------------ NVML

    @property
    def nvml(self) -> Any:
        """The NVML module in use."""
        return self._nvml

    def _ensure_init(self) -> Any:
        nvml = self._nvml
        with self._init_lock:
            if not self._initialized:
                try:
                    nvml.nvmlInit()
                except nvml.NVMLError as exc:
                    raise _init_error(nvml, exc) from exc
                self._initialized = True
        return nvml

    def scan(self) -> list[GpuInfo]:
        """Read every GPU through NVML (blocking; ``discover`` runs it in a worker thread).

        Raises:
            BackendError: NVML cannot be initialised or cannot list the GPUs.
        """
        gpus = _Scanner(self._ensure_init(), self.config).gpus(self._known)
        self._known = {g.index: g for g in gpus}
        return gpus

    def mig_profiles(self) -> list[str]:
        """The MIG profiles present on the node now (blocking).

        NVML is initialised and shut down again for this one read, so that a plugin that is
        built but never served (a reload that keeps the running one) holds no NVML reference.

        Raises:
            BackendError: NVML cannot be initialised or cannot list the GPUs.
        """
        return sorted({m.profile for g in self._scan_once() for m in g.migs})

    def _scan_once(self) -> list[GpuInfo]:
        """Every GPU now, between an ``nvmlInit`` and an ``nvmlShutdown`` of its own."""
        nvml = self._nvml
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as exc:
            raise _init_error(nvml, exc) from exc
        try:
            gpus = _Scanner(nvml, self.config).gpus({})
        finally:
            try:
                nvml.nvmlShutdown()
            except nvml.NVMLError as exc:
                log.warning("nvmlShutdown failed: %s", exc)
        return gpus

    async def on_stop(self) -> None:
        """Free the event set and balance this plugin's ``nvmlInit`` with ``nvmlShutdown``."""
        await anyio.to_thread.run_sync(self._shutdown)

    def _shutdown(self) -> None:
        waiter, self._waiter = self._waiter, None
        # A wait abandoned at cancellation may still be inside NVML: let it return (it frees
        # the set) before NVML is shut down under it.
        if waiter is not None:
            waiter.close()
            if not waiter.wait_freed(_EVENT_WAIT_MS / 1000 + 1.0):
                log.warning("%s: an NVML event wait did not return", self.resource_name)
        with self._init_lock:
            if not self._initialized:
                return
            self._initialized = False
            try:
                self._nvml.nvmlShutdown()
            except self._nvml.NVMLError as exc:
                log.warning("%s: nvmlShutdown failed: %s", self.resource_name, exc)

    # ------------------------------------------------------------------ discovery

    async def discover(self) -> Sequence[Device]:
        """Every GPU or MIG device this resource serves, with its nodes and NUMA node.

        A GPU that was discovered before and cannot be read now stays listed, Unhealthy.

        Raises:
            BackendError: NVML is unusable, or ``single`` meets a mixed MIG layout.
        """
        gpus = await anyio.to_thread.run_sync(self.scan)
        for gpu in gpus:
            if gpu.fault is not None:
                self._health.fault(gpu.uuid, gpu.fault)
        units = self._select(gpus)
        # Tens of thousands of memory units take a moment to build: not on the event loop.
        devices = await anyio.to_thread.run_sync(self._advertise, units)
        index = {g.uuid: g.index for g in gpus}
        self._gpu_order = tuple(sorted({d.text("gpuUUID") for d in units}, key=lambda u: index[u]))
        self._gpu_set = frozenset(self._gpu_order)
        self._gpu_index = {u: str(index[u]) for u in self._gpu_order}
        self._devices = devices
        self._topology = None
        return devices

    def _advertise(self, units: list[Device]) -> list[Device]:
        """The devices advertised for ``units`` (the GPUs or MIG devices of this resource)."""
        memory = self.config.memory
        if self.serves == "memory" and memory is not None:
            keys = _unit_keys([g.id for g in units])
            self._gpu_of_key = {key: uuid for uuid, key in keys.items()}
            return [
                # Children of their GPU: its faults (reported by GPU UUID) take them all out.
                replace(gpu, id=f"{keys[gpu.id]}-{n}", parent=gpu.id)
                for gpu in units
                for n in range(gpu.number("memoryMiB") // memory.unit_mib)
            ]
        if self.serves == "count":
            return units
        if self._sliced is not None:
            return replicate(units, self._sliced.slices)
        return replicate(units, self.config.replicas)

    def _select(self, gpus: Sequence[GpuInfo]) -> list[Device]:
        control = tuple(
            DeviceNode(f"/dev/{name}")
            for name in CONTROL_NODES
            if (self.config.dev_root / name).exists()
        )
        by_uuid = {g.uuid: g for g in gpus}
        strategy = self.config.mig_strategy
        if self.mig_profile is not None:
            migs = [m for g in gpus for m in g.migs if m.profile == self.mig_profile]
            return [self._mig_device(m, by_uuid[m.parent_uuid], control) for m in migs]
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
            return [self._mig_device(m, g, control) for g in gpus for m in g.migs]
        if strategy == "mixed":
            gpus = [g for g in gpus if not g.mig_enabled]
        return [self._gpu_device(g, control) for g in gpus]

    def _gpu_device(self, gpu: GpuInfo, control: tuple[DeviceNode, ...]) -> Device:
        return Device(
            id=gpu.uuid,
            health=self._health.health((gpu.uuid,)),
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

    def _mig_device(self, mig: MigInfo, gpu: GpuInfo, control: tuple[DeviceNode, ...]) -> Device:
        nodes = (DeviceNode(f"/dev/nvidia{gpu.minor}"), *(DeviceNode(c) for c in mig.cap_nodes))
        return Device(
            id=mig.uuid,
            health=self._health.health((mig.uuid, gpu.uuid)),
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
        )

    # ------------------------------------------------------------------ allocation

    async def allocate(self, devices: Sequence[Device]) -> Allocation:
        """Container setup for ``devices``: the GPU list in the configured form(s), the nodes;
        for memory units and slices, the GPUs they are on and the limits.

        Raises:
            AllocationError: more than one shared device asked with failRequestsGreaterThanOne;
                memory units on several GPUs without ``multiGpu``; two slices on one GPU.
        """
        if self.serves == "count":
            # A count of GPUs, like gpushare's (a node-status patch there): it gives nothing.
            return Allocation()
        if self.serves == "memory":
            return self._allocate_memory(devices)
        if self._sliced is not None:
            return self._allocate_slices(devices, self._sliced)
        cfg = self.config
        if cfg.replicas > 1 and cfg.fail_requests_greater_than_one and len(devices) > 1:
            raise AllocationError(
                f"{self.resource_name}: {len(devices)} devices requested, but the maximum request"
                " size for shared resources is 1 (sharing.timeSlicing.failRequestsGreaterThanOne)"
            )
        # Replicas of one GPU are one GPU to the container.
        uuids = list(dict.fromkeys(d.text("uuid") for d in devices))
        return self._setup(uuids, devices)

    def _setup(self, uuids: Sequence[str], devices: Sequence[Device]) -> Allocation:
        """The GPUs ``uuids`` in the configured form(s), and the nodes of ``devices``."""
        cfg = self.config
        merged = Allocation.merge(devices) if cfg.pass_device_specs else Allocation()
        env = dict(merged.env)
        mounts = list(merged.mounts)
        cdi = list(merged.cdi_devices)
        if "envvar" in cfg.device_list_strategy:
            env[VISIBLE_DEVICES_ENV] = ",".join(uuids)
        if "volume-mounts" in cfg.device_list_strategy:
            env[VISIBLE_DEVICES_ENV] = VOLUME_MOUNTS_ROOT
            mounts += [Mount("/dev/null", f"{VOLUME_MOUNTS_ROOT}/{u}") for u in uuids]
        if "cdi" in cfg.device_list_strategy:
            cdi += [f"{cfg.cdi_kind}={u}" for u in uuids]
        return Allocation(
            device_nodes=merged.device_nodes,
            mounts=tuple(mounts),
            env=env,
            annotations=merged.annotations,
            cdi_devices=tuple(dict.fromkeys(cdi)),
        )

    def _allocate_memory(self, devices: Sequence[Device]) -> Allocation:
        memory = self.config.memory
        assert memory is not None
        by_gpu = self._by_gpu(devices)
        if len(by_gpu) > 1 and not memory.multi_gpu:
            # The kubelet fails the pod's admission on an Allocate error, for good: better than
            # a container whose memory is on GPUs it was not meant to use.
            raise AllocationError(self._units_apart(devices, by_gpu))
        # One unit per GPU carries the GPU's nodes: merging 40,000 identical ones would not.
        allocation = self._setup(list(by_gpu), [units[0] for units in by_gpu.values()])
        env = dict(allocation.env)
        gpu_units = (u[0].number("memoryMiB") // memory.unit_mib for u in by_gpu.values())
        env[GPUSHARE_INDEX_ENV] = ",".join(self._gpu_index[g] for g in by_gpu)
        env[GPUSHARE_DEVICE_ENV] = ",".join(str(n) for n in gpu_units)
        env[GPUSHARE_CONTAINER_ENV] = str(len(devices))
        for i, units in enumerate(by_gpu.values()):
            env[MEMORY_LIMIT_ENV.format(i)] = f"{len(units) * memory.unit_mib}m"
        return _with_limits(allocation, env, memory.interceptor)

    def _allocate_slices(self, devices: Sequence[Device], vgpu: VgpuSharing) -> Allocation:
        by_gpu = self._by_gpu(devices)
        if len(by_gpu) < len(devices):
            raise AllocationError(self._slices_together(devices, by_gpu))
        allocation = self._setup(list(by_gpu), [slices[0] for slices in by_gpu.values()])
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

    async def preferred_allocation(
        self, available: Sequence[Device], must_include: Sequence[Device], size: int
    ) -> Sequence[str]:
        """The best-connected set: NVLinks, then PCIe proximity, then NUMA; replicas spread.

        Memory units: all on one GPU, chosen by ``placement``; when none can hold them, on as
        few GPUs as possible (which ``allocate`` then refuses unless ``multiGpu``). Slices: on
        different GPUs, the GPUs with the most free slices first, then the best connected.
        What is free is what ``available`` lists. A GPU whose topology cannot be read scores
        as unconnected; the others still place.
        """
        ids = [d.id for d in available]
        must = [d.id for d in must_include]
        # The kubelet's `available` is every healthy device not in use (and the must-include
        # ones): what is free, with no memory of earlier allocations needed. It takes the
        # answer's intersection with its candidates and fills up, so an answer on several GPUs
        # is still valid; Allocate then decides.
        if self.serves == "memory" and self.config.memory is not None:
            placed = place_together(
                ids,
                size,
                self._gpu_of_unit,
                must_include=must,
                placement=self.config.memory.placement,
                unit_order=self._gpu_order,
            )
            return self._remember(ids, size, placed)
        topology = await self._topology_for(available)
        if self._sliced is not None:
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
        scorer = TopologyScorer(
            topology.scores,
            numa_nodes={d.id: d.numa_nodes[0] for d in available if d.numa_nodes},
            units={d.id: d.text("gpuUUID") for d in available},
        )
        return scorer.choose(ids, size, must)

    def _gpu_of_unit(self, device_id: str) -> str:
        """The GPU of a memory unit, from its ID (``<key>-<n>``)."""
        key = device_id.rpartition("-")[0]
        return self._gpu_of_key.get(key, key)

    def _remember(self, ids: Sequence[str], size: int, placed: Placement) -> tuple[str, ...]:
        self._asked = _Asked(size, ids, placed.free)
        return placed.device_ids

    async def _topology_for(self, available: Sequence[Device]) -> _Topology:
        gpus = tuple(sorted({d.text("gpuUUID") for d in available}))
        topology = self._topology
        if topology is None or not set(gpus) <= set(topology.gpus):
            every = tuple(sorted(self._gpu_set | set(gpus)))
            topology = await anyio.to_thread.run_sync(self._read_topology, every)
            self._topology = topology
        return topology

    def _read_topology(self, uuids: Sequence[str]) -> _Topology:
        nvml = self._ensure_init()
        handles: dict[str, Any] = {}
        for uuid in uuids:
            try:
                handles[uuid] = nvml.nvmlDeviceGetHandleByUUID(uuid)
            except nvml.NVMLError as exc:
                log.warning("GPU %s left out of placement scoring: %s", uuid, exc)
        by_bus: dict[str, str] = {}
        for uuid, handle in handles.items():
            try:
                by_bus[pci_address(_text(nvml.nvmlDeviceGetPciInfo(handle).busId))] = uuid
            except (nvml.NVMLError, ValueError):
                continue
        direct: dict[tuple[str, str], int] = {}
        to_switch: dict[str, int] = {}
        for uuid, handle in handles.items():
            for remote in self._nvlink_peers(handle):
                if remote in by_bus:
                    pair = (uuid, by_bus[remote])
                    direct[pair] = direct.get(pair, 0) + 1
                elif remote == "switch":
                    to_switch[uuid] = to_switch.get(uuid, 0) + 1
        # Only GPUs that answered count as known: a lost one is read again on a later call.
        topology = _Topology(tuple(sorted(handles)))
        for a, b in itertools.combinations(sorted(handles), 2):
            # A link is seen from both ends; NVSwitch links connect every pair on the fabric.
            links = max(direct.get((a, b), 0), direct.get((b, a), 0))
            links += min(to_switch.get(a, 0), to_switch.get(b, 0))
            topology.scores[(a, b)] = links * _NVLINK_SCORE + self._pcie_score(
                handles[a], handles[b]
            )
        return topology

    def _nvlink_peers(self, handle: Any) -> list[str]:
        """Remote end of each active NVLink: a PCI address, or "switch" for an NVSwitch."""
        nvml = self.nvml
        peers: list[str] = []
        for link in range(nvml.NVML_NVLINK_MAX_LINKS):
            try:
                if nvml.nvmlDeviceGetNvLinkState(handle, link) != nvml.NVML_FEATURE_ENABLED:
                    continue
                remote = pci_address(
                    _text(nvml.nvmlDeviceGetNvLinkRemotePciInfo(handle, link).busId)
                )
            except nvml.NVMLError_NotSupported:
                if link == 0:
                    break  # no NVLink at all (PCIe-only boards)
                continue
            except (nvml.NVMLError, ValueError):
                continue
            try:
                kind = nvml.nvmlDeviceGetNvLinkRemoteDeviceType(handle, link)
            except nvml.NVMLError:
                kind = None
            peers.append("switch" if kind == nvml.NVML_NVLINK_DEVICE_TYPE_SWITCH else remote)
        return peers

    def _pcie_score(self, a: Any, b: Any) -> float:
        nvml = self.nvml
        try:
            level = nvml.nvmlDeviceGetTopologyCommonAncestor(a, b)
        except nvml.NVMLError:
            return 0.0
        for name, score in _PCIE_SCORES.items():
            if level == getattr(nvml, f"NVML_TOPOLOGY_{name}", None):
                return score
        return 0.0

    # ------------------------------------------------------------------ health

    async def check_health(self, devices: Sequence[Device]) -> Mapping[str, Health]:
        """Probe the GPUs and MIG devices behind ``devices`` through NVML (the polled signal).

        A GPU probes clean when it answers, its volatile uncorrected ECC count has not risen
        since the last probe, no row remapping is pending or has failed, and no retired page is
        pending; a MIG device when it answers. Not Supported (and No Permission, Function Not
        Found) is no signal. A unit that fails the probe is faulted (its clean period starts
        again); one that has probed clean for ``recovery_period`` since its last fault, Xid or
        probe, recovers. The rules, as a table: docs/backends.md, "GPU health".

        Returns:
            A ``HealthReport``: health of each of ``devices`` this plugin discovered, by device
            ID, Unhealthy while its GPU or its MIG instance is faulted, with the reason.
        """
        if self.config.health_disabled:
            return {}
        if self.serves == "memory":
            return await self._check_gpus(devices)
        ours = {d.id: d for d in self._devices}
        wanted = [ours[d.id] for d in devices if d.id in ours]
        gpus = sorted({d.text("gpuUUID") for d in wanted})
        migs = sorted({d.text("uuid") for d in wanted} - set(gpus))
        recovered = await self._probe(gpus, migs)
        health: dict[str, Health] = {}
        reasons: dict[str, str] = {}
        for device in wanted:
            units = _units(device)
            why = self._health.reason(units)
            health[device.id] = Health.HEALTHY if why is None else Health.UNHEALTHY
            why = why or next((recovered[u] for u in units if u in recovered), None)
            if why is not None:
                reasons[device.id] = why
        return HealthReport(health, reasons)

    async def _check_gpus(self, devices: Sequence[Device]) -> HealthReport:
        """Memory units: the health of their GPUs, by GPU UUID (the units' parent), so that a
        probe of a node with 100,000 units reports 8 IDs."""
        gpus = sorted({g for d in devices if (g := d.parent) is not None and g in self._gpu_set})
        recovered = await self._probe(gpus, [])
        health: dict[str, Health] = {}
        reasons: dict[str, str] = {}
        for gpu in gpus:
            why = self._health.reason((gpu,))
            health[gpu] = Health.HEALTHY if why is None else Health.UNHEALTHY
            why = why or recovered.get(gpu)
            if why is not None:
                reasons[gpu] = why
        return HealthReport(health, reasons)

    async def _probe(self, gpus: Sequence[str], migs: Sequence[str]) -> dict[str, str]:
        """Probe ``gpus`` and ``migs``, record faults and clean probes; the reasons of the units
        that have just recovered."""
        problems = await anyio.to_thread.run_sync(self._probe_blocking, gpus, migs)
        recovered: dict[str, str] = {}
        for unit in (*gpus, *migs):
            problem = problems.get(unit)
            if problem is not None:
                self._health.fault(unit, problem)
            elif (cleared := self._health.clean(unit)) is not None:
                recovered[unit] = (
                    f"recovered: probed clean for {self._health.recovery_period:g} s "
                    f"(out since {cleared.reason})"
                )
        return recovered

    async def watch(self) -> AsyncIterator[HealthEvent | RescanEvent]:
        """Push Xid and double-bit ECC faults the moment NVML reports them (the pushed signal).

        One event set covers every GPU of this resource; it is opened again when a rescan
        changes the GPUs, and a ``probe_interval`` after a GPU failed to register or a wait
        failed (the polled probe covers lost GPUs meanwhile).
        """
        if self.config.health_disabled:
            return
        retry = self.config.probe_interval
        while True:
            gpus = self._gpus()
            waiter, complete = await anyio.to_thread.run_sync(self._open_events, gpus)
            if waiter is None:
                await anyio.sleep(retry)
                continue
            self._waiter = waiter
            reopen_at = math.inf if complete else anyio.current_time() + retry
            failed = False
            try:
                while self._gpus() == gpus and anyio.current_time() < reopen_at:
                    try:
                        event = await anyio.to_thread.run_sync(
                            waiter.wait, _EVENT_WAIT_MS, abandon_on_cancel=True
                        )
                    except self.nvml.NVMLError as exc:  # not a timeout
                        log.warning(
                            "%s: waiting for NVML events failed: %s; waiting again in %gs",
                            self.resource_name,
                            exc,
                            retry,
                        )
                        failed = True
                        break
                    if event is not None:
                        for health_event in self._on_event(event, waiter):
                            yield health_event
            finally:
                waiter.close()
            if failed:
                await anyio.sleep(retry)

    def _gpus(self) -> frozenset[str]:
        return self._gpu_set

    def _open_events(self, gpus: frozenset[str]) -> tuple[_EventWaiter | None, bool]:
        """An event set for ``gpus`` (None if NVML has none), and whether every GPU is in it."""
        nvml = self._ensure_init()
        try:
            event_set = nvml.nvmlEventSetCreate()
        except nvml.NVMLError as exc:
            log.warning("%s: NVML events unavailable: %s", self.resource_name, exc)
            return None, False
        wanted = nvml.nvmlEventTypeXidCriticalError | nvml.nvmlEventTypeDoubleBitEccError
        keys: dict[object, str] = {}
        complete = True
        for uuid in sorted(gpus):
            try:
                handle = nvml.nvmlDeviceGetHandleByUUID(uuid)
                # Register only what the GPU supports, or NVML refuses the whole mask.
                mask = wanted & nvml.nvmlDeviceGetSupportedEventTypes(handle)
                if mask:
                    nvml.nvmlDeviceRegisterEvents(handle, mask, event_set)
                keys[_handle_key(handle)] = uuid
            except nvml.NVMLError_NotSupported:
                log.warning("GPU %s does not support NVML events; probed only", uuid)
            except nvml.NVMLError as exc:
                # A lost GPU cannot register; the probe reports it, and it registers once back.
                log.warning("GPU %s cannot register for NVML events: %s", uuid, exc)
                complete = False
        return _EventWaiter(nvml, event_set, keys), complete

    def _on_event(self, event: Any, waiter: _EventWaiter) -> list[HealthEvent]:
        """Health events for one NVML event."""
        nvml = self.nvml
        if event.eventType == nvml.nvmlEventTypeXidCriticalError:
            xid = int(event.eventData)
            name = _XID_NAMES.get(xid)
            reason = f"Xid {xid}" + (f" ({name})" if name else "")
            if xid in self.config.ignored_xids:
                log.info("ignoring %s: an application error, the GPU stays healthy", reason)
                return []
        elif event.eventType == nvml.nvmlEventTypeDoubleBitEccError:
            reason = "double-bit ECC error"
        else:
            return []
        gpu = waiter.uuid_by_handle.get(_handle_key(event.device))
        if gpu is None:
            try:
                gpu = _text(nvml.nvmlDeviceGetUUID(event.device))
            except nvml.NVMLError:
                # A GPU that fell off the bus may not even say who it is; the next probe
                # finds it lost.
                log.warning("%s on a GPU NVML cannot identify; left to the probe", reason)
                return []
        unit = self._event_unit(gpu, int(event.gpuInstanceId), int(event.computeInstanceId))
        if unit is None:
            return []
        # The engine logs each device's change once, with this reason.
        self._health.fault(unit, reason)
        if self.serves == "memory":
            # One event for the GPU marks all its units (their parent).
            return [HealthEvent(unit, Health.UNHEALTHY, reason)]
        return [
            HealthEvent(d.id, Health.UNHEALTHY, reason) for d in self._devices if unit in _units(d)
        ]

    def _event_unit(self, gpu: str, gi: int, ci: int) -> str | None:
        """The unit an event on ``gpu`` hits: one of our MIG devices, the GPU, or none."""
        if gpu not in self._gpu_set:
            return None
        if self.serves == "memory":
            return gpu  # full GPUs only: any fault on it is the whole GPU's
        ours = [d for d in self._devices if d.text("gpuUUID") == gpu]
        if not ours:
            return None
        if gi == _NOT_ATTRIBUTED:
            return gpu
        for d in ours:
            if d.attributes.get("gi") == gi and ci in (_NOT_ATTRIBUTED, d.attributes.get("ci")):
                return d.text("uuid")
        if all("gi" in d.attributes for d in ours):
            return None  # a MIG instance of this GPU that another resource serves
        return gpu

    def _probe_blocking(self, gpus: Sequence[str], migs: Sequence[str]) -> dict[str, str | None]:
        """Each unit's problem, None when it probed clean (worker thread; one probe at a time,
        since each compares its ECC counts with the previous probe's)."""
        nvml = self._ensure_init()
        with self._probe_lock:
            out = {uuid: self._probe_unit(nvml, uuid, whole_gpu=True) for uuid in gpus}
            out.update({uuid: self._probe_unit(nvml, uuid, whole_gpu=False) for uuid in migs})
        return out

    def _probe_unit(self, nvml: Any, uuid: str, *, whole_gpu: bool) -> str | None:
        call = "nvmlDeviceGetHandleByUUID"
        try:
            handle = nvml.nvmlDeviceGetHandleByUUID(uuid)
            # Any query that reaches the GPU: a lost GPU answers "GPU is lost".
            call = "nvmlDeviceGetMemoryInfo"
            _signal(nvml, nvml.nvmlDeviceGetMemoryInfo, handle)
            if not whole_gpu:
                return None  # memory health is the whole GPU's, probed with it
            problems: list[str] = []
            call = "nvmlDeviceGetTotalEccErrors"
            count = _signal(
                nvml,
                nvml.nvmlDeviceGetTotalEccErrors,
                handle,
                nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                nvml.NVML_VOLATILE_ECC,  # since the driver loaded: a reset starts it at 0
            )
            if count is not None:
                before = self._ecc_seen.get(uuid)
                self._ecc_seen[uuid] = int(count)
                if before is not None and count > before:
                    problems.append(
                        f"uncorrected ECC errors rising: {before} -> {count} (volatile count)"
                    )
            call = "nvmlDeviceGetRemappedRows"
            rows = _signal(nvml, nvml.nvmlDeviceGetRemappedRows, handle)
            if rows is not None:
                # pynvml: (correctable rows, uncorrectable rows, pending, failure occurred).
                _, uncorrectable, pending, failed = rows
                if failed:
                    problems.append(
                        "row remapping failed: the GPU needs service "
                        f"({uncorrectable} rows remapped for uncorrectable errors)"
                    )
                if pending:
                    problems.append(
                        "row remapping pending: a GPU reset applies it "
                        f"({uncorrectable} rows remapped for uncorrectable errors)"
                    )
            call = "nvmlDeviceGetRetiredPagesPendingStatus"
            retired = _signal(nvml, nvml.nvmlDeviceGetRetiredPagesPendingStatus, handle)
            if retired == nvml.NVML_FEATURE_ENABLED:
                problems.append("retired pages pending: a reboot or GPU reset retires them")
            return "; ".join(problems) or None
        except nvml.NVMLError as exc:
            return _nvml_fault(nvml, exc, call)


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


def _optional(nvml: Any, query: Callable[..., Any] | None, *args: Any) -> Any:
    """``query(*args)``, or None when this NVML or board does not answer it."""
    if query is None:  # an nvidia-ml-py without the function
        return None
    try:
        return query(*args)
    except nvml.NVMLError:
        return None


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


def _signal(nvml: Any, query: Callable[..., Any], *args: Any) -> Any:
    """NVML's answer, or None when the answer says nothing about the GPU's state."""
    try:
        return query(*args)
    except (
        nvml.NVMLError_NotSupported,  # this board or driver has no such counter (T4, L40S...)
        nvml.NVMLError_NoPermission,
        nvml.NVMLError_FunctionNotFound,  # a driver older than the query
    ):
        return None


def _nvml_fault(nvml: Any, exc: Exception, call: str) -> str:
    """The reason for a unit NVML could not read."""
    if isinstance(exc, nvml.NVMLError_GpuIsLost):
        return f"GPU lost: NVML answered '{exc}' to {call} (fallen off the bus?)"
    return f"NVML error: NVML answered '{exc}' to {call}"


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


def _units(device: Device) -> tuple[str, ...]:
    """The units whose faults a device suffers: its MIG instance (if any) and its GPU."""
    return tuple(dict.fromkeys((device.text("uuid"), device.text("gpuUUID"))))


# ----------------------------------------------------------------------------- from_config


def from_config(config: Mapping[str, Any]) -> list[DevicePlugin]:
    """Build the plugins a node needs from the YAML mapping (``devplugin run nvidia``).

    Args:
        config: The YAML mapping (see ``NvidiaConfig.from_mapping``).

    Raises:
        ConfigError: invalid configuration (names the dotted key).
        BackendError: NVML unusable while listing MIG profiles.
        MissingDependencyError: nvidia-ml-py is not installed.
    """
    return list(NvmlPlugin.from_config(config))
