"""pynvml's errors: ``NVMLError(code)`` gives the subclass for the code, with pynvml's messages."""

from __future__ import annotations

from typing import Any, ClassVar

from devplugin_sdk.testing.fake_nvml import _constants
from devplugin_sdk.testing.fake_nvml._constants import (
    NVML_ERROR_ALREADY_INITIALIZED,
    NVML_ERROR_CORRUPTED_INFOROM,
    NVML_ERROR_DRIVER_NOT_LOADED,
    NVML_ERROR_FUNCTION_NOT_FOUND,
    NVML_ERROR_GPU_IS_LOST,
    NVML_ERROR_INSUFFICIENT_POWER,
    NVML_ERROR_INSUFFICIENT_SIZE,
    NVML_ERROR_INVALID_ARGUMENT,
    NVML_ERROR_IRQ_ISSUE,
    NVML_ERROR_LIB_RM_VERSION_MISMATCH,
    NVML_ERROR_LIBRARY_NOT_FOUND,
    NVML_ERROR_MEMORY,
    NVML_ERROR_NO_PERMISSION,
    NVML_ERROR_NOT_FOUND,
    NVML_ERROR_NOT_SUPPORTED,
    NVML_ERROR_OPERATING_SYSTEM,
    NVML_ERROR_RESET_REQUIRED,
    NVML_ERROR_TIMEOUT,
    NVML_ERROR_UNINITIALIZED,
    NVML_ERROR_UNKNOWN,
)


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
    code: int = getattr(_constants, f"NVML_ERROR_{suffix}")
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
