"""GPU health by stated rules: faults by unit (GPU or MIG UUID), the NVML probe that finds lost
GPUs and failing memory, and recovery after a clean period (docs/backends.md, "GPU health").

The engine keeps each device's health; ``GpuHealth`` decides what to report: the polled probe
here, the pushed Xid/ECC events in ``events``, both recording faults in one tracker.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.to_thread

from devplugin_sdk.backends.nvidia.discovery import _units
from devplugin_sdk.backends.nvidia.library import LOST, NvmlLibrary, _nvml_fault, _signal
from devplugin_sdk.types import Device, Effect, Health, HealthReport

__all__ = ["GpuHealth"]


@dataclass
class _Fault:
    since: float  # when the unit went out
    last: float  # the last bad signal: the clean period starts here
    reason: str  # what took it out
    effect: Effect  # NO_EXECUTE when the GPU is gone (what runs on it cannot go on)


class _HealthTracker:
    """The backend's own fault signals by unit (GPU or MIG UUID), and recovery after a clean
    period. Not the engine's device health: it decides what to report, the engine keeps it.
    Event-loop only."""

    def __init__(self, recovery_period: float | None, clock: Callable[[], float]) -> None:
        self.recovery_period = recovery_period
        self.clock = clock
        self.faults: dict[str, _Fault] = {}

    def fault(self, unit: str, reason: str, effect: Effect = Effect.NO_SCHEDULE) -> None:
        """Record a bad signal: the unit is out (for its first reason, or the first one that
        calls for ``NO_EXECUTE``), clean period restarted."""
        now = self.clock()
        fault = self.faults.get(unit)
        if fault is None:
            self.faults[unit] = _Fault(now, now, reason, effect)
        else:
            fault.last = now
            if effect is Effect.NO_EXECUTE and fault.effect is not Effect.NO_EXECUTE:
                fault.reason, fault.effect = reason, effect

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

    def effect(self, units: Sequence[str]) -> Effect | None:
        """The effect of the fault that has a device on ``units`` out; None if it is not."""
        return next((self.faults[u].effect for u in units if u in self.faults), None)

    def health(self, units: Sequence[str]) -> Health:
        """Unhealthy while any of ``units`` (a device's MIG instance and its GPU) is faulted."""
        return Health.UNHEALTHY if self.reason(units) is not None else Health.HEALTHY


class GpuHealth:
    """The probe of GPUs and MIG devices and the faults it and the events record.

    Args:
        library: NVML, initialised when first probed.
        recovery_period: Seconds a faulted unit must probe clean (None: never recovers).
        clock: Monotonic clock for recovery periods.
    """

    def __init__(
        self,
        library: NvmlLibrary,
        recovery_period: float | None,
        clock: Callable[[], float],
    ) -> None:
        self.library = library
        self.tracker = _HealthTracker(recovery_period, clock)
        self._probe_lock = threading.Lock()
        self._ecc_seen: dict[str, int] = {}  # GPU -> volatile uncorrected ECC count, last probe

    async def check_devices(self, wanted: Sequence[Device]) -> HealthReport:
        """Probe the GPUs and MIG devices behind ``wanted``; each device's health and reason."""
        gpus = sorted({d.text("gpuUUID") for d in wanted})
        migs = sorted({d.text("uuid") for d in wanted} - set(gpus))
        recovered = await self._probe(gpus, migs)
        health: dict[str, Health] = {}
        reasons: dict[str, str] = {}
        effects: dict[str, Effect] = {}
        for device in wanted:
            units = _units(device)
            why = self.tracker.reason(units)
            health[device.id] = Health.HEALTHY if why is None else Health.UNHEALTHY
            effect = self.tracker.effect(units)
            if effect is Effect.NO_EXECUTE:  # NO_SCHEDULE is Unhealthy's default
                effects[device.id] = effect
            why = why or next((recovered[u] for u in units if u in recovered), None)
            if why is not None:
                reasons[device.id] = why
        return HealthReport(health, reasons, effects)

    async def check_gpus(self, gpus: Sequence[str]) -> HealthReport:
        """Memory units: the health of their GPUs, by GPU UUID (the units' parent), so that a
        probe of a node with 100,000 units reports 8 IDs."""
        recovered = await self._probe(gpus, [])
        health: dict[str, Health] = {}
        reasons: dict[str, str] = {}
        effects: dict[str, Effect] = {}
        for gpu in gpus:
            why = self.tracker.reason((gpu,))
            health[gpu] = Health.HEALTHY if why is None else Health.UNHEALTHY
            effect = self.tracker.effect((gpu,))
            if effect is Effect.NO_EXECUTE:  # NO_SCHEDULE is Unhealthy's default
                effects[gpu] = effect
            why = why or recovered.get(gpu)
            if why is not None:
                reasons[gpu] = why
        return HealthReport(health, reasons, effects)

    async def _probe(self, gpus: Sequence[str], migs: Sequence[str]) -> dict[str, str]:
        """Probe ``gpus`` and ``migs``, record faults and clean probes; the reasons of the units
        that have just recovered."""
        problems = await anyio.to_thread.run_sync(self._probe_blocking, gpus, migs)
        recovered: dict[str, str] = {}
        for unit in (*gpus, *migs):
            problem = problems.get(unit)
            if problem is not None:
                lost = problem.startswith(LOST)
                self.tracker.fault(unit, problem, Effect.NO_EXECUTE if lost else Effect.NO_SCHEDULE)
            elif (cleared := self.tracker.clean(unit)) is not None:
                recovered[unit] = (
                    f"recovered: probed clean for {self.tracker.recovery_period:g} s "
                    f"(out since {cleared.reason})"
                )
        return recovered

    def _probe_blocking(self, gpus: Sequence[str], migs: Sequence[str]) -> dict[str, str | None]:
        """Each unit's problem, None when it probed clean (worker thread; one probe at a time,
        since each compares its ECC counts with the previous probe's)."""
        nvml = self.library.ensure_init()
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
