"""``NvmlPlugin``: NVIDIA GPUs (or the MIG devices of one profile) as one extended resource.

The hooks read like any plugin's: ``discover`` lists devices, ``allocate`` sets up a container,
``check_health`` probes and ``watch`` pushes Xid events, ``preferred_allocation`` places. Each
hands the NVIDIA work to the module that owns it (discovery, container, sharing, health, events,
topology); blocking NVML calls run in worker threads (``anyio.to_thread.run_sync``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import anyio
import anyio.to_thread
from typing_extensions import Self

from devplugin_sdk.allocation import TopologyScorer
from devplugin_sdk.backends.nvidia import claim_config, sharing
from devplugin_sdk.backends.nvidia.config import NvidiaConfig, VgpuSharing
from devplugin_sdk.backends.nvidia.container import container_setup
from devplugin_sdk.backends.nvidia.discovery import GpuInfo, Inventory, Scanner, select
from devplugin_sdk.backends.nvidia.events import XidEvents
from devplugin_sdk.backends.nvidia.health import GpuHealth
from devplugin_sdk.backends.nvidia.library import NvmlLibrary, load_nvml
from devplugin_sdk.backends.nvidia.topology import TopologyCache
from devplugin_sdk.dra.config import Configurable, RequestConfig
from devplugin_sdk.errors import AllocationError, BackendError, ConfigError
from devplugin_sdk.plugin import DevicePlugin
from devplugin_sdk.types import Allocation, Device, Health, HealthEvent, RescanEvent, replicate

__all__ = ["NvmlPlugin"]


class NvmlPlugin(DevicePlugin, Configurable):
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
        self._library = NvmlLibrary(nvml if nvml is not None else load_nvml())
        self._known: dict[int, GpuInfo] = {}
        self._inventory = Inventory()
        self._health = GpuHealth(self._library, self.config.recovery_period, clock)
        self._events = XidEvents(
            self._health, self.config, self.resource_name, serves, lambda: self._inventory
        )
        self._shares = sharing.Shares(self.config, self.resource_name, lambda: self._inventory)
        self._topology = TopologyCache(self._library)
        self._claim_sharing = claim_config.ClaimSharing()

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
        if config.mig_strategy == "mixed" or config.memory is not None or config.replicas > 1:
            gpus = first._scan_once()
            if config.memory is not None:
                sharing.check_list_size(config, gpus)
            if config.mig_strategy == "mixed":
                profiles = sorted({m.profile for g in gpus for m in g.migs})
                plugins += [cls(config, mig_profile=p, **kwargs) for p in profiles]
            for plugin in plugins:
                plugin._check_replicas(gpus)
        return plugins

    def _check_replicas(self, gpus: Sequence[GpuInfo]) -> None:
        """Refuse replicas whose list could not reach the kubelet (before building one).

        Raises:
            ConfigError: on ``sharing.timeSlicing.replicas``, with the size.
        """
        if self.config.replicas == 1 or self.serves != "gpus" or self._sliced is not None:
            return
        try:
            units = select(gpus, self.config, self.mig_profile, lambda _: Health.UNHEALTHY)
        except BackendError:
            return  # a MIG layout the strategy refuses: discovery says so
        served = "GPU"
        if self.mig_profile is not None:
            served = f"{self.mig_profile} MIG device"
        elif self.config.mig_strategy == "single" and any(g.mig_enabled for g in gpus):
            served = "MIG device"
        sharing.check_replicas(self.config, units, served)

    # ------------------------------------------------------------------ NVML

    @property
    def nvml(self) -> Any:
        """The NVML module in use."""
        return self._library.nvml

    def scan(self) -> list[GpuInfo]:
        """Read every GPU through NVML (blocking; ``discover`` runs it in a worker thread).

        Raises:
            BackendError: NVML cannot be initialised or cannot list the GPUs.
        """
        gpus = Scanner(self._library.ensure_init(), self.config).gpus(self._known)
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
        with self._library.once() as nvml:
            return Scanner(nvml, self.config).gpus({})

    async def on_stop(self) -> None:
        """Free the event set and balance this plugin's ``nvmlInit`` with ``nvmlShutdown``."""
        await anyio.to_thread.run_sync(self._shutdown)

    def _shutdown(self) -> None:
        self._events.close()
        self._library.shutdown(self.resource_name)

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
                self._health.tracker.fault(gpu.uuid, gpu.fault)
        units = select(gpus, self.config, self.mig_profile, self._health.tracker.health)
        # Tens of thousands of memory units take a moment to build: not on the event loop.
        devices, gpu_of_key = await anyio.to_thread.run_sync(self._advertise, units)
        index = {g.uuid: g.index for g in gpus}
        order = tuple(sorted({d.text("gpuUUID") for d in units}, key=lambda u: index[u]))
        self._inventory = Inventory(
            devices=devices,
            gpu_order=order,
            gpu_index={u: str(index[u]) for u in order},
            gpu_of_key=gpu_of_key,
            gpu_set=frozenset(order),
        )
        self._topology.reset()
        return devices

    def _advertise(self, units: list[Device]) -> tuple[list[Device], dict[str, str]]:
        """The devices advertised for ``units`` (the GPUs or MIG devices of this resource), and
        for memory units the GPU of each ID prefix."""
        memory = self.config.memory
        if self.serves == "memory" and memory is not None:
            return sharing.memory_units(units, memory)
        if self.serves == "count":
            return units, {}
        if self._sliced is not None:
            slices = replicate(units, self._sliced.slices)
            return sharing.shared_for_dra(slices, self.config, self._sliced), {}
        if self.config.replicas > 1:
            # Built without build() (or the GPUs changed since): still never a list past 4 MiB.
            sharing.check_replicas(self.config, units, "device")
            # A replica of a MIG device is no partition DRA could count (its siblings share it).
            whole = [replace(u, partition=None) if u.partition else u for u in units]
            replicas = replicate(whole, self.config.replicas)
            return sharing.shared_for_dra(replicas, self.config, None), {}
        return units, {}

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
            return self._shares.allocate_memory(devices)
        if self._sliced is not None:
            return self._shares.allocate_slices(devices, self._sliced)
        cfg = self.config
        if cfg.replicas > 1 and cfg.fail_requests_greater_than_one and len(devices) > 1:
            raise AllocationError(
                f"{self.resource_name}: {len(devices)} devices requested, but the maximum request"
                " size for shared resources is 1 (sharing.timeSlicing.failRequestsGreaterThanOne)"
            )
        # Replicas of one GPU are one GPU to the container.
        uuids = list(dict.fromkeys(d.text("uuid") for d in devices))
        return container_setup(cfg, uuids, devices)

    #: DRA claims may carry NVIDIA's ``GpuConfig``/``MigDeviceConfig`` (``claim_config``).
    config_kinds = claim_config.KINDS
    #: The command that sets a GPU's compute mode and time slice (a claim's ``TimeSlicing``).
    nvidia_smi: tuple[str, ...] = ("nvidia-smi",)

    async def allocate_configured(
        self, devices: Sequence[Device], config: RequestConfig
    ) -> Allocation:
        """``allocate``, then the request's configuration (DRA): the time slice set on its
        GPUs, or MPS limits in the container's environment. A share of memory also gets the
        variables the toolkit's memory-limit hook enforces (``sharing.enforced``)."""
        allocation = sharing.enforced(await self.allocate(devices))
        return await self._claim_sharing.apply(devices, config, allocation, self.nvidia_smi)

    async def release_configured(self, devices: Sequence[Device], others: Sequence[Device]) -> None:
        """A claim's GPUs back at the Default time slice once no claim holds them."""
        await self._claim_sharing.release(devices, others, self.nvidia_smi)

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
            return self._shares.place_units(ids, must, size)
        topology = await self._topology.scores_for(available, self._inventory.gpu_set)
        if self._sliced is not None:
            return self._shares.place_slices(available, must, size, topology)
        scorer = TopologyScorer(
            topology.scores,
            numa_nodes={d.id: d.numa_nodes[0] for d in available if d.numa_nodes},
            units={d.id: d.text("gpuUUID") for d in available},
        )
        return scorer.choose(ids, size, must)

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
            gpu_set = self._inventory.gpu_set
            gpus = sorted({g for d in devices if (g := d.parent) is not None and g in gpu_set})
            return await self._health.check_gpus(gpus)
        ours = {d.id: d for d in self._inventory.devices}
        return await self._health.check_devices([ours[d.id] for d in devices if d.id in ours])

    async def watch(self) -> AsyncIterator[HealthEvent | RescanEvent]:
        """Push Xid and double-bit ECC faults the moment NVML reports them (the pushed signal).

        One event set covers every GPU of this resource; it is opened again when a rescan
        changes the GPUs, and a ``probe_interval`` after a GPU failed to register or a wait
        failed (the polled probe covers lost GPUs meanwhile).
        """
        # Closed here, not when collected: its event set is freed as the engine stops watching.
        async with contextlib.aclosing(self._events.watch()) as events:
            async for event in events:
                yield event
