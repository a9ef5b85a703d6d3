"""Pushed health: Xid and double-bit ECC events as NVML delivers them (``nvmlEventSetWait_v2``),
turned into health events for the devices they hit, the moment they arrive.

What an Xid does is ``xids.classify``'s (NVIDIA's Xid catalog), unless ``ignored_xids``
lists it. Facts from nvml.h.
"""

from __future__ import annotations

import ctypes
import logging
import math
import threading
from collections.abc import AsyncGenerator, Callable, Mapping
from typing import Any

import anyio
import anyio.to_thread

from devplugin_sdk.backends.nvidia.config import NvidiaConfig
from devplugin_sdk.backends.nvidia.discovery import Inventory, _units
from devplugin_sdk.backends.nvidia.health import GpuHealth
from devplugin_sdk.backends.nvidia.library import _text
from devplugin_sdk.backends.nvidia.xids import classify
from devplugin_sdk.types import Effect, Health, HealthEvent, RescanEvent

__all__ = ["XidEvents"]

log = logging.getLogger(__name__)

# nvml.h, nvmlEventData_t: gpuInstanceId/computeInstanceId are 0xFFFFFFFF when the event is
# not attributable to one MIG instance (the whole GPU is affected).
_NOT_ATTRIBUTED = 0xFFFFFFFF
# Xids after which the GPU is gone (what runs on it cannot go on): NO_EXECUTE, which a DRA driver
# applies only when the operator opts in (``Dra(no_execute=True)``), NoSchedule otherwise.
_GONE = frozenset({79})
# One blocking nvmlEventSetWait_v2 call at most this long, so cancellation is never far off.
_EVENT_WAIT_MS = 1000


def _handle_key(handle: object) -> object:
    # pynvml handles are ctypes pointers that compare by address, not identity; NVML hands out
    # the same address for a GPU every time. Other handles (the fake's) compare by identity.
    try:
        return ("ptr", ctypes.cast(handle, ctypes.c_void_p).value)  # type: ignore[arg-type]
    except (ctypes.ArgumentError, TypeError):
        return ("obj", id(handle))


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


class XidEvents:
    """One resource's NVML event set and its waits, opened again when the GPUs change.

    Args:
        health: Where faults are recorded (the probe reads the same tracker).
        config: Backend settings (``health_disabled``, ``ignored_xids``, ``probe_interval``).
        resource_name: For log lines.
        serves: ``memory`` when the devices are memory units (reported by GPU).
        inventory: The last discovery's devices and GPUs, read at each event.
    """

    def __init__(
        self,
        health: GpuHealth,
        config: NvidiaConfig,
        resource_name: str,
        serves: str,
        inventory: Callable[[], Inventory],
    ) -> None:
        self._tracker = health.tracker
        self.library = health.library
        self.config = config
        self.resource_name = resource_name
        self.serves = serves
        self._inventory = inventory
        self._waiter: _EventWaiter | None = None

    @property
    def nvml(self) -> Any:
        return self.library.nvml

    def close(self) -> None:
        """Free the event set; wait a little for an abandoned wait to return (blocking)."""
        waiter, self._waiter = self._waiter, None
        # A wait abandoned at cancellation may still be inside NVML: let it return (it frees
        # the set) before NVML is shut down under it.
        if waiter is not None:
            waiter.close()
            if not waiter.wait_freed(_EVENT_WAIT_MS / 1000 + 1.0):
                log.warning("%s: an NVML event wait did not return", self.resource_name)

    async def watch(self) -> AsyncGenerator[HealthEvent | RescanEvent, None]:
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
        return self._inventory().gpu_set

    def _open_events(self, gpus: frozenset[str]) -> tuple[_EventWaiter | None, bool]:
        """An event set for ``gpus`` (None if NVML has none), and whether every GPU is in it."""
        nvml = self.library.ensure_init()
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
            info = classify(int(event.eventData))
            reason = f"Xid {info.xid}" + (f" ({info.name})" if info.name else "")
            # ignored_xids overrides the catalog: a listed Xid is ignored whatever its class.
            if info.xid in self.config.ignored_xids or info.cls == "ignore":
                log.debug("ignoring %s: NVIDIA's resolution: %s", reason, info.resolution)
                return []
            effect = Effect.ADVISORY if info.cls == "advisory" else Effect.NO_SCHEDULE
            if info.xid in _GONE:
                effect = Effect.NO_EXECUTE
            resolution = info.resolution
        elif event.eventType == nvml.nvmlEventTypeDoubleBitEccError:
            reason = "double-bit ECC error"
            resolution = None
            effect = Effect.NO_SCHEDULE
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
        if resolution is not None:
            log.info("%s on GPU %s: NVIDIA's resolution: %s", reason, gpu, resolution)
        health = Health.HEALTHY if effect is Effect.ADVISORY else Health.UNHEALTHY
        if health is Health.UNHEALTHY:
            # The engine logs each device's change once, with this reason.
            self._tracker.fault(unit, reason, effect)
        said = None if effect is Effect.NO_SCHEDULE else effect  # Unhealthy's default
        if self.serves == "memory":
            # One event for the GPU marks all its units (their parent).
            return [HealthEvent(unit, health, reason, said)]
        return [
            HealthEvent(d.id, health, reason, said)
            for d in self._inventory().devices
            if unit in _units(d)
        ]

    def _event_unit(self, gpu: str, gi: int, ci: int) -> str | None:
        """The unit an event on ``gpu`` hits: one of our MIG devices, the GPU, or none."""
        inventory = self._inventory()
        if gpu not in inventory.gpu_set:
            return None
        if self.serves == "memory":
            return gpu  # full GPUs only: any fault on it is the whole GPU's
        ours = [d for d in inventory.devices if d.text("gpuUUID") == gpu]
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
