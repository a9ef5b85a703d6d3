"""What the NVIDIA backend can be told: ``NvidiaConfig`` and its sharing sections.

``NvidiaConfig.from_mapping`` reads the YAML form (NVIDIA-like camelCase keys) and names the
dotted key of any mistake; the dataclasses check the same rules when built in code. Nothing here
touches NVML.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from devplugin_sdk.allocation import PLACEMENTS
from devplugin_sdk.backends.nvidia.compat import translated
from devplugin_sdk.config import ConfigReader, shown
from devplugin_sdk.errors import ConfigError
from devplugin_sdk.types import Mount

__all__ = [
    "DEFAULT_IGNORED_XIDS",
    "DEVICE_LIST_STRATEGIES",
    "MEMORY_UNITS",
    "MIG_STRATEGIES",
    "SCHEMA",
    "Interceptor",
    "MemorySharing",
    "NvidiaConfig",
    "VgpuSharing",
]

# Xids ignored whatever their class in NVIDIA's catalog (``xids``): 109, context switch
# timeout, which NVIDIA's plugin ignores (internal/rm/health.go) though the catalog says reset
# the GPU. The plugin's other ignored Xids (13, 31, 43, 45, 68) are advisory by the catalog:
# the GPU stays healthy, and the event is logged.
DEFAULT_IGNORED_XIDS = frozenset({109})

MIG_STRATEGIES = ("none", "single", "mixed")
DEVICE_LIST_STRATEGIES = ("envvar", "volume-mounts", "cdi")

_STRATEGY_CONFLICT = "envvar and volume-mounts both set NVIDIA_VISIBLE_DEVICES; pick one"

# Memory units (sharing.memory): MiB per unit.
MEMORY_UNITS = {"GiB": 1024, "MiB": 1}
# Where HAMi mounts its interceptor in a container; ld.so.preload lists the library there.
INTERCEPTOR_LIBRARY = "/usr/local/vgpu/libvgpu.so"
INTERCEPTOR_PRELOAD = "/etc/ld.so.preload"
INTERCEPTOR_LOCKS = "/tmp/vgpulock"
_ONE_WAY_TO_SHARE = ("timeSlicing", "memory", "vgpu")

_CDI_KIND = re.compile(r"^[a-z0-9]([a-z0-9.-]*[a-z0-9])?/[a-zA-Z0-9]([a-zA-Z0-9_.-]*[a-zA-Z0-9])?$")


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
        ignored_xids: Xids ignored whatever their class in NVIDIA's catalog (logged at
            debug); an Xid not listed has its catalog class (``xids.classify``).
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
              ignoredXids: [109]         # replaces the default list
              probeInterval: 5
              recoveryPeriod: 60         # null: never recover
            sysfsRoot: /sys
            devRoot: /dev
            procRoot: /proc

        NVIDIA's own file is read too: ``flags.migStrategy``, ``flags.plugin.passDeviceSpecs``
        and ``flags.plugin.deviceListStrategy`` as the keys of those names, and
        ``sharing.timeSlicing.resources`` with one replica count (``compat``).

        Args:
            config: The mapping.
            extra_keys: Top-level keys the caller reads itself (a subclass's own options):
                accepted here, and named in the unknown-key message.

        Raises:
            ConfigError: naming the dotted key and what is wrong with it.
        """
        # NVIDIA's own file (flags:, sharing.timeSlicing.resources) in this backend's terms.
        return _read(cls, ConfigReader(translated(config)), extra_keys)


def _read(cls: type[NvidiaConfig], r: ConfigReader, extra_keys: Sequence[str]) -> NvidiaConfig:
    """``NvidiaConfig.from_mapping``'s reading, key by key, in the order errors are found."""
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

    mig_strategy, sharing, slicing = _sharing_sections(r, cls.mig_strategy)

    health = r.section("health")
    health.known(*_HEALTH["properties"])
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


def _sharing_sections(r: ConfigReader, mig_default: str) -> tuple[str, ConfigReader, ConfigReader]:
    """``migStrategy``, and the ``sharing`` and ``sharing.timeSlicing`` sections, checked
    together: one way of sharing, and none but time-slicing under ``single``."""
    sharing = r.section("sharing")
    sharing.known(*_SHARING["properties"], hint={"mps": "MPS sharing is not supported"})
    ways = [w for w in _ONE_WAY_TO_SHARE if sharing.has(w)]
    if len(ways) > 1:
        raise ConfigError(
            sharing.key(ways[1]),
            f"cannot be combined with sharing.{ways[0]}: one way of sharing GPUs per node",
        )
    mig_strategy = r.choice("migStrategy", MIG_STRATEGIES, mig_default)
    if ways and ways[0] != "timeSlicing" and mig_strategy == "single":
        raise ConfigError(sharing.key(ways[0]), _SHARING_UNDER_SINGLE)
    slicing = sharing.section("timeSlicing")
    slicing.known(
        *_TIME_SLICING["properties"],
        hint={"resources": "use sharing.timeSlicing.replicas (one count for every resource)"},
    )
    return mig_strategy, sharing, slicing


_SHARING_UNDER_SINGLE = (
    "needs migStrategy none or mixed: under single every GPU is already split by MIG"
)


def _memory_sharing(sharing: ConfigReader) -> MemorySharing:
    memory = sharing.section("memory")
    memory.known(*_MEMORY["properties"])
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
    vgpu.known(*_VGPU["properties"])
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
    interceptor.known(*_INTERCEPTOR["properties"])
    return Interceptor(interceptor.path("hostPath", Interceptor.host_path))


# The keys, as JSON Schema: ``from_mapping`` takes each level's keys from here (``known``), and
# schemas/nvidia.json is generated from it (scripts/gen_schemas.py).
_PATH = {"type": "string", "pattern": "^/", "description": "an absolute path"}
_RESOURCE_NAME = {"type": "string", "minLength": 1, "description": "vendor.com/name"}
_INTERCEPTOR: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "properties": {"hostPath": {**_PATH, "default": str(Interceptor.host_path)}},
    "description": "mount a HAMi-core compatible interceptor (libvgpu.so) from the host",
}
_TIME_SLICING: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "replicas": {"type": "integer", "minimum": 1, "default": NvidiaConfig.replicas},
        "renameByDefault": {"type": "boolean", "default": NvidiaConfig.rename_by_default},
        "failRequestsGreaterThanOne": {
            "type": "boolean",
            "default": NvidiaConfig.fail_requests_greater_than_one,
        },
    },
}
_MEMORY: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "resourceName": {**_RESOURCE_NAME, "default": MemorySharing.resource_name},
        "unit": {"enum": list(MEMORY_UNITS), "default": MemorySharing.unit},
        "placement": {"enum": list(PLACEMENTS), "default": MemorySharing.placement},
        "countResourceName": {"anyOf": [_RESOURCE_NAME, {"type": "null"}], "default": None},
        "multiGpu": {"type": "boolean", "default": MemorySharing.multi_gpu},
        "interceptor": _INTERCEPTOR,
    },
}
_VGPU: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": ["slices"],
    "properties": {
        "slices": {"type": "integer", "minimum": 1, "maximum": 100},
        "memoryLimit": {"type": "boolean", "default": VgpuSharing.memory_limit},
        "coreLimit": {"type": "boolean", "default": VgpuSharing.core_limit},
        "interceptor": _INTERCEPTOR,
    },
}
_SHARING: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "maxProperties": 1,
    "properties": {"timeSlicing": _TIME_SLICING, "memory": _MEMORY, "vgpu": _VGPU},
    "description": "one way of sharing GPUs",
}
assert tuple(_SHARING["properties"]) == _ONE_WAY_TO_SHARE
_HEALTH: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "disabled": {"type": "boolean", "default": NvidiaConfig.health_disabled},
        "ignoredXids": {
            "type": "array",
            "items": {"type": "integer", "minimum": 1},
            "default": sorted(DEFAULT_IGNORED_XIDS),
            "description": "replaces the default list",
        },
        "probeInterval": {
            "type": "number",
            "exclusiveMinimum": 0,
            "default": NvidiaConfig.probe_interval,
        },
        "recoveryPeriod": {
            "anyOf": [{"type": "number", "minimum": 0}, {"type": "null"}],
            "default": NvidiaConfig.recovery_period,
            "description": "seconds a faulted GPU must probe clean; null: never recover",
        },
    },
}
_STRATEGY = {"enum": list(DEVICE_LIST_STRATEGIES)}
#: The backend's keys as a JSON Schema object (its part of a ``devplugin run`` file).
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "version": {"enum": ["v1"], "default": "v1"},
        "resourceName": {**_RESOURCE_NAME, "default": NvidiaConfig.resource_name},
        "migStrategy": {"enum": list(MIG_STRATEGIES), "default": NvidiaConfig.mig_strategy},
        "deviceListStrategy": {
            "anyOf": [_STRATEGY, {"type": "array", "minItems": 1, "items": _STRATEGY}],
            "default": NvidiaConfig.device_list_strategy[0],
        },
        "cdiKind": {
            "type": "string",
            "pattern": _CDI_KIND.pattern,
            "default": NvidiaConfig.cdi_kind,
        },
        "passDeviceSpecs": {"type": "boolean", "default": NvidiaConfig.pass_device_specs},
        "sharing": _SHARING,
        "health": _HEALTH,
        "sysfsRoot": {**_PATH, "default": str(NvidiaConfig.sysfs_root)},
        "devRoot": {**_PATH, "default": str(NvidiaConfig.dev_root)},
        "procRoot": {**_PATH, "default": str(NvidiaConfig.proc_root)},
    },
}
_TOP_KEYS = tuple(SCHEMA["properties"])
