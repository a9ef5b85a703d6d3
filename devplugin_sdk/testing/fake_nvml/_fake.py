"""``FakeNVML``: the stand-in for the ``pynvml`` module, with the faults a test injects (Xid and ECC
events, lost GPUs, memory faults, failing calls) and ``installed()``, which makes
``import pynvml`` give it.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from devplugin_sdk.testing.fake_nvml import _constants, _errors
from devplugin_sdk.testing.fake_nvml._constants import (
    _NOT_ATTRIBUTED,
    NVML_VOLATILE_ECC,
    nvmlEventTypeDoubleBitEccError,
    nvmlEventTypeXidCriticalError,
)
from devplugin_sdk.testing.fake_nvml._library import _Library
from devplugin_sdk.testing.fake_nvml._model import (
    EventData,
    FakeGPU,
    HostRoots,
    _add_uncorrected,
    _Failure,
    write_host,
)

# pynvml's constants and error classes are attributes of the module; so they are of the fake.
_MODULE_NAMES: dict[str, Any] = {
    name: value
    for module in (_constants, _errors)
    for name, value in vars(module).items()
    if name.startswith(("NVML_", "nvmlEventType", "NVMLError"))
}


class FakeNVML(_Library):
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

    def __getattr__(self, name: str) -> Any:
        # pynvml's constants and error classes are attributes of the module; so they are here.
        if name.startswith(("NVML_", "nvmlEventType", "NVMLError")) and name in _MODULE_NAMES:
            return _MODULE_NAMES[name]
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
        return write_host(self.gpus, root)
