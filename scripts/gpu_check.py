"""GPU check: the NVIDIA backend against the GPUs of this machine, once, with figures.

Runs ``devplugin_sdk.backends.nvidia`` on a GPU node, with no kubelet and no API server: the
kubelet is ``FakeKubelet`` (real gRPC on real unix sockets), the API server the in-memory
``MemoryApi``. Four parts, each timed and reported; a part that fails is recorded and the
others still run:

a. discovery: ``NvmlPlugin.discover()`` (NVML initialised inside), the devices with their
   UUIDs, memory, MIG mode and NUMA node; what the polled health probe answers; which NVML
   events each GPU supports;
b. device plugin: ``devplugin run nvidia --config FILE`` in a subprocess against FakeKubelet:
   time to registered and allocatable, Allocate latency (admission through the kubelet, and
   the bare RPC), one response as ``devplugin probe`` sees it, kubelet restarts;
c. DRA: the same backend served as the DRA driver ``gpu.nvidia.com`` (``api: dra``) in this
   process: the published ResourceSlice, NodePrepareResources/NodeUnprepareResources rounds and
   the CDI spec of a prepared claim;
d. health: the plugin of (b) keeps serving for a minute with its Xid events and NVML probe,
   while this process follows ListAndWatch, probes the socket every 5 s and listens for Xid
   events itself; the transitions seen, and the plugin's CPU time and RSS over the minute.

Every figure is printed and written as JSON (``--json``, default ``$OUT/gpu_check.json`` when
``$OUT`` is set, else ``./gpu_check.json``); the plugin's own log goes beside it as
``plugin.log``. Usage::

    python scripts/gpu_check.py [--fake-nvml]

On a GPU node, run it without ``--fake-nvml``, as root (NVML and the /dev/nvidia* nodes), with
the SDK, its runtime dependencies at their floors (grpcio>=1.85.1, protobuf>=7.35.1: the
generated code checks them at import) and nvidia-ml-py importable; it takes about 65 s, the
health minute included. With ``--fake-nvml`` it runs anywhere, on the fake HGX H100 of
``devplugin_sdk.testing.fake_nvml``, to try the script itself. ``--allocations``,
``--restarts``, ``--dra-rounds`` and ``--health-seconds`` size the parts (200, 3, 50, 60 s).
The exit status is 0 when every part ran, 1 when one failed (the JSON says which and why).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import platform
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import IO, Any

import anyio
import anyio.abc
import anyio.to_thread
import yaml

import devplugin_sdk
from devplugin_sdk import Device
from devplugin_sdk.backends.nvidia import NvmlPlugin
from devplugin_sdk.cli.runfile import parse_run_config
from devplugin_sdk.kubelet import probe
from devplugin_sdk.testing import FakeKubelet, KubeletDevice, MemoryApi, fake_nvml, serving

GPU = "nvidia.com/gpu"
DRIVER = "gpu.nvidia.com"
NODE = "gpu-node"
NAMESPACE = "gpu-check"
FAKE_MACHINE = "hgx_h100"
PACKAGES = (
    "grpcio",
    "protobuf",
    "anyio",
    "typing-extensions",
    "pyyaml",
    "exceptiongroup",
    "nvidia-ml-py",
    "prometheus-client",
    "lightkube",
    "lightkube-models",
)

# The backend keys of examples/nvidia/config.yaml (its containerEnv belongs to the example's
# own plugin class, which `devplugin run nvidia` does not run), with the CDI device names listed
# too, so that a response shows all three ways a container learns its GPUs.
BACKEND_CONFIG: dict[str, Any] = {
    "version": "v1",
    "migStrategy": "none",
    "deviceListStrategy": ["envvar", "cdi"],
    "cdiKind": "nvidia.com/gpu",
    "passDeviceSpecs": True,
    "sharing": {
        "timeSlicing": {
            "replicas": 1,
            "renameByDefault": False,
            "failRequestsGreaterThanOne": False,
        }
    },
    "health": {
        "disabled": False,
        "ignoredXids": [109],
        "probeInterval": 5,
        "recoveryPeriod": 60,
    },
}
# The SDK keys of examples/nvidia/config-dra.yaml.
DRA_CONFIG: dict[str, Any] = {"api": "dra", "dra": {"driver": DRIVER, "cdiDir": "/var/run/cdi"}}


# ----------------------------------------------------------------------------- reporting


@dataclass
class Check:
    """What every part needs: the NVML module in use, the host roots, and the figures so far."""

    args: argparse.Namespace
    nvml: Any
    fake: fake_nvml.FakeNVML | None
    roots: dict[str, str]
    work: Path
    out: Path
    figures: dict[str, Any] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    devices: int = 0

    def record(self, section: str, key: str, value: Any) -> None:
        """Keep ``value`` under ``section.key`` and print it."""
        self.figures.setdefault(section, {})[key] = value
        shown = value if isinstance(value, str) else json.dumps(value, default=str)
        print(f"[{section}] {key}: {shown}", flush=True)

    def build(self, options: Mapping[str, Any]) -> list[NvmlPlugin]:
        """``NvmlPlugin.from_config`` on this machine (the fake one with ``--fake-nvml``)."""
        config = {**options, **self.roots}
        if self.fake is None:
            return NvmlPlugin.from_config(config)
        with self.fake.installed():
            return NvmlPlugin.from_config(config)


def summary(samples: Sequence[float]) -> dict[str, float | int]:
    """Count, min, p50, p90, p99, max and mean of ``samples`` (seconds) in milliseconds."""
    ordered = sorted(samples)
    if not ordered:
        return {"n": 0}

    def rank(p: float) -> float:
        # Nearest rank: the smallest sample with at least p % of the samples at or below it.
        return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)] * 1000

    return {
        "n": len(ordered),
        "min_ms": round(ordered[0] * 1000, 3),
        "p50_ms": round(rank(50), 3),
        "p90_ms": round(rank(90), 3),
        "p99_ms": round(rank(99), 3),
        "max_ms": round(ordered[-1] * 1000, 3),
        "mean_ms": round(sum(ordered) / len(ordered) * 1000, 3),
    }


def ms(seconds: float) -> float:
    return round(seconds * 1000, 3)


class _Warnings(logging.Handler):
    """Collects this process's WARNING and ERROR lines for the report."""

    def __init__(self, into: list[str]) -> None:
        super().__init__(logging.WARNING)
        self.into = into

    def emit(self, record: logging.LogRecord) -> None:
        self.into.append(f"checker {record.levelname} {record.name}: {record.getMessage()}")


async def part(check: Check, name: str, timeout: float, body: Awaitable[None]) -> None:
    """Run one part within ``timeout`` seconds; a failure is recorded, not raised."""
    print(f"\n===== {name} =====", flush=True)
    started = time.perf_counter()
    try:
        with anyio.fail_after(timeout):
            await body
    except Exception:
        check.errors[name] = traceback.format_exc()
        print(f"[{name}] FAILED:\n{check.errors[name]}", flush=True)
    print(f"===== {name}: {time.perf_counter() - started:.1f} s =====", flush=True)


# ----------------------------------------------------------------------------- the machine


def environment(check: Check) -> None:
    """Python, the packages as installed and as imported, and NVML's own versions."""
    check.record("machine", "python", f"{platform.python_version()} ({sys.executable})")
    check.record("machine", "platform", platform.platform())
    check.record("machine", "cpus", os.cpu_count())
    installed: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            installed[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            installed[name] = None
    check.record("machine", "packages", installed)
    check.record("machine", "devplugin_sdk", str(Path(devplugin_sdk.__file__).parent))
    nvml = check.nvml
    check.record("machine", "pynvml", "fake_nvml" if check.fake is not None else str(nvml.__file__))
    nvml.nvmlInit()
    try:
        nvml_version = getattr(nvml, "nvmlSystemGetNVMLVersion", None)
        cuda = nvml.nvmlSystemGetCudaDriverVersion()
        check.record("nvml", "driver_version", _text(nvml.nvmlSystemGetDriverVersion()))
        check.record("nvml", "nvml_version", _text(nvml_version()) if nvml_version else None)
        check.record("nvml", "cuda_driver_version", f"{cuda // 1000}.{cuda % 1000 // 10}")
        check.record(
            "nvml", "gpus", [_gpu_facts(nvml, i) for i in range(nvml.nvmlDeviceGetCount())]
        )
    finally:
        nvml.nvmlShutdown()


def _gpu_facts(nvml: Any, index: int) -> dict[str, Any]:
    handle = nvml.nvmlDeviceGetHandleByIndex(index)
    facts: dict[str, Any] = {"index": index, "name": _text(nvml.nvmlDeviceGetName(handle))}
    facts["uuid"] = _text(nvml.nvmlDeviceGetUUID(handle))
    facts["pci_bus_id"] = _text(nvml.nvmlDeviceGetPciInfo(handle).busId)
    xid = nvml.nvmlEventTypeXidCriticalError
    queries: dict[str, Callable[[], object]] = {
        "mig_mode": lambda: list(nvml.nvmlDeviceGetMigMode(handle)),
        "supported_event_types": lambda: hex(nvml.nvmlDeviceGetSupportedEventTypes(handle)),
        "xid_events_supported": lambda: bool(nvml.nvmlDeviceGetSupportedEventTypes(handle) & xid),
        "volatile_uncorrected_ecc": lambda: _ecc(nvml, handle),
        "remapped_rows": lambda: list(nvml.nvmlDeviceGetRemappedRows(handle)),
    }
    for key, query in queries.items():
        try:
            facts[key] = query()
        except nvml.NVMLError as exc:
            facts[key] = f"NVML error: {exc}"
    return facts


def _ecc(nvml: Any, handle: Any) -> int:
    return int(
        nvml.nvmlDeviceGetTotalEccErrors(
            handle, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC
        )
    )


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


# ----------------------------------------------------------------------------- a. discovery


async def discovery(check: Check) -> None:
    """First and second ``discover()``, the GPUs as scanned, and the probe's answer."""
    [plugin] = check.build(BACKEND_CONFIG)
    try:
        started = time.perf_counter()
        devices = await plugin.discover()
        check.record("discovery", "first_discover_ms_nvml_init_included", ms(_since(started)))
        started = time.perf_counter()
        await plugin.discover()
        check.record("discovery", "second_discover_ms", ms(_since(started)))
        check.devices = len(devices)
        check.record("discovery", "devices_found", len(devices))
        check.record("discovery", "devices", [_device_json(d) for d in devices])
        gpus = await anyio.to_thread.run_sync(plugin.scan)
        check.record(
            "discovery",
            "gpus",
            [
                {
                    "index": g.index,
                    "uuid": g.uuid,
                    "name": g.name,
                    "memory_mib": g.memory_bytes >> 20,
                    "pci_bus_id": g.pci_bus_id,
                    "minor": g.minor,
                    "numa_node": g.numa_node,
                    "mig_enabled": g.mig_enabled,
                    "migs": len(g.migs),
                    "fault": g.fault,
                    "facts": dataclasses.asdict(g.facts),
                }
                for g in gpus
            ],
        )
        probes = []
        for _ in range(3):
            started = time.perf_counter()
            report = await plugin.check_health(devices)
            probes.append(_since(started))
        check.record("discovery", "health_probe", summary(probes))
        check.record(
            "discovery",
            "health_probe_answer",
            {k: str(v) for k, v in report.items()},
        )
        check.record("discovery", "health_probe_reasons", dict(getattr(report, "reasons", {})))
    finally:
        await plugin.on_stop()


def _since(started: float) -> float:
    return time.perf_counter() - started


def _device_json(device: Device) -> dict[str, Any]:
    return {
        "id": device.id,
        "health": str(device.health),
        "numa_nodes": list(device.numa_nodes),
        "device_nodes": [n.host_path for n in device.device_nodes],
        "attributes": {k: str(v) for k, v in device.attributes.items()},
        "capacity": {k: str(v) for k, v in device.capacity.items()},
    }


# ----------------------------------------------------------------------------- b. device plugin


@dataclass
class ListLog:
    """Every ListAndWatch message the kubelet processed, with its time and device health."""

    messages: list[tuple[float, dict[str, str]]] = field(default_factory=list)

    def on_list(self, resource: str, devices: tuple[KubeletDevice, ...]) -> None:
        if resource == GPU:
            self.messages.append((time.monotonic(), {d.id: d.health for d in devices}))

    def transitions(self, since: float) -> list[dict[str, Any]]:
        """Device health changes between consecutive messages after ``since``."""
        out: list[dict[str, Any]] = []
        previous: dict[str, str] | None = None
        for at, health in self.messages:
            if previous is not None and at >= since:
                for device_id in sorted(set(health) | set(previous)):
                    old, new = previous.get(device_id), health.get(device_id)
                    if old != new:
                        out.append(
                            {"at": round(at - since, 3), "id": device_id, "from": old, "to": new}
                        )
            previous = health
        return out


@dataclass
class PluginProcess:
    """The ``devplugin run`` subprocess and the file its log goes to."""

    process: anyio.abc.Process
    log_path: Path
    spawned: float


def plugin_command(check: Check, config_file: Path, directory: Path) -> list[str]:
    run = [
        "run",
        "nvidia",
        "--config",
        str(config_file),
        "--device-plugin-dir",
        str(directory),
        "--registration",
        "kubelet",
        "--log-format",
        "json",
    ]
    if check.fake is None:
        return [sys.executable, "-m", "devplugin_sdk", *run]
    # The fake machine's host trees were written under work/host (HostRoots of `setup`).
    host = str(check.work / "host")
    runner = ["-m", "devplugin_sdk.testing.fake_nvml", "--machine", FAKE_MACHINE]
    return [sys.executable, *runner, "--host-root", host, "--", *run]


def _child_env() -> dict[str, str]:
    # The SDK this script imported, first on the child's path too.
    source = str(Path(devplugin_sdk.__file__).parent.parent)
    paths = [source, *(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p)]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(dict.fromkeys(paths))}


@asynccontextmanager
async def plugin_process(command: list[str], log_file: IO[bytes]) -> AsyncIterator[PluginProcess]:
    """Run ``command`` for the body; SIGTERM at the end, then kill if it does not exit."""
    spawned = time.perf_counter()
    process = await anyio.open_process(
        command, stdin=None, stdout=log_file, stderr=log_file, env=_child_env()
    )
    try:
        yield PluginProcess(process, Path(log_file.name), spawned)
    finally:
        with anyio.CancelScope(shield=True):
            if process.returncode is None:
                process.terminate()
                with anyio.move_on_after(15):
                    await process.wait()
            if process.returncode is None:
                process.kill()
                await process.wait()
            await process.aclose()


async def device_plugin(check: Check) -> None:
    """Parts b and d: one plugin process, FakeKubelet, allocations, restarts, a health minute."""
    if check.devices < 1:
        raise RuntimeError("discovery found no devices (or failed): nothing to serve")
    config_file = check.work / "config.yaml"
    config_file.write_text(yaml.safe_dump({**BACKEND_CONFIG, **check.roots}))
    lists = ListLog()
    log_path = check.out / "plugin.log"
    try:
        with log_path.open("wb") as log_file:
            async with FakeKubelet(on_list=lists.on_list) as kubelet:
                command = plugin_command(check, config_file, kubelet.directory)
                check.record("device_plugin", "command", " ".join(command))
                async with plugin_process(command, log_file) as plugin:
                    await _serve_and_measure(check, kubelet, plugin, lists)
    finally:
        _plugin_log(check, log_path)


async def _serve_and_measure(
    check: Check, kubelet: FakeKubelet, plugin: PluginProcess, lists: ListLog
) -> None:
    """Once registered, each measurement on its own: one that fails does not stop the next."""
    try:
        await _registration(check, kubelet, plugin)
    except TimeoutError:
        check.record("device_plugin", "plugin_exit_code_so_far", plugin.process.returncode)
        raise
    steps: list[tuple[str, Callable[[], Awaitable[None]]]] = [
        ("allocations", lambda: _allocations(check, kubelet)),
        ("probe", lambda: _probe_once(check, kubelet)),
        ("restarts", lambda: _restarts(check, kubelet)),
        ("health_minute", lambda: health_minute(check, kubelet, plugin, lists)),
        ("sigterm", lambda: _sigterm(check, kubelet, plugin)),
    ]
    for name, step in steps:
        try:
            await step()
        except Exception:
            check.errors[f"device_plugin.{name}"] = traceback.format_exc()
            print(f"[device_plugin.{name}] FAILED:\n{traceback.format_exc()}", flush=True)


async def _sigterm(check: Check, kubelet: FakeKubelet, plugin: PluginProcess) -> None:
    started = time.perf_counter()
    plugin.process.terminate()
    with anyio.fail_after(20):
        code = await plugin.process.wait()
    check.record("device_plugin", "sigterm_exit_code", code)
    check.record("device_plugin", "sigterm_to_exit_ms", ms(_since(started)))
    check.record("device_plugin", "files_left_in_device_plugin_dir", _names_in(kubelet.directory))


async def _registration(check: Check, kubelet: FakeKubelet, plugin: PluginProcess) -> None:
    n = check.devices
    await kubelet.wait_for(lambda: kubelet.is_registered(GPU), 60, "registration")
    check.record("device_plugin", "spawn_to_registered_ms", ms(_since(plugin.spawned)))
    await kubelet.wait_for(lambda: kubelet.allocatable(GPU) == n, 60, f"allocatable {n}")
    check.record("device_plugin", "spawn_to_allocatable_ms", ms(_since(plugin.spawned)))
    check.record("device_plugin", "allocatable", kubelet.allocatable(GPU))
    check.record("device_plugin", "capacity", kubelet.capacity(GPU))
    [registration] = kubelet.successful_registrations(GPU)
    check.record("device_plugin", "registration", dataclasses.asdict(registration))


async def _allocations(check: Check, kubelet: FakeKubelet) -> None:
    """Admit and release a 1-GPU container N times; then N bare Allocate calls."""
    admitted: list[float] = []
    first = None
    for i in range(check.args.allocations):
        started = time.perf_counter()
        got = await kubelet.allocate(GPU, 1, pod=f"pod-{i}")
        admitted.append(_since(started))
        kubelet.release(got)
        first = first or got
    assert first is not None
    check.record("device_plugin", "admit_1_gpu_preferred_then_allocate", summary(admitted))
    check.record("device_plugin", "admitted_device_ids", list(first.device_ids))
    check.record("device_plugin", "preferred", list(first.preferred or ()))
    check.record("device_plugin", "allocate_response", probe.allocation_json(first.allocation))
    bare: list[float] = []
    for _ in range(check.args.allocations):
        started = time.perf_counter()
        await kubelet.call_allocate(GPU, first.device_ids)
        bare.append(_since(started))
    check.record("device_plugin", "allocate_rpc_1_gpu", summary(bare))


def _registered_more_than(kubelet: FakeKubelet, count: int) -> Callable[[], bool]:
    return lambda: len(kubelet.successful_registrations(GPU)) > count


def _socket(kubelet: FakeKubelet) -> Path:
    registration = kubelet.successful_registrations(GPU)[-1]
    return kubelet.directory / registration.endpoint


async def _probe_once(check: Check, kubelet: FakeKubelet) -> None:
    """What ``devplugin probe --allocate 1`` reports (the kubelet's-eye client)."""
    async with await probe.PluginClient.connect(_socket(kubelet)) as client:
        report = await probe.probe(client, allocate=1)
    check.record("device_plugin", "probe", report.to_json())


async def _restarts(check: Check, kubelet: FakeKubelet) -> None:
    n = check.devices
    registered: list[float] = []
    allocatable: list[float] = []
    for _ in range(check.args.restarts):
        before = len(kubelet.successful_registrations(GPU))
        started = time.perf_counter()
        await kubelet.restart()
        await kubelet.wait_for(_registered_more_than(kubelet, before), 30, "re-registration")
        registered.append(_since(started))
        await kubelet.wait_for(lambda: kubelet.allocatable(GPU) == n, 30, f"allocatable {n}")
        allocatable.append(_since(started))
    check.record("device_plugin", "kubelet_restart_to_registered", summary(registered))
    check.record("device_plugin", "kubelet_restart_to_allocatable", summary(allocatable))
    check.record(
        "device_plugin",
        "kubelet_restart_to_allocatable_each_ms",
        [ms(s) for s in allocatable],
    )


# ----------------------------------------------------------------------------- d. health minute


@dataclass
class Usage:
    """CPU time, RSS and threads of a process at one moment (Linux /proc)."""

    cpu_seconds: float
    rss_kib: int
    hwm_kib: int
    threads: int

    @classmethod
    def of(cls, pid: int) -> Usage:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        # utime and stime, the 14th and 15th fields, are the 12th and 13th after the name.
        ticks = int(fields[11]) + int(fields[12])
        status: dict[str, str] = {}
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            status[key] = value.strip()
        return cls(
            cpu_seconds=ticks / os.sysconf("SC_CLK_TCK"),
            rss_kib=int(status["VmRSS"].split()[0]),
            hwm_kib=int(status["VmHWM"].split()[0]),
            threads=int(status["Threads"]),
        )


class XidListener(threading.Thread):
    """This process's own NVML event set (Xid, ECC) on every GPU, beside the plugin's."""

    def __init__(self, nvml: Any) -> None:
        super().__init__(name="xid-listener", daemon=True)
        self.nvml = nvml
        self.events: list[dict[str, Any]] = []
        self.registered: dict[str, str] = {}
        self.error: str | None = None
        self.stop = threading.Event()

    def run(self) -> None:
        nvml = self.nvml
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as exc:
            self.error = f"nvmlInit: {exc}"
            return
        try:
            self._listen(nvml)
        except nvml.NVMLError as exc:
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            nvml.nvmlShutdown()

    def _listen(self, nvml: Any) -> None:
        event_set = nvml.nvmlEventSetCreate()
        wanted = (
            nvml.nvmlEventTypeXidCriticalError
            | nvml.nvmlEventTypeDoubleBitEccError
            | nvml.nvmlEventTypeSingleBitEccError
        )
        try:
            for index in range(nvml.nvmlDeviceGetCount()):
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                mask = wanted & nvml.nvmlDeviceGetSupportedEventTypes(handle)
                if mask:
                    nvml.nvmlDeviceRegisterEvents(handle, mask, event_set)
                self.registered[_text(nvml.nvmlDeviceGetUUID(handle))] = hex(mask)
            while not self.stop.is_set():
                try:
                    event = nvml.nvmlEventSetWait_v2(event_set, 500)
                except nvml.NVMLError_Timeout:
                    continue
                self.events.append(
                    {
                        "at": time.time(),
                        "type": hex(int(event.eventType)),
                        "data": int(event.eventData),
                        "gpu_instance": int(event.gpuInstanceId),
                        "compute_instance": int(event.computeInstanceId),
                    }
                )
        finally:
            nvml.nvmlEventSetFree(event_set)


async def health_minute(
    check: Check, kubelet: FakeKubelet, plugin: PluginProcess, lists: ListLog
) -> None:
    """Serve for ``--health-seconds``: the kubelet's view, a probe every 5 s, our own Xid
    listener, and the plugin's CPU time and RSS."""
    seconds = check.args.health_seconds
    pid = plugin.process.pid
    listener = XidListener(check.nvml)
    listener.start()
    polls: list[dict[str, Any]] = []
    changes: list[str] = []
    since = time.monotonic()
    messages = kubelet.messages(GPU)
    before = Usage.of(pid)
    peak = before.rss_kib
    async with anyio.create_task_group() as tg:
        tg.start_soon(_poll_probe, kubelet, polls)
        tg.start_soon(_follow, kubelet, changes)
        elapsed = 0.0
        while elapsed < seconds:
            step = min(5.0, seconds - elapsed)
            await anyio.sleep(step)
            elapsed += step
            peak = max(peak, Usage.of(pid).rss_kib)
        tg.cancel_scope.cancel()
    after = Usage.of(pid)
    listener.stop.set()
    await anyio.to_thread.run_sync(listener.join, 5)
    section = "health_minute"
    check.record(section, "seconds", seconds)
    check.record(section, "still_registered", kubelet.is_registered(GPU))
    check.record(section, "allocatable_at_end", kubelet.allocatable(GPU))
    check.record(section, "listandwatch_messages_during", kubelet.messages(GPU) - messages)
    check.record(section, "health_transitions_kubelet_saw", lists.transitions(since))
    check.record(section, "health_changes_probe_watch_saw", changes)
    healthy = [p for p in polls if p.get("allocatable") == check.devices]
    check.record(section, "probe_polls", len(polls))
    check.record(section, "probe_polls_all_healthy", len(healthy))
    check.record(section, "probe_poll_ms", summary([p["seconds"] for p in polls if "seconds" in p]))
    check.record(section, "probe_poll_failures", [p for p in polls if "error" in p])
    check.record(section, "xid_listener_registered", listener.registered)
    check.record(section, "xid_listener_error", listener.error)
    check.record(section, "nvml_events_seen", listener.events)
    cpu = after.cpu_seconds - before.cpu_seconds
    check.record(section, "plugin_cpu_seconds", round(cpu, 3))
    check.record(section, "plugin_cpu_percent", round(100 * cpu / seconds, 3))
    check.record(section, "plugin_rss_mib_start", round(before.rss_kib / 1024, 1))
    check.record(section, "plugin_rss_mib_end", round(after.rss_kib / 1024, 1))
    check.record(section, "plugin_rss_mib_peak_sampled", round(peak / 1024, 1))
    check.record(section, "plugin_vmhwm_mib", round(after.hwm_kib / 1024, 1))
    check.record(section, "plugin_threads", after.threads)


async def _poll_probe(kubelet: FakeKubelet, polls: list[dict[str, Any]]) -> None:
    """``devplugin probe`` on the plugin's socket every 5 s."""
    while True:
        started = time.perf_counter()
        try:
            async with await probe.PluginClient.connect(_socket(kubelet)) as client:
                report = await probe.probe(client)
            healthy = len(report.devices.healthy)
            polls.append({"seconds": _since(started), "allocatable": healthy})
        except probe.ProbeError as exc:
            polls.append({"error": f"{exc.kind}: {exc}"})
        await anyio.sleep(5)


async def _follow(kubelet: FakeKubelet, changes: list[str]) -> None:
    """``devplugin probe --watch``: every change of the device list, as it happens."""
    async with await probe.PluginClient.connect(_socket(kubelet)) as client:
        async for _devices, diff in probe.watch(client):
            changes.extend(c.describe() for c in diff)


def _plugin_log(check: Check, path: Path) -> None:
    """The plugin's log: its warnings, its health lines, and the whole of it printed."""
    entries: list[dict[str, Any]] = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            entries.append(json.loads(line))
        except json.JSONDecodeError:
            entries.append({"level": "RAW", "message": line})
    print("----- plugin log -----", flush=True)
    for entry in entries:
        print(json.dumps(entry), flush=True)
    print("----- end of plugin log -----", flush=True)
    loud = [e for e in entries if e.get("level") in ("WARNING", "ERROR", "CRITICAL", "RAW")]
    check.warnings += [f"plugin {e.get('level')}: {e.get('message')}" for e in loud]
    health = [e["message"] for e in entries if " is now " in str(e.get("message", ""))]
    xids = [e["message"] for e in entries if "Xid" in str(e.get("message", ""))]
    check.record("health_minute", "plugin_log_lines", len(entries))
    check.record("health_minute", "plugin_log_health_lines", health)
    check.record("health_minute", "plugin_log_xid_lines", xids)


# ----------------------------------------------------------------------------- c. DRA


async def dra(check: Check) -> None:
    """The backend as the DRA driver: slices, prepare/unprepare rounds, the CDI spec."""
    if check.devices < 1:
        raise RuntimeError("discovery found no devices (or failed): nothing to publish")
    config = parse_run_config({**DRA_CONFIG, **BACKEND_CONFIG})
    assert config.dra is not None
    api = MemoryApi(nodes=[NODE])
    plugins = check.build(config.backend_options)
    async with FakeKubelet(dra_api=api, node_name=NODE) as kubelet:
        root = kubelet.directory.parent
        driver = dataclasses.replace(
            config.dra,
            api=api,
            node_name=NODE,
            plugin_dir=root / "plugins" / DRIVER,
            cdi_dir=root / "cdi",
        )
        started = time.perf_counter()
        async with serving(*plugins, settings=kubelet.settings(), api=config.api, dra=driver):
            check.record("dra", "serve_started_ms", ms(_since(started)))
            await kubelet.wait_for(lambda: kubelet.dra.is_registered(DRIVER), 30, "DRA plugin")
            check.record("dra", "to_registered_ms", ms(_since(started)))
            await kubelet.wait_for(lambda: api.pool_complete(DRIVER, NODE), 30, "pool")
            check.record("dra", "to_pool_published_ms", ms(_since(started)))
            slices = api.pool(DRIVER, NODE)
            check.record("dra", "resource_slices", [_slice_json(s) for s in slices])
            names = [d.name for s in slices for d in s.devices]
            await _prepare_rounds(check, kubelet, api, names[0], driver.cdi_dir)


def _slice_json(resource_slice: Any) -> dict[str, Any]:
    return {
        "name": resource_slice.name,
        "driver": resource_slice.driver,
        "node": resource_slice.node_name,
        "pool": resource_slice.pool,
        "generation": resource_slice.generation,
        "slice_count": resource_slice.slice_count,
        "devices": [
            {
                "name": d.name,
                "attributes": {k: str(v) for k, v in d.attributes.items()},
                "capacity": {k: str(v) for k, v in d.capacity.items()},
            }
            for d in resource_slice.devices
        ],
    }


async def _prepare_rounds(
    check: Check, kubelet: FakeKubelet, api: MemoryApi, device: str, cdi_dir: Path
) -> None:
    """Allocate a one-GPU claim to a new pod, prepare it, unprepare it; ``--dra-rounds`` times."""
    prepared: list[float] = []
    unprepared: list[float] = []
    for i in range(check.args.dra_rounds):
        pod = kubelet.dra.pod(NAMESPACE, f"pod-{i}", [f"claim-{i}"])
        claim = api.allocate(
            NAMESPACE, f"claim-{i}", {"gpu": [device]}, driver=DRIVER, pool=NODE, pods=[pod.uid]
        )
        started = time.perf_counter()
        result = await kubelet.dra.prepare(pod)
        prepared.append(_since(started))
        spec_path = cdi_dir / f"k8s.{DRIVER}-claim_{claim.uid}.json"
        if i == 0:
            check.record("dra", "claim_device", device)
            check.record("dra", "prepared_cdi_ids", result.cdi_ids(f"claim-{i}"))
            check.record("dra", "cdi_spec_path", str(spec_path))
            check.record("dra", "cdi_spec", _read_json(spec_path))
        started = time.perf_counter()
        await kubelet.dra.unprepare(pod)
        unprepared.append(_since(started))
        if i == 0:
            check.record("dra", "cdi_spec_removed_by_unprepare", not spec_path.exists())
        api.delete_claim(NAMESPACE, f"claim-{i}")
    check.record("dra", "node_prepare_resources", summary(prepared))
    check.record("dra", "node_unprepare_resources", summary(unprepared))
    check.record("dra", "cdi_files_left", _names_in(cdi_dir))


def _names_in(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def _read_json(path: Path) -> Any:
    return json.loads(path.read_text())


# ----------------------------------------------------------------------------- main


def _write_json(path: Path, figures: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(figures, indent=2, default=str) + "\n")


def setup(args: argparse.Namespace, work: Path, out: Path) -> Check:
    """The NVML module and host roots: the real ones, or a fake machine's with ``--fake-nvml``."""
    if not args.fake_nvml:
        from devplugin_sdk.backends.nvidia import load_nvml  # noqa: PLC0415 - real NVML only

        return Check(args, load_nvml(), None, {}, work, out)
    fake = fake_nvml.MACHINES[FAKE_MACHINE]()
    roots = fake.write_host(work / "host")
    return Check(args, fake, fake, roots.config(), work, out)


async def main_async(args: argparse.Namespace) -> int:
    out = Path(args.json).parent
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="gpucheck-", dir="/tmp") as temporary:
        check = setup(args, Path(temporary), out)
        logging.getLogger().addHandler(_Warnings(check.warnings))
        started = time.perf_counter()
        try:
            await part(check, "environment", 30, anyio.to_thread.run_sync(environment, check))
            await part(check, "discovery", 60, discovery(check))
            await part(check, "device_plugin", 150 + args.health_seconds, device_plugin(check))
            await part(check, "dra", 90, dra(check))
        finally:
            check.figures["errors"] = check.errors
            check.figures["warnings"] = check.warnings
            check.figures["total_seconds"] = round(_since(started), 1)
            _write_json(Path(args.json), check.figures)
        print("\n===== summary =====", flush=True)
        print(f"warnings ({len(check.warnings)}):", flush=True)
        for line in check.warnings:
            print(f"  {line}", flush=True)
        print(f"failed parts: {sorted(check.errors) or 'none'}", flush=True)
        print(f"figures written to {args.json}", flush=True)
        return 1 if check.errors else 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=(__doc__ or "").split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--fake-nvml", action="store_true", help=f"a fake {FAKE_MACHINE}")
    parser.add_argument("--allocations", type=int, default=200, help="Allocate calls (b)")
    parser.add_argument("--restarts", type=int, default=3, help="kubelet restarts (b)")
    parser.add_argument("--dra-rounds", type=int, default=50, help="prepare/unprepare (c)")
    parser.add_argument("--health-seconds", type=float, default=60.0, help="health minute (d)")
    default_json = Path(os.environ.get("OUT", ".")) / "gpu_check.json"
    parser.add_argument("--json", default=str(default_json), help=f"default {default_json}")
    return parser


def main() -> int:
    args = _parser().parse_args()
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stdout,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    return anyio.run(main_async, args, backend="asyncio")


if __name__ == "__main__":
    sys.exit(main())
