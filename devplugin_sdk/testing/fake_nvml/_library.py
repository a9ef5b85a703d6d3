"""pynvml's function surface over a modelled machine: init and shutdown counted as NVML counts
them, device queries, MIG, topology and NVLink, and event sets that block like
``nvmlEventSetWait_v2``. Names and signatures are pynvml's (a test compares them).
"""

from __future__ import annotations

import collections
import ctypes
import threading
import uuid as uuid_module
from collections.abc import Sequence
from typing import Any

from devplugin_sdk.testing.fake_nvml._constants import (
    NVML_DEVICE_MIG_DISABLE,
    NVML_DEVICE_MIG_ENABLE,
    NVML_FEATURE_DISABLED,
    NVML_FEATURE_ENABLED,
    NVML_GPU_FABRIC_STATE_COMPLETED,
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
    NVML_NVLINK_MAX_LINKS,
    NVML_P2P_CAPS_INDEX_NVLINK,
    NVML_P2P_STATUS_NOT_SUPPORTED,
    NVML_P2P_STATUS_OK,
    NVML_SUCCESS,
    NVML_TEMPERATURE_GPU,
    NVML_TOPOLOGY_HOSTBRIDGE,
    NVML_TOPOLOGY_INTERNAL,
    NVML_TOPOLOGY_MULTIPLE,
    NVML_TOPOLOGY_NODE,
    NVML_TOPOLOGY_SINGLE,
    NVML_TOPOLOGY_SYSTEM,
    c_nvmlGpuFabricInfo_t,
)
from devplugin_sdk.testing.fake_nvml._errors import (
    _ERROR_STRINGS,
    NVMLError,
    NVMLError_GpuIsLost,
    NVMLError_InvalidArgument,
    NVMLError_NotFound,
    NVMLError_NotSupported,
    NVMLError_Timeout,
    NVMLError_Uninitialized,
)
from devplugin_sdk.testing.fake_nvml._model import (
    DeviceAttributes,
    EventData,
    FakeGPU,
    FakeMIG,
    Memory,
    PciInfo,
    _add_uncorrected,
    _EventSet,
    _Failure,
    _Handle,
    _nvlinked,
    _pci_info,
    _profile_name,
)


class _Library:
    """The functions of pynvml a device plugin calls, over ``gpus`` (``FakeNVML`` adds the
    faults). Each counts its call, answers an injected failure, and needs ``nvmlInit``."""

    # pynvml's structure for nvmlDeviceGetGpuFabricInfo, an attribute of the module.
    c_nvmlGpuFabricInfo_t = c_nvmlGpuFabricInfo_t

    def __init__(
        self,
        gpus: Sequence[FakeGPU],
        driver_version: str = "570.124.06",
        cuda_driver_version: int = 12080,
    ) -> None:
        """See ``FakeNVML``."""
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
