"""Placement scores: how well two GPUs are connected (NVLinks, then the PCIe path between them),
read through NVML once and kept until the GPUs change.

Pair scores as NVIDIA/go-gpuallocator ``besteffort_policy.go`` gives them.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.to_thread

from devplugin_sdk.backends.nvidia.library import NvmlLibrary, _text, pci_address
from devplugin_sdk.types import Device

__all__ = ["TopologyCache"]

log = logging.getLogger(__name__)

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
# TopologyScorer's default bonus for two GPUs on one NUMA node, for slices too.
_NUMA_BONUS = 10.0


@dataclass
class _Topology:
    gpus: tuple[str, ...]
    scores: dict[tuple[str, str], float] = field(default_factory=dict)


class TopologyCache:
    """Pair scores of the GPUs, read on first need and again when a GPU is new to them."""

    def __init__(self, library: NvmlLibrary) -> None:
        self.library = library
        self._topology: _Topology | None = None

    @property
    def nvml(self) -> Any:
        return self.library.nvml

    def reset(self) -> None:
        """Forget the scores (the GPUs were discovered again)."""
        self._topology = None

    async def scores_for(self, available: Sequence[Device], gpu_set: frozenset[str]) -> _Topology:
        """The scores of every pair of ``available``'s GPUs and ``gpu_set`` (the resource's)."""
        gpus = tuple(sorted({d.text("gpuUUID") for d in available}))
        topology = self._topology
        if topology is None or not set(gpus) <= set(topology.gpus):
            every = tuple(sorted(gpu_set | set(gpus)))
            topology = await anyio.to_thread.run_sync(self._read_topology, every)
            self._topology = topology
        return topology

    def _read_topology(self, uuids: Sequence[str]) -> _Topology:
        nvml = self.library.ensure_init()
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
