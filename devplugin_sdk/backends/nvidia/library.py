"""NVML access: importing pynvml, one plugin's ``nvmlInit``/``nvmlShutdown``, and the small
helpers every NVML read uses (text, PCI addresses, answers that carry no signal).

``pynvml`` (nvidia-ml-py) is imported when a plugin is built, never when the SDK is imported;
tests install the fake of ``devplugin_sdk.testing.fake_nvml`` in its place.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

from devplugin_sdk.errors import BackendError, MissingDependencyError

__all__ = ["NvmlLibrary", "load_nvml", "pci_address"]

log = logging.getLogger(__name__)


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


def _optional(nvml: Any, query: Callable[..., Any] | None, *args: Any) -> Any:
    """``query(*args)``, or None when this NVML or board does not answer it."""
    if query is None:  # an nvidia-ml-py without the function
        return None
    try:
        return query(*args)
    except nvml.NVMLError:
        return None


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


#: How the reason of a GPU that NVML says is lost begins.
LOST = "GPU lost"


def _nvml_fault(nvml: Any, exc: Exception, call: str) -> str:
    """The reason for a unit NVML could not read."""
    if isinstance(exc, nvml.NVMLError_GpuIsLost):
        return f"{LOST}: NVML answered '{exc}' to {call} (fallen off the bus?)"
    return f"NVML error: NVML answered '{exc}' to {call}"


class NvmlLibrary:
    """One plugin's use of NVML: ``nvmlInit`` once when first needed, ``nvmlShutdown`` at the
    end (NVML counts the pairs per process), and one-off reads between a pair of their own."""

    def __init__(self, nvml: Any) -> None:
        self.nvml = nvml
        self._init_lock = threading.Lock()
        self._initialized = False

    def ensure_init(self) -> Any:
        """The NVML module, initialised (blocking).

        Raises:
            BackendError: ``nvmlInit`` failed (with a hint for the usual causes).
        """
        nvml = self.nvml
        with self._init_lock:
            if not self._initialized:
                try:
                    nvml.nvmlInit()
                except nvml.NVMLError as exc:
                    raise _init_error(nvml, exc) from exc
                self._initialized = True
        return nvml

    @contextlib.contextmanager
    def once(self) -> Iterator[Any]:
        """NVML between an ``nvmlInit`` and an ``nvmlShutdown`` of its own (blocking).

        Raises:
            BackendError: ``nvmlInit`` failed.
        """
        nvml = self.nvml
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as exc:
            raise _init_error(nvml, exc) from exc
        try:
            yield nvml
        finally:
            try:
                nvml.nvmlShutdown()
            except nvml.NVMLError as exc:
                log.warning("nvmlShutdown failed: %s", exc)

    def shutdown(self, resource_name: str) -> None:
        """Balance ``ensure_init``'s ``nvmlInit``, if it happened (blocking)."""
        with self._init_lock:
            if not self._initialized:
                return
            self._initialized = False
            try:
                self.nvml.nvmlShutdown()
            except self.nvml.NVMLError as exc:
                log.warning("%s: nvmlShutdown failed: %s", resource_name, exc)
