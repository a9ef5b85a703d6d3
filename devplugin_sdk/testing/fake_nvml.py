"""A fake NVML: pynvml's functions, constants and errors over a modelled machine (no GPU needed).

A ``FakeNVML`` instance stands in for the ``pynvml`` module (nvidia-ml-py): the functions a
device plugin needs, with the same names and signatures (the SDK's tests compare them with
``inspect.signature`` of the real module), the same constants, the same ``NVMLError``
subclasses, and NVML's count of ``nvmlInit``/``nvmlShutdown`` pairs. Ready-made machines:
``dgx_a100`` (and ``dgx_a100_40gb``), ``hgx_h100``, ``t4_pcie`` and ``a100_mig``
(deterministic: the same UUIDs in every process); faults: ``xid``, ``ecc_double_bit``,
``lose``/``recover``, the memory faults ``ecc_uncorrected`` (counters that keep rising until
``clear``), ``remap_rows`` and ``retire_pages`` (pending until ``reset``), and ``fail`` (any
function, any NVML error).
``write_host`` writes the matching sysfs, /dev and /proc trees, and ``installed()`` makes
``import pynvml`` give the fake. Behaviour follows nvml.h and nvidia-ml-py's ``pynvml.py``; the
mig-minors layout follows the driver's ``/proc/driver/nvidia-caps/mig-minors`` as read by
nvidia-container-toolkit (``internal/nvcaps``) and Slurm (``gpu_nvml.c``).

Example::

    from devplugin_sdk.backends.nvidia import NvmlPlugin
    from devplugin_sdk.testing import fake_nvml

    nvml = fake_nvml.dgx_a100()
    roots = nvml.write_host(tmp_path)  # the machine's sysfs, /dev and /proc trees
    with nvml.installed():  # `import pynvml` gives the fake: the plugin is built on it
        [plugin] = NvmlPlugin.from_config(roots.config())
    nvml.xid(3, 79)  # GPU 3 fell off the bus: delivered through nvmlEventSetWait
    nvml.lose(3)  # ... and every call on it now raises NVMLError_GpuIsLost

Whole programs run on a fake machine too: ``python -m devplugin_sdk.testing.fake_nvml --machine
dgx_a100 --host-root DIR -- run plugin:MyGpuPlugin --config FILE`` writes the host trees under
DIR, installs the fake as ``pynvml`` and runs ``devplugin`` with the arguments after ``--``
(the config file points ``sysfsRoot``, ``devRoot`` and ``procRoot`` at ``DIR/sys``, ``DIR/dev``
and ``DIR/proc``). That is how the NVIDIA example's end-to-end tests run it, and how to try a
GPU plugin on a laptop.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import ctypes
import math
import sys
import threading
import uuid as uuid_module
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

__all__ = [
    "MACHINES",
    "FakeGPU",
    "FakeMIG",
    "FakeNVML",
    "HostRoots",
    "NVMLError",
    "a100_mig",
    "dgx_a100",
    "dgx_a100_40gb",
    "hgx_h100",
    "main",
    "t4_pcie",
]

# ----------------------------------------------------------------------------- constants
# Values as in nvidia-ml-py 13.x (pynvml.py), which copies them from nvml.h.

NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_ALREADY_INITIALIZED = 5
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_INSUFFICIENT_SIZE = 7
NVML_ERROR_INSUFFICIENT_POWER = 8
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_IRQ_ISSUE = 11
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_CORRUPTED_INFOROM = 14
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_RESET_REQUIRED = 16
NVML_ERROR_OPERATING_SYSTEM = 17
NVML_ERROR_LIB_RM_VERSION_MISMATCH = 18
NVML_ERROR_IN_USE = 19
NVML_ERROR_MEMORY = 20
NVML_ERROR_NO_DATA = 21
NVML_ERROR_VGPU_ECC_NOT_SUPPORTED = 22
NVML_ERROR_INSUFFICIENT_RESOURCES = 23
NVML_ERROR_FREQ_NOT_SUPPORTED = 24
NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25
NVML_ERROR_DEPRECATED = 26
NVML_ERROR_NOT_READY = 27
NVML_ERROR_GPU_NOT_FOUND = 28
NVML_ERROR_INVALID_STATE = 29
NVML_ERROR_RESET_TYPE_NOT_SUPPORTED = 30
NVML_ERROR_UNKNOWN = 999

NVML_FEATURE_DISABLED = 0
NVML_FEATURE_ENABLED = 1
NVML_TEMPERATURE_GPU = 0
NVML_NVLINK_MAX_LINKS = 36
NVML_NVLINK_DEVICE_TYPE_GPU = 0x00
NVML_NVLINK_DEVICE_TYPE_IBMNPU = 0x01
NVML_NVLINK_DEVICE_TYPE_SWITCH = 0x02
NVML_NVLINK_DEVICE_TYPE_UNKNOWN = 0xFF

NVML_TOPOLOGY_INTERNAL = 0
NVML_TOPOLOGY_SINGLE = 10
NVML_TOPOLOGY_MULTIPLE = 20
NVML_TOPOLOGY_HOSTBRIDGE = 30
NVML_TOPOLOGY_NODE = 40
NVML_TOPOLOGY_CPU = NVML_TOPOLOGY_NODE
NVML_TOPOLOGY_SYSTEM = 50

# nvidia-ml-py really defines READ as the one-element tuple (0,) (a stray comma); passing it
# to nvmlDeviceGetP2PStatus fails in ctypes. Mirrored so that code which uses it fails here too.
NVML_P2P_CAPS_INDEX_READ = (0,)
NVML_P2P_CAPS_INDEX_WRITE = 1
NVML_P2P_CAPS_INDEX_NVLINK = 2
NVML_P2P_CAPS_INDEX_ATOMICS = 3
NVML_P2P_CAPS_INDEX_PCI = 4
NVML_P2P_STATUS_OK = 0
NVML_P2P_STATUS_NOT_SUPPORTED = 5

NVML_VOLATILE_ECC = 0
NVML_AGGREGATE_ECC = 1
NVML_MEMORY_ERROR_TYPE_CORRECTED = 0
NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1

NVML_DEVICE_ARCH_VOLTA = 5
NVML_DEVICE_ARCH_TURING = 6
NVML_DEVICE_ARCH_AMPERE = 7
NVML_DEVICE_ARCH_ADA = 8
NVML_DEVICE_ARCH_HOPPER = 9
NVML_DEVICE_ARCH_BLACKWELL = 10
NVML_DEVICE_ARCH_UNKNOWN = 0xFFFFFFFF

NVML_GPU_FABRIC_UUID_LEN = 16
NVML_GPU_FABRIC_STATE_NOT_SUPPORTED = 0
NVML_GPU_FABRIC_STATE_NOT_STARTED = 1
NVML_GPU_FABRIC_STATE_IN_PROGRESS = 2
NVML_GPU_FABRIC_STATE_COMPLETED = 3


class c_nvmlGpuFabricInfo_t(ctypes.Structure):
    """What ``nvmlDeviceGetGpuFabricInfo`` fills: the NVLink fabric (cluster, clique) of a GPU."""

    _fields_: ClassVar[list[tuple[str, Any]]] = [
        ("clusterUuid", ctypes.c_uint8 * 16),
        ("status", ctypes.c_uint),
        ("cliqueId", ctypes.c_uint32),
        ("state", ctypes.c_uint8),
    ]


NVML_DEVICE_MIG_DISABLE = 0x0
NVML_DEVICE_MIG_ENABLE = 0x1
NVML_GPU_INSTANCE_ID_ANY = 0xFFFFFFFF
NVML_COMPUTE_INSTANCE_ID_ANY = 0xFFFFFFFF

nvmlEventTypeSingleBitEccError = 0x0000000000000001
nvmlEventTypeDoubleBitEccError = 0x0000000000000002
nvmlEventTypePState = 0x0000000000000004
nvmlEventTypeXidCriticalError = 0x0000000000000008
nvmlEventTypeClock = 0x0000000000000010
nvmlEventTypeNone = 0x0000000000000000

# nvml.h, nvmlEventData_t: gpuInstanceId/computeInstanceId are 0xFFFFFFFF when the event is
# not attributable to one MIG instance.
_NOT_ATTRIBUTED = 0xFFFFFFFF


# ----------------------------------------------------------------------------- errors


class NVMLError(Exception):
    """pynvml's error: ``NVMLError(code)`` returns the subclass for ``code``; ``.value`` is it.

    As in pynvml, every ``NVML_ERROR_*`` has a subclass (``NVMLError_GpuIsLost`` ...) that can
    be raised without arguments.
    """

    _code: ClassVar[int] = NVML_ERROR_UNKNOWN
    _by_code: ClassVar[dict[int, type[NVMLError]]] = {}
    _strings: ClassVar[dict[int, str]] = {}
    value: int

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        NVMLError._by_code[cls._code] = cls

    def __new__(cls, value: int | None = None) -> NVMLError:
        klass = cls
        if cls is NVMLError and value is not None:
            klass = NVMLError._by_code.get(value, NVMLError)
        obj = Exception.__new__(klass)
        obj.value = klass._code if value is None or klass is not NVMLError else value
        return obj

    def __init__(self, value: int | None = None) -> None:
        super().__init__(self.value)

    def __str__(self) -> str:
        return _ERROR_STRINGS.get(self.value, f"NVML Error with code {self.value}")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, NVMLError) and self.value == other.value

    def __hash__(self) -> int:
        return hash(self.value)


# Messages as nvidia-ml-py's NVMLError._errcode_to_string has them.
_ERROR_STRINGS = {
    NVML_ERROR_UNINITIALIZED: "Uninitialized",
    NVML_ERROR_INVALID_ARGUMENT: "Invalid Argument",
    NVML_ERROR_NOT_SUPPORTED: "Not Supported",
    NVML_ERROR_NO_PERMISSION: "Insufficient Permissions",
    NVML_ERROR_ALREADY_INITIALIZED: "Already Initialized",
    NVML_ERROR_NOT_FOUND: "Not Found",
    NVML_ERROR_INSUFFICIENT_SIZE: "Insufficient Size",
    NVML_ERROR_INSUFFICIENT_POWER: "Insufficient External Power",
    NVML_ERROR_DRIVER_NOT_LOADED: "Driver Not Loaded",
    NVML_ERROR_TIMEOUT: "Timeout",
    NVML_ERROR_IRQ_ISSUE: "Interrupt Request Issue",
    NVML_ERROR_LIBRARY_NOT_FOUND: "NVML Shared Library Not Found",
    NVML_ERROR_FUNCTION_NOT_FOUND: "Function Not Found",
    NVML_ERROR_CORRUPTED_INFOROM: "Corrupted infoROM",
    NVML_ERROR_GPU_IS_LOST: "GPU is lost",
    NVML_ERROR_RESET_REQUIRED: "GPU requires restart",
    NVML_ERROR_OPERATING_SYSTEM: "The operating system has blocked the request.",
    NVML_ERROR_LIB_RM_VERSION_MISMATCH: "RM has detected an NVML/RM version mismatch.",
    NVML_ERROR_MEMORY: "Insufficient Memory",
    NVML_ERROR_UNKNOWN: "Unknown Error",
}


def _error_class(suffix: str) -> type[NVMLError]:
    # Named as pynvml names them: NVML_ERROR_GPU_IS_LOST -> NVMLError_GpuIsLost.
    code: int = globals()[f"NVML_ERROR_{suffix}"]
    name = "NVMLError_" + "".join(part.capitalize() for part in suffix.split("_"))
    klass = type(name, (NVMLError,), {"_code": code, "__module__": __name__})
    klass.__doc__ = f"pynvml's error class for {_ERROR_STRINGS.get(code, name)!r} (code {code})."
    return klass


# One class per NVML_ERROR_* code.
NVMLError_Uninitialized = _error_class("UNINITIALIZED")
NVMLError_InvalidArgument = _error_class("INVALID_ARGUMENT")
NVMLError_NotSupported = _error_class("NOT_SUPPORTED")
NVMLError_NoPermission = _error_class("NO_PERMISSION")
NVMLError_AlreadyInitialized = _error_class("ALREADY_INITIALIZED")
NVMLError_NotFound = _error_class("NOT_FOUND")
NVMLError_InsufficientSize = _error_class("INSUFFICIENT_SIZE")
NVMLError_InsufficientPower = _error_class("INSUFFICIENT_POWER")
NVMLError_DriverNotLoaded = _error_class("DRIVER_NOT_LOADED")
NVMLError_Timeout = _error_class("TIMEOUT")
NVMLError_IrqIssue = _error_class("IRQ_ISSUE")
NVMLError_LibraryNotFound = _error_class("LIBRARY_NOT_FOUND")
NVMLError_FunctionNotFound = _error_class("FUNCTION_NOT_FOUND")
NVMLError_CorruptedInforom = _error_class("CORRUPTED_INFOROM")
NVMLError_GpuIsLost = _error_class("GPU_IS_LOST")
NVMLError_ResetRequired = _error_class("RESET_REQUIRED")
NVMLError_OperatingSystem = _error_class("OPERATING_SYSTEM")
NVMLError_LibRmVersionMismatch = _error_class("LIB_RM_VERSION_MISMATCH")
NVMLError_InUse = _error_class("IN_USE")
NVMLError_Memory = _error_class("MEMORY")
NVMLError_NoData = _error_class("NO_DATA")
NVMLError_VgpuEccNotSupported = _error_class("VGPU_ECC_NOT_SUPPORTED")
NVMLError_InsufficientResources = _error_class("INSUFFICIENT_RESOURCES")
NVMLError_FreqNotSupported = _error_class("FREQ_NOT_SUPPORTED")
NVMLError_ArgumentVersionMismatch = _error_class("ARGUMENT_VERSION_MISMATCH")
NVMLError_Deprecated = _error_class("DEPRECATED")
NVMLError_NotReady = _error_class("NOT_READY")
NVMLError_GpuNotFound = _error_class("GPU_NOT_FOUND")
NVMLError_InvalidState = _error_class("INVALID_STATE")
NVMLError_ResetTypeNotSupported = _error_class("RESET_TYPE_NOT_SUPPORTED")
NVMLError_Unknown = _error_class("UNKNOWN")


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


# ----------------------------------------------------------------------------- the fake module


class FakeNVML:
    """A stand-in for the ``pynvml`` module over a list of ``FakeGPU``.

    Every module-level constant and ``NVMLError`` class of this module is also an attribute of
    the instance (``nvml.NVML_ERROR_GPU_IS_LOST``, ``nvml.NVMLError_Timeout``), as on pynvml.
    As in NVML, ``nvmlInit`` and ``nvmlShutdown`` are counted: the library is usable while
    more inits than shutdowns were made, calls otherwise raise ``NVMLError_Uninitialized``, and
    so does a shutdown with nothing left to shut down. Thread-safe: ``nvmlEventSetWait_v2``
    blocks in one thread while a test injects faults from another.

    Args:
        gpus: The machine's GPUs, in NVML index order.
        driver_version: What ``nvmlSystemGetDriverVersion`` returns.
        cuda_driver_version: What ``nvmlSystemGetCudaDriverVersion`` returns (12080 is 12.8).

    Attributes:
        calls: How many times each NVML function was called.
    """

    def __init__(
        self,
        gpus: Sequence[FakeGPU],
        driver_version: str = "570.124.06",
        cuda_driver_version: int = 12080,
    ) -> None:
        self.gpus = list(gpus)
        self.driver_version = driver_version
        self.cuda_driver_version = cuda_driver_version
        self.calls: collections.Counter[str] = collections.Counter()
        self._cond = threading.Condition()
        self._init_count = 0
        self._waiting: list[_EventSet] = []  # one per thread blocked in nvmlEventSetWait_v2
        self._failures: dict[str, _Failure] = {}
        self._event_sets: list[_EventSet] = []
        self._handles = {g.index: _Handle(g) for g in self.gpus}
        self._mig_handles = {m.uuid: _Handle(g, m) for g in self.gpus for m in g.migs}

    # pynvml's structure for nvmlDeviceGetGpuFabricInfo, an attribute of the module.
    c_nvmlGpuFabricInfo_t = c_nvmlGpuFabricInfo_t

    def __getattr__(self, name: str) -> Any:
        # pynvml's constants and error classes are attributes of the module; so they are here.
        if name.startswith(("NVML_", "nvmlEventType", "NVMLError")) and name in globals():
            return globals()[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def init_count(self) -> int:
        """``nvmlInit`` calls not yet balanced by ``nvmlShutdown`` (0: NVML is shut down)."""
        with self._cond:
            return self._init_count

    @contextlib.contextmanager
    def installed(self) -> Iterator[FakeNVML]:
        """Make ``import pynvml`` give this fake inside the ``with`` block.

        The NVIDIA backend imports pynvml when a plugin is built, so plugins built inside the
        block keep using the fake after it. The previous module (if any) is put back on exit.
        """
        missing = object()
        previous = sys.modules.get("pynvml", missing)
        sys.modules["pynvml"] = self  # type: ignore[assignment]
        try:
            yield self
        finally:
            if previous is missing:
                sys.modules.pop("pynvml", None)
            else:
                sys.modules["pynvml"] = previous  # type: ignore[assignment]

    # ------------------------------------------------------------------ fault injection

    def gpu(self, ref: int | str) -> FakeGPU:
        """The GPU with NVML index ``ref`` or UUID ``ref``.

        Raises:
            KeyError: no such GPU.
        """
        for gpu in self.gpus:
            if ref in (gpu.index, gpu.uuid):
                return gpu
        raise KeyError(ref)

    def xid(
        self, gpu: int | str, code: int, *, gi: int | None = None, ci: int | None = None
    ) -> None:
        """Deliver Xid ``code`` on ``gpu`` to every event set that registered for Xid events.

        Args:
            gpu: Index or UUID.
            code: The Xid (79 fallen off the bus, 48 double-bit ECC, 13 graphics exception...).
            gi: GPU instance the event is attributed to (MIG); ``None`` for the whole GPU.
            ci: Compute instance, with ``gi``.
        """
        self._deliver(self.gpu(gpu), nvmlEventTypeXidCriticalError, code, gi, ci)

    def ecc_double_bit(self, gpu: int | str) -> None:
        """Deliver a double-bit ECC error event on ``gpu``."""
        self._deliver(self.gpu(gpu), nvmlEventTypeDoubleBitEccError, 0, None, None)

    def lose(self, gpu: int | str) -> None:
        """Make ``gpu`` lost: every call that touches it raises ``NVMLError_GpuIsLost``."""
        with self._cond:
            self.gpu(gpu).lost = True

    def recover(self, gpu: int | str) -> None:
        """Undo ``lose``: the GPU answers again (its other faults stay; ``reset`` ends them)."""
        with self._cond:
            self.gpu(gpu).lost = False

    def ecc_uncorrected(self, gpu: int | str, count: int = 1, *, rising: bool = True) -> None:
        """Uncorrectable memory errors on ``gpu``: ``count`` more in both uncorrected counters
        (volatile and aggregate) now and, with ``rising``, ``count`` more at every later read of
        either, until ``clear`` or ``reset`` (what a failing memory looks like to a poller).

        Raises:
            ValueError: ``count`` below 1.
        """
        if count < 1:
            raise ValueError(f"count must be >= 1, got {count}")
        with self._cond:
            g = self.gpu(gpu)
            _add_uncorrected(g, count)
            g.ecc_rising = count if rising else 0

    def remap_rows(self, gpu: int | str, rows: int = 1, *, failed: bool = False) -> None:
        """Rows remapped for uncorrectable errors on ``gpu``, pending until a ``reset``;
        ``failed`` also sets the failure flag, which nothing clears (the GPU needs service)."""
        with self._cond:
            g = self.gpu(gpu)
            corrected, uncorrected = g.remapped_rows
            g.remapped_rows = (corrected, uncorrected + rows)
            g.remap_pending = True
            g.remap_failed = g.remap_failed or failed

    def retire_pages(self, gpu: int | str) -> None:
        """Pages of ``gpu`` retired for double-bit errors, pending until a ``reset``."""
        with self._cond:
            self.gpu(gpu).pages_pending = True

    def clear(self, gpu: int | str) -> None:
        """The ECC counters of ``gpu`` stop rising; they keep their values."""
        with self._cond:
            self.gpu(gpu).ecc_rising = 0

    def reset(self, gpu: int | str) -> None:
        """As after a GPU reset (``nvidia-smi -r``): the GPU answers again, the ECC counters stop
        rising and the volatile ones start again from 0, pending row remappings and page
        retirements are done. The aggregate counters and a failed remapping stay."""
        with self._cond:
            g = self.gpu(gpu)
            g.lost = False
            g.ecc_rising = 0
            for error_type, counter_type in g.ecc_counts:
                if counter_type == NVML_VOLATILE_ECC:
                    g.ecc_counts[(error_type, counter_type)] = 0
            g.remap_pending = False
            g.pages_pending = False

    def fail(self, function: str, code: int, times: int | None = 1) -> None:
        """Make the next ``times`` calls of ``function`` raise ``NVMLError(code)``.

        Args:
            function: An NVML function name, e.g. ``"nvmlInit"``.
            code: An ``NVML_ERROR_*`` value.
            times: How many calls fail; ``None`` for every call until ``clear_failures``.

        Raises:
            AttributeError: ``function`` is not a function of the fake.
        """
        if not callable(getattr(self, function, None)) or not function.startswith("nvml"):
            raise AttributeError(f"FakeNVML has no NVML function {function!r}")
        with self._cond:
            self._failures[function] = _Failure(code, times)

    def wait_for_waiters(
        self, count: int = 1, timeout: float = 5.0, gpu: int | str | None = None
    ) -> bool:
        """Block until ``count`` threads wait in ``nvmlEventSetWait_v2`` (on event sets that
        registered ``gpu``, if given). Events only reach event sets that exist, so inject
        faults after this. Blocking: call it through ``anyio.to_thread.run_sync`` in async tests.

        Returns:
            False if ``timeout`` seconds passed first.
        """
        index = None if gpu is None else self.gpu(gpu).index

        def ready() -> bool:
            sets = [s for s in self._waiting if index is None or index in s.registered]
            return len(sets) >= count

        with self._cond:
            return self._cond.wait_for(ready, timeout)

    def clear_failures(self) -> None:
        """Forget every failure set by ``fail``."""
        with self._cond:
            self._failures.clear()

    def _deliver(
        self, gpu: FakeGPU, event_type: int, data: int, gi: int | None, ci: int | None
    ) -> None:
        event = EventData(
            device=self._handles[gpu.index],
            eventType=event_type,
            eventData=data,
            gpuInstanceId=_NOT_ATTRIBUTED if gi is None else gi,
            computeInstanceId=_NOT_ATTRIBUTED if ci is None else ci,
        )
        with self._cond:
            for event_set in self._event_sets:
                if event_set.registered.get(gpu.index, 0) & event_type:
                    event_set.pending.append(event)
            self._cond.notify_all()

    # ------------------------------------------------------------------ host trees

    def write_host(self, root: Path) -> HostRoots:
        """Write the sysfs, /dev and /proc entries a plugin reads, under ``root``.

        ``sys/bus/pci/devices/<addr>/numa_node`` per GPU; ``dev/nvidia<minor>``, the control
        nodes and ``dev/nvidia-caps/nvidia-cap<N>`` of existing MIG instances (empty files);
        ``proc/driver/nvidia-caps/mig-minors`` listing every MIG-capable GPU's capabilities.

        Returns:
            The three roots.
        """
        roots = HostRoots(root / "sys", root / "dev", root / "proc")
        complexes = list(dict.fromkeys(gpu.pcie_path[0] for gpu in self.gpus if gpu.pcie_path))
        for gpu in self.gpus:
            # The kernel's layout: the device under its root bus and bridges in devices/, and
            # a bus/pci/devices/<address> link to it (how a PCIe root is found).
            domain = gpu.sysfs_address.split(":")[0]
            rc = complexes.index(gpu.pcie_path[0]) if gpu.pcie_path else 0
            parts = [f"pci{domain}:{0x10 * rc:02x}"]
            parts += [
                f"{domain}:{0x10 * rc:02x}:{i + 1:02x}.0" for i in range(len(gpu.pcie_path) - 1)
            ]
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
        for gpu in self.gpus:
            (roots.dev_root / f"nvidia{gpu.minor}").touch()
        lines = ["config 1", "monitor 2"]
        caps = roots.dev_root / "nvidia-caps"
        for gpu in self.gpus:
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

    # ------------------------------------------------------------------ plumbing

    def _enter(self, function: str) -> None:
        self.calls[function] += 1
        with self._cond:
            failure = self._failures.get(function)
            if failure is not None:
                if failure.remaining is not None:
                    failure.remaining -= 1
                    if failure.remaining <= 0:
                        del self._failures[function]
                raise NVMLError(failure.code)
            if self._init_count == 0 and function not in ("nvmlInit", "nvmlInitWithFlags"):
                raise NVMLError_Uninitialized()

    def _gpu_of(self, handle: object, *, allow_mig: bool = True) -> _Handle:
        if not isinstance(handle, _Handle):
            # ctypes rejects a wrong handle before NVML sees it.
            raise ctypes.ArgumentError(f"expected an nvmlDevice handle, got {handle!r}")
        if handle.gpu.lost:
            raise NVMLError_GpuIsLost()
        if handle.mig is not None and not allow_mig:
            raise NVMLError_InvalidArgument()
        return handle

    def _full_gpu(self, handle: object) -> FakeGPU:
        return self._gpu_of(handle, allow_mig=False).gpu

    def _mig_of(self, handle: object) -> tuple[FakeGPU, FakeMIG]:
        h = self._gpu_of(handle)
        if h.mig is None:
            raise NVMLError_InvalidArgument()  # a MIG-only query on a full GPU
        return h.gpu, h.mig

    # ------------------------------------------------------------------ init and system

    def nvmlInit(self) -> None:
        self._enter("nvmlInit")
        with self._cond:
            self._init_count += 1

    def nvmlInitWithFlags(self, flags: int) -> None:
        self._enter("nvmlInitWithFlags")
        with self._cond:
            self._init_count += 1

    def nvmlShutdown(self) -> None:
        # _enter raises Uninitialized when no init is left to balance, as NVML answers.
        self._enter("nvmlShutdown")
        with self._cond:
            self._init_count -= 1

    def nvmlErrorString(self, result: int) -> str:
        return _ERROR_STRINGS.get(result, f"NVML Error with code {result}")

    def nvmlSystemGetDriverVersion(self) -> str:
        self._enter("nvmlSystemGetDriverVersion")
        return self.driver_version

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        self._enter("nvmlSystemGetCudaDriverVersion")
        return self.cuda_driver_version

    def nvmlDeviceGetArchitecture(self, device: _Handle) -> int:
        self._enter("nvmlDeviceGetArchitecture")
        return self._full_gpu(device).architecture

    def nvmlDeviceGetCudaComputeCapability(self, handle: _Handle) -> tuple[int, int]:
        self._enter("nvmlDeviceGetCudaComputeCapability")
        return self._gpu_of(handle).gpu.compute_capability

    def nvmlDeviceGetGpuFabricInfo(self, device: _Handle, gpuFabricInfo: Any) -> int:
        self._enter("nvmlDeviceGetGpuFabricInfo")
        gpu = self._full_gpu(device)
        if gpu.fabric is None:
            raise NVMLError_NotSupported()
        # Called with the structure itself or ctypes.byref() of it, as pynvml passes it on.
        info = getattr(gpuFabricInfo, "_obj", gpuFabricInfo)
        cluster, clique = gpu.fabric
        info.clusterUuid[:] = list(uuid_module.UUID(cluster).bytes)
        info.status = NVML_SUCCESS
        info.cliqueId = clique
        info.state = NVML_GPU_FABRIC_STATE_COMPLETED
        return NVML_SUCCESS

    # ------------------------------------------------------------------ device queries

    def nvmlDeviceGetCount(self) -> int:
        self._enter("nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> _Handle:
        self._enter("nvmlDeviceGetHandleByIndex")
        handle = self._handles.get(index)
        if handle is None:
            raise NVMLError_InvalidArgument()
        return self._gpu_of(handle)

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> _Handle:
        self._enter("nvmlDeviceGetHandleByUUID")
        handle = self._mig_handles.get(uuid)
        if handle is None:
            handle = next((h for h in self._handles.values() if h.gpu.uuid == uuid), None)
        if handle is None:
            raise NVMLError_NotFound()
        return self._gpu_of(handle)

    def nvmlDeviceGetHandleByPciBusId(self, pciBusId: str) -> _Handle:
        self._enter("nvmlDeviceGetHandleByPciBusId")
        for handle in self._handles.values():
            if handle.gpu.bus_id.lower() == pciBusId.lower():
                return self._gpu_of(handle)
        raise NVMLError_NotFound()

    def nvmlDeviceGetIndex(self, handle: _Handle) -> int:
        self._enter("nvmlDeviceGetIndex")
        return self._full_gpu(handle).index

    def nvmlDeviceGetName(self, handle: _Handle) -> str:
        self._enter("nvmlDeviceGetName")
        h = self._gpu_of(handle)
        if h.mig is not None:
            return f"{h.gpu.name} MIG {_profile_name(h.gpu, h.mig)}"
        return h.gpu.name

    def nvmlDeviceGetUUID(self, handle: _Handle) -> str:
        self._enter("nvmlDeviceGetUUID")
        h = self._gpu_of(handle)
        return h.gpu.uuid if h.mig is None else h.mig.uuid

    def nvmlDeviceGetMinorNumber(self, handle: _Handle) -> int:
        self._enter("nvmlDeviceGetMinorNumber")
        return self._full_gpu(handle).minor

    def nvmlDeviceGetPciInfo(self, handle: _Handle) -> PciInfo:
        self._enter("nvmlDeviceGetPciInfo")
        return _pci_info(self._gpu_of(handle).gpu.bus_id)

    def nvmlDeviceGetMemoryInfo(self, handle: _Handle, version: int | None = None) -> Memory:
        self._enter("nvmlDeviceGetMemoryInfo")
        h = self._gpu_of(handle)
        mib = h.gpu.memory_mib if h.mig is None else h.mig.memory_mib
        used = 0 if h.mig is not None else 512
        return Memory(total=mib << 20, free=(mib - used) << 20, used=used << 20)

    def nvmlDeviceGetTemperature(self, handle: _Handle, sensor: int) -> int:
        self._enter("nvmlDeviceGetTemperature")
        if sensor != NVML_TEMPERATURE_GPU:
            raise NVMLError_InvalidArgument()
        h = self._gpu_of(handle)
        if h.mig is not None:
            raise NVMLError_NotSupported()
        return h.gpu.temperature

    # ------------------------------------------------------------------ memory health

    def nvmlDeviceGetTotalEccErrors(self, handle: _Handle, errorType: int, counterType: int) -> int:
        self._enter("nvmlDeviceGetTotalEccErrors")
        gpu = self._memory_health(handle, "ecc")
        if (errorType, counterType) not in gpu.ecc_counts:
            raise NVMLError_InvalidArgument()
        with self._cond:
            if errorType == NVML_MEMORY_ERROR_TYPE_UNCORRECTED and gpu.ecc_rising:
                _add_uncorrected(gpu, gpu.ecc_rising)
            return gpu.ecc_counts[(errorType, counterType)]

    def nvmlDeviceGetRemappedRows(self, device: _Handle) -> tuple[int, int, int, int]:
        self._enter("nvmlDeviceGetRemappedRows")
        gpu = self._memory_health(device, "row_remapping")
        # nvml.h: not supported on a MIG-enabled GPU with active instances.
        if gpu.mig_enabled and gpu.migs:
            raise NVMLError_NotSupported()
        with self._cond:
            corrected, uncorrected = gpu.remapped_rows
            return (corrected, uncorrected, int(gpu.remap_pending), int(gpu.remap_failed))

    def nvmlDeviceGetRetiredPagesPendingStatus(self, device: _Handle) -> int:
        self._enter("nvmlDeviceGetRetiredPagesPendingStatus")
        gpu = self._memory_health(device, "page_retirement")
        with self._cond:
            return NVML_FEATURE_ENABLED if gpu.pages_pending else NVML_FEATURE_DISABLED

    def _memory_health(self, handle: object, feature: str) -> FakeGPU:
        h = self._gpu_of(handle)
        # Memory health is the whole GPU's: a MIG device handle has none of it to report.
        if h.mig is not None or not getattr(h.gpu, feature):
            raise NVMLError_NotSupported()
        return h.gpu

    # ------------------------------------------------------------------ MIG

    def nvmlDeviceGetMigMode(self, device: _Handle) -> list[int]:
        self._enter("nvmlDeviceGetMigMode")
        gpu = self._full_gpu(device)
        if not gpu.mig_capable:
            raise NVMLError_NotSupported()
        mode = NVML_DEVICE_MIG_ENABLE if gpu.mig_enabled else NVML_DEVICE_MIG_DISABLE
        return [mode, mode]

    def nvmlDeviceGetMaxMigDeviceCount(self, device: _Handle) -> int:
        self._enter("nvmlDeviceGetMaxMigDeviceCount")
        gpu = self._full_gpu(device)
        if not gpu.mig_capable:
            raise NVMLError_NotSupported()
        return 7

    def nvmlDeviceGetMigDeviceHandleByIndex(self, device: _Handle, index: int) -> _Handle:
        self._enter("nvmlDeviceGetMigDeviceHandleByIndex")
        gpu = self._full_gpu(device)
        if not gpu.mig_enabled:
            raise NVMLError_InvalidArgument()
        if not 0 <= index < 7:
            raise NVMLError_InvalidArgument()
        # nvml.h: an index with no MIG device behind it answers NVML_ERROR_NOT_FOUND.
        if index >= len(gpu.migs):
            raise NVMLError_NotFound()
        return self._mig_handles[gpu.migs[index].uuid]

    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, migDevice: _Handle) -> _Handle:
        self._enter("nvmlDeviceGetDeviceHandleFromMigDeviceHandle")
        return self._handles[self._mig_of(migDevice)[0].index]

    def nvmlDeviceGetGpuInstanceId(self, device: _Handle) -> int:
        self._enter("nvmlDeviceGetGpuInstanceId")
        return self._mig_of(device)[1].gi

    def nvmlDeviceGetComputeInstanceId(self, device: _Handle) -> int:
        self._enter("nvmlDeviceGetComputeInstanceId")
        return self._mig_of(device)[1].ci

    def nvmlDeviceGetAttributes(self, device: _Handle) -> DeviceAttributes:
        self._enter("nvmlDeviceGetAttributes")
        h = self._gpu_of(device)
        if h.mig is None:
            # Full GPUs have attributes too; the slice counts then cover the whole GPU.
            return DeviceAttributes(108, 0, 0, 0, 0, 0, 7, 7, h.gpu.memory_mib)
        m = h.mig
        return DeviceAttributes(
            multiprocessorCount=m.multiprocessors,
            sharedCopyEngineCount=m.gi_slices,
            sharedDecoderCount=m.gi_slices // 2,
            sharedEncoderCount=0,
            sharedJpegCount=m.gi_slices // 7,
            sharedOfaCount=m.gi_slices // 7,
            gpuInstanceSliceCount=m.gi_slices,
            computeInstanceSliceCount=m.ci_slices,
            memorySizeMB=m.memory_mib,
        )

    # ------------------------------------------------------------------ topology

    def nvmlDeviceGetTopologyCommonAncestor(self, device1: _Handle, device2: _Handle) -> int:
        self._enter("nvmlDeviceGetTopologyCommonAncestor")
        a, b = self._full_gpu(device1), self._full_gpu(device2)
        if a is b:
            return NVML_TOPOLOGY_INTERNAL
        shared = 0
        for x, y in zip(a.pcie_path, b.pcie_path, strict=False):
            if x != y:
                break
            shared += 1
        if shared >= 2:
            same_leaf = shared == len(a.pcie_path) == len(b.pcie_path)
            return NVML_TOPOLOGY_SINGLE if same_leaf else NVML_TOPOLOGY_MULTIPLE
        if shared == 1:
            return NVML_TOPOLOGY_HOSTBRIDGE
        if a.numa_node is not None and a.numa_node == b.numa_node:
            return NVML_TOPOLOGY_NODE
        return NVML_TOPOLOGY_SYSTEM

    def _link(self, device: _Handle, link: int) -> tuple[str, int]:
        gpu = self._full_gpu(device)
        if not gpu.nvlinks:
            raise NVMLError_NotSupported()
        if not 0 <= link < NVML_NVLINK_MAX_LINKS:
            raise NVMLError_InvalidArgument()
        if link >= len(gpu.nvlinks):
            # Links beyond the GPU's own count: nvml.h answers Not Supported per link.
            raise NVMLError_NotSupported()
        return gpu.nvlinks[link]

    def nvmlDeviceGetNvLinkState(self, device: _Handle, link: int) -> int:
        self._enter("nvmlDeviceGetNvLinkState")
        self._link(device, link)
        return NVML_FEATURE_ENABLED

    def nvmlDeviceGetNvLinkRemotePciInfo(self, device: _Handle, link: int) -> PciInfo:
        self._enter("nvmlDeviceGetNvLinkRemotePciInfo")
        return _pci_info(self._link(device, link)[0])

    def nvmlDeviceGetNvLinkRemoteDeviceType(self, handle: _Handle, link: int) -> int:
        self._enter("nvmlDeviceGetNvLinkRemoteDeviceType")
        return self._link(handle, link)[1]

    def nvmlDeviceGetP2PStatus(self, device1: _Handle, device2: _Handle, p2pIndex: int) -> int:
        self._enter("nvmlDeviceGetP2PStatus")
        if not isinstance(p2pIndex, int):
            # What ctypes does with pynvml's NVML_P2P_CAPS_INDEX_READ tuple.
            raise ctypes.ArgumentError("argument 3: TypeError: Don't know how to convert")
        a, b = self._full_gpu(device1), self._full_gpu(device2)
        if p2pIndex == NVML_P2P_CAPS_INDEX_NVLINK:
            return NVML_P2P_STATUS_OK if _nvlinked(a, b) else NVML_P2P_STATUS_NOT_SUPPORTED
        return NVML_P2P_STATUS_OK

    # ------------------------------------------------------------------ events

    def nvmlEventSetCreate(self) -> _EventSet:
        self._enter("nvmlEventSetCreate")
        event_set = _EventSet()
        with self._cond:
            self._event_sets.append(event_set)
        return event_set

    def nvmlDeviceGetSupportedEventTypes(self, handle: _Handle) -> int:
        self._enter("nvmlDeviceGetSupportedEventTypes")
        return self._full_gpu(handle).supported_events

    def nvmlDeviceRegisterEvents(
        self, handle: _Handle, eventTypes: int, eventSet: _EventSet
    ) -> None:
        self._enter("nvmlDeviceRegisterEvents")
        gpu = self._full_gpu(handle)
        # nvml.h: Not Supported when any requested event type is unsupported by the device.
        if eventTypes & ~gpu.supported_events:
            raise NVMLError_NotSupported()
        with self._cond:
            if eventSet.freed:
                raise NVMLError_InvalidArgument()
            eventSet.registered[gpu.index] = eventSet.registered.get(gpu.index, 0) | eventTypes

    def nvmlEventSetWait_v2(self, eventSet: _EventSet, timeoutms: int) -> EventData:
        self._enter("nvmlEventSetWait_v2")
        with self._cond:
            if eventSet.freed:
                raise NVMLError_InvalidArgument()
            self._waiting.append(eventSet)
            self._cond.notify_all()
            try:
                arrived = self._cond.wait_for(lambda: bool(eventSet.pending), timeoutms / 1000)
            finally:
                self._waiting.remove(eventSet)
            # pynvml raises NVMLError_Timeout when nothing arrived within timeoutms.
            if not arrived:
                raise NVMLError_Timeout()
            return eventSet.pending.popleft()

    def nvmlEventSetWait(self, eventSet: _EventSet, timeoutms: int) -> EventData:
        return self.nvmlEventSetWait_v2(eventSet, timeoutms)

    def nvmlEventSetFree(self, eventSet: _EventSet) -> None:
        self._enter("nvmlEventSetFree")
        with self._cond:
            eventSet.freed = True
            if eventSet in self._event_sets:
                self._event_sets.remove(eventSet)


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


# ----------------------------------------------------------------------------- machines


def dgx_a100() -> FakeNVML:
    """8x A100-SXM4-80GB on NVSwitch (12 NVLinks each, to 6 switches), as in a DGX A100.

    ECC on; Ampere remaps rows and retires no pages (that query answers Not Supported).

    GPU pairs (0,1) (2,3) (4,5) (6,7) share a PCIe switch tree; NUMA nodes 3, 1, 7, 5.
    """
    return _dgx_a100("dgx-a100", "NVIDIA A100-SXM4-80GB", 81920)


def dgx_a100_40gb() -> FakeNVML:
    """8x A100-SXM4-40GB (40960 MiB each), as in a DGX A100 320GB; otherwise as ``dgx_a100``
    (other UUIDs)."""
    return _dgx_a100("dgx-a100-40gb", "NVIDIA A100-SXM4-40GB", 40960)


def _dgx_a100(tag: str, name: str, memory_mib: int) -> FakeNVML:
    bus = ["07", "0F", "47", "4E", "87", "90", "B7", "BD"]
    numa = [3, 3, 1, 1, 7, 7, 5, 5]
    switches = [f"00000000:{0xC0 + i:02X}:00.0" for i in range(6)]
    gpus = [
        FakeGPU(
            index=i,
            uuid=_uuid("GPU", tag, i),
            name=name,
            memory_mib=memory_mib,
            bus_id=f"00000000:{bus[i]}:00.0",
            minor=i,
            numa_node=numa[i],
            pcie_path=(f"rc{i // 2}", f"sw{i // 2}", f"sw{i // 2}.{i % 2}"),
            nvlinks=[(switches[link // 2], NVML_NVLINK_DEVICE_TYPE_SWITCH) for link in range(12)],
            mig_capable=True,
            row_remapping=True,
        )
        for i in range(8)
    ]
    return FakeNVML(gpus)


def hgx_h100() -> FakeNVML:
    """8x H100 80GB HBM3 SXM on NVSwitch (18 NVLinks each, to 4 switches), as in an HGX H100.

    Each GPU sits behind its own PCIe switch; GPUs 0-3 on NUMA node 0, 4-7 on node 1. ECC on,
    rows remapped, no page retirement (as on every GPU since Ampere).
    """
    bus = ["18", "2A", "3A", "5D", "9A", "AB", "BA", "DB"]
    switches = [f"00000000:{0xE0 + i:02X}:00.0" for i in range(4)]
    link_switch = [0] * 4 + [1] * 5 + [2] * 5 + [3] * 4  # 18 links over 4 switches
    gpus = [
        FakeGPU(
            index=i,
            uuid=_uuid("GPU", "hgx-h100", i),
            name="NVIDIA H100 80GB HBM3",
            memory_mib=81559,
            bus_id=f"00000000:{bus[i]}:00.0",
            minor=i,
            numa_node=i // 4,
            pcie_path=(f"rc{i}", f"sw{i}"),
            nvlinks=[(switches[s], NVML_NVLINK_DEVICE_TYPE_SWITCH) for s in link_switch],
            mig_capable=True,
            row_remapping=True,
            architecture=NVML_DEVICE_ARCH_HOPPER,
            compute_capability=(9, 0),
            # The fabric manager puts the NVSwitch domain's GPUs in one clique.
            fabric=(str(uuid_module.uuid5(uuid_module.NAMESPACE_URL, "fake-nvml/hgx-h100")), 1),
        )
        for i in range(8)
    ]
    return FakeNVML(gpus)


def t4_pcie() -> FakeNVML:
    """4x Tesla T4 on PCIe only: no NVLink, no MIG; (0,1) under one switch on NUMA 0, (2,3) on 1.

    ECC on; Turing retires pages and remaps no rows (that query answers Not Supported).
    """
    bus = ["3B", "3C", "AF", "B0"]
    gpus = [
        FakeGPU(
            index=i,
            uuid=_uuid("GPU", "t4", i),
            name="Tesla T4",
            memory_mib=15360,
            bus_id=f"00000000:{bus[i]}:00.0",
            minor=i,
            numa_node=i // 2,
            pcie_path=(f"rc{i // 2}", f"sw{i // 2}"),
            page_retirement=True,
            architecture=NVML_DEVICE_ARCH_TURING,
            compute_capability=(7, 5),
        )
        for i in range(4)
    ]
    return FakeNVML(gpus)


# A100-SXM4-80GB MIG profiles: name -> (GPU instance slices, compute slices, memory MiB),
# as `nvidia-smi mig -lgip` lists them.
A100_80GB_PROFILES: dict[str, tuple[int, int, int]] = {
    "1g.10gb": (1, 1, 9728),
    "1g.20gb": (1, 1, 19968),
    "2g.20gb": (2, 2, 19968),
    "3g.40gb": (3, 3, 40192),
    "4g.40gb": (4, 4, 40192),
    "7g.80gb": (7, 7, 80896),
    "1c.2g.20gb": (2, 1, 19968),
}


def a100_mig(
    layouts: Sequence[Sequence[str] | None] = (("3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"),),
) -> FakeNVML:
    """A100-SXM4-80GB GPUs with MIG: one GPU per layout (profile names), ``None`` = MIG off.

    Args:
        layouts: Per GPU, the MIG profiles created on it (keys of ``A100_80GB_PROFILES``).

    Raises:
        ValueError: an unknown profile name.
    """
    gpus: list[FakeGPU] = []
    for i, layout in enumerate(layouts):
        gpu_uuid = _uuid("GPU", "a100-mig", i)
        migs: list[FakeMIG] = []
        for j, profile in enumerate(layout or ()):
            if profile not in A100_80GB_PROFILES:
                raise ValueError(f"unknown A100 80GB MIG profile {profile!r}")
            gi_slices, ci_slices, memory = A100_80GB_PROFILES[profile]
            migs.append(
                FakeMIG(
                    uuid=_uuid("MIG", "a100-mig", i, j),
                    gi=j + 1,
                    ci=0,
                    gi_slices=gi_slices,
                    ci_slices=ci_slices,
                    memory_mib=memory,
                    multiprocessors=14 * ci_slices,
                )
            )
        gpus.append(
            FakeGPU(
                index=i,
                uuid=gpu_uuid,
                name="NVIDIA A100-SXM4-80GB",
                memory_mib=81920,
                bus_id=f"00000000:{0x07 + 8 * i:02X}:00.0",
                minor=i,
                numa_node=0,
                pcie_path=(f"rc{i}", f"sw{i}"),
                mig_capable=True,
                mig_enabled=layout is not None,
                row_remapping=True,
                migs=migs,
            )
        )
    return FakeNVML(gpus)


#: The machines ``python -m devplugin_sdk.testing.fake_nvml --machine NAME`` can model.
MACHINES: dict[str, Callable[[], FakeNVML]] = {
    "a100_mig": a100_mig,
    "dgx_a100": dgx_a100,
    "dgx_a100_40gb": dgx_a100_40gb,
    "hgx_h100": hgx_h100,
    "t4_pcie": t4_pcie,
}


# ----------------------------------------------------------------------------- the runner


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m devplugin_sdk.testing.fake_nvml",
        description="Run `devplugin` with a fake NVML machine installed as pynvml.",
        epilog="example: --machine dgx_a100 --host-root /tmp/host -- "
        "run plugin:SiteGpuPlugin --config config.yaml",
    )
    parser.add_argument("--machine", choices=sorted(MACHINES), default="dgx_a100")
    parser.add_argument(
        "--mig",
        action="append",
        metavar="PROFILES",
        help="a100_mig only: one GPU per flag, its MIG profiles comma-separated "
        "(3g.40gb,1g.10gb) or 'off'; default one GPU with 3g.40gb,2g.20gb,1g.10gb,1g.10gb",
    )
    parser.add_argument(
        "--host-root",
        type=Path,
        help="write the machine's sys/, dev/ and proc/ trees under this directory",
    )
    parser.add_argument("devplugin_args", nargs=argparse.REMAINDER, help="-- then devplugin's")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Install a fake machine as ``pynvml`` and run ``devplugin`` with the remaining arguments.

    Returns:
        ``devplugin``'s exit status (2 for a bad command line of this runner).
    """
    parser = _parser()
    args = parser.parse_args(argv)
    rest = list(args.devplugin_args)
    if rest[:1] == ["--"]:
        rest = rest[1:]
    if not rest:
        parser.error("give devplugin's arguments after --, e.g. -- run plugin:X --config FILE")
    if args.mig and args.machine != "a100_mig":
        parser.error("--mig needs --machine a100_mig")
    if args.mig:
        layouts = [None if m == "off" else tuple(m.split(",")) for m in args.mig]
        try:
            nvml = a100_mig(layouts)
        except ValueError as exc:
            parser.error(str(exc))
    else:
        nvml = MACHINES[args.machine]()
    if args.host_root is not None:
        nvml.write_host(args.host_root)
    # Imported here: the CLI pulls in the whole engine, which the fake itself never needs.
    from devplugin_sdk import cli  # noqa: PLC0415

    with nvml.installed():
        return cli.main(rest)


if __name__ == "__main__":
    # Run the copy imported under the package's name, so that `isinstance` and the error
    # classes agree with every other importer of this module.
    from devplugin_sdk.testing.fake_nvml import main as _main

    sys.exit(_main())
