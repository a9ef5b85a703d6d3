"""Helpers shared by the benchmark scripts: the machine description, percentiles, process stats.

Every benchmark prints the machine it ran on (CPU model, cores, Python, grpcio) before its
figures, so that a number in docs/performance.md can always be traced to its hardware.
Benchmarks print figures only; they assert nothing about time.
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import anyio
import anyio.abc

from devplugin_sdk import Device, DeviceNode
from devplugin_sdk.testing import FakeKubelet, KubeletDevice

REPO = Path(__file__).resolve().parent.parent
PLUGIN_PROCESS = Path(__file__).resolve().parent / "_plugin_process.py"

# /proc/<pid>/stat counts CPU time in clock ticks.
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")


def cpu_model() -> str:
    """The CPU model name from /proc/cpuinfo (Linux), else what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def machine() -> dict[str, str]:
    """What the figures depend on: CPU, cores, kernel, Python and library versions."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "cpu": cpu_model(),
        "cores": f"{usable} usable of {os.cpu_count()}",
        "os": f"{platform.system()} {platform.release()}",
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "grpcio": _version("grpcio"),
        "protobuf": _version("protobuf"),
        "anyio": _version("anyio"),
        "devplugin-sdk": _version("devplugin-sdk"),
        # Other work on the machine skews latencies: the 1-minute load average says how much.
        "load": f"{os.getloadavg()[0]:.2f}",
    }


def quiet_logs() -> None:
    """Keep the SDK's expected warnings (each restart logs one) out of the figures."""
    logging.getLogger("devplugin_sdk").setLevel(logging.ERROR)


def print_header(title: str, **parameters: object) -> None:
    """Print the benchmark's title, the machine and the parameters it ran with.

    Also silences the SDK's log below ERROR (see ``quiet_logs``).
    """
    quiet_logs()
    print(f"== {title}")
    print("machine: " + "; ".join(f"{k}={v}" for k, v in machine().items()))
    if parameters:
        print("parameters: " + "; ".join(f"{k}={v}" for k, v in parameters.items()))


@dataclass(frozen=True)
class Summary:
    """Percentiles of a list of durations, in seconds."""

    count: int
    p50: float
    p90: float
    p99: float
    mean: float
    minimum: float
    maximum: float

    @classmethod
    def of(cls, samples: Sequence[float]) -> Summary:
        """Summarise ``samples`` (nearest-rank percentiles).

        Raises:
            ValueError: if ``samples`` is empty.
        """
        if not samples:
            raise ValueError("no samples")
        ordered = sorted(samples)

        def rank(p: float) -> float:
            index = max(0, min(len(ordered) - 1, round(p / 100 * len(ordered) + 0.5) - 1))
            return ordered[index]

        return cls(
            count=len(ordered),
            p50=rank(50),
            p90=rank(90),
            p99=rank(99),
            mean=statistics.fmean(ordered),
            minimum=ordered[0],
            maximum=ordered[-1],
        )

    def ms(self) -> str:
        """One line in milliseconds."""
        return (
            f"n={self.count} p50={self.p50 * 1e3:.3f} ms p90={self.p90 * 1e3:.3f} ms "
            f"p99={self.p99 * 1e3:.3f} ms mean={self.mean * 1e3:.3f} ms "
            f"min={self.minimum * 1e3:.3f} ms max={self.maximum * 1e3:.3f} ms"
        )


def report(label: str, samples: Sequence[float]) -> Summary:
    """Print and return the summary of ``samples`` under ``label``."""
    summary = Summary.of(samples)
    print(f"{label:<44} {summary.ms()}")
    return summary


def target(label: str, value: float, limit: float, unit: str = "ms") -> None:
    """Print a figure beside its target (informational: nothing fails on time)."""
    verdict = "meets" if value < limit else "MISSES"
    print(f"target: {label}: {value:.3f} {unit} vs < {limit:g} {unit}: {verdict}")


@dataclass(frozen=True)
class ProcessStats:
    """Resource use of a process at one moment (Linux /proc)."""

    rss_bytes: int
    cpu_seconds: float
    threads: int
    voluntary_switches: int
    involuntary_switches: int


def process_stats(pid: int) -> ProcessStats:
    """Read RSS, CPU time, threads and context switches of ``pid`` from /proc.

    Raises:
        OSError: the process is gone or /proc is not available.
    """
    stat = Path(f"/proc/{pid}/stat").read_text()
    # Fields after the parenthesised command name; utime and stime are fields 14 and 15.
    fields = stat.rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / CLOCK_TICKS
    values: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "Threads"):
            values[key] = int(rest.split()[0])
    voluntary = involuntary = 0
    on_cpu_ns = 0
    for task in Path(f"/proc/{pid}/task").iterdir():  # switches are counted per thread
        try:
            status = (task / "status").read_text()
            # schedstat: nanoseconds on CPU, finer than the 10 ms ticks of /proc/<pid>/stat.
            on_cpu_ns += int((task / "schedstat").read_text().split()[0])
        except OSError:
            continue  # the thread ended meanwhile
        for line in status.splitlines():
            key, _, rest = line.partition(":")
            if key == "voluntary_ctxt_switches":
                voluntary += int(rest)
            elif key == "nonvoluntary_ctxt_switches":
                involuntary += int(rest)
    return ProcessStats(
        rss_bytes=values["VmRSS"] * 1024,
        cpu_seconds=on_cpu_ns / 1e9 if on_cpu_ns else cpu,
        threads=values["Threads"],
        voluntary_switches=voluntary,
        involuntary_switches=involuntary,
    )


def thread_wakeups(pid: int) -> dict[str, int]:
    """Voluntary context switches of each thread of ``pid``, by ``<name>/<tid>``."""
    out: dict[str, int] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            for line in (task / "status").read_text().splitlines():
                if line.startswith("voluntary_ctxt_switches"):
                    out[f"{name}/{task.name}"] = int(line.split(":")[1])
        except OSError:
            continue
    return out


def rss_bytes() -> int:
    """Resident set size of this process, in bytes."""
    return process_stats(os.getpid()).rss_bytes


def mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def parser(description: str) -> argparse.ArgumentParser:
    """An argument parser whose help is the benchmark's docstring."""
    return argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )


class Stopwatch:
    """``perf_counter`` deltas, named for readability at call sites."""

    def __init__(self) -> None:
        self.started = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.started


def devices(prefix: str, count: int) -> list[Device]:
    """``count`` devices ``<prefix>0..``, one device node each, alternating two NUMA nodes."""
    return [
        Device(
            f"{prefix}{i}",
            numa_nodes=(i % 2,),
            device_nodes=(DeviceNode(f"/dev/{prefix}{i}"),),
        )
        for i in range(count)
    ]


class TimedKubelet(FakeKubelet):
    """A FakeKubelet that timestamps each ListAndWatch message as it arrives.

    The arrival is taken after gRPC has parsed the message and before the kubelet's own
    bookkeeping (device sets, checkpoint file), through FakeKubelet's ``on_list`` hook, which
    separates the plugin's share of a propagation from the fake kubelet's.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(on_list=self._arrived, **kwargs)
        self.received = 0
        self.received_at = 0.0

    def _arrived(self, resource: str, devices: Sequence[KubeletDevice]) -> None:
        self.received_at = time.perf_counter()
        self.received += 1

    async def wait_for_message(self, after: int, timeout: float = 30.0) -> float:
        """Wait until more than ``after`` messages arrived; return the last arrival time."""
        await self.wait_for(lambda: self.received > after, timeout, f"message {after + 1}")
        return self.received_at


@asynccontextmanager
async def plugin_process(
    *args: str, pass_fds: Sequence[int] = (), wait_line: bool = False, capture: bool = False
) -> AsyncIterator[anyio.abc.Process]:
    """Run ``_plugin_process.py`` with ``args``; SIGTERM it and wait on exit.

    Args:
        args: Its command-line arguments.
        pass_fds: File descriptors the child inherits.
        wait_line: Wait for the first line on its stdout (``--bare`` prints ``ready``).
        capture: Leave its stdout to the caller as ``process.stdout``.
    """
    process = await anyio.open_process(
        [sys.executable, str(PLUGIN_PROCESS), *args],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE if wait_line or capture else None,
        stderr=None,
        pass_fds=pass_fds,
    )
    try:
        if wait_line:
            assert process.stdout is not None
            buffered = b""
            while b"\n" not in buffered:
                buffered += await process.stdout.receive()
        yield process
    finally:
        with anyio.CancelScope(shield=True):
            if process.returncode is None:
                process.terminate()
            await process.wait()
            await process.aclose()


class ListAndWatchObserver:
    """A raw ListAndWatch client in a process of its own that timestamps each message.

    It never parses a message and shares neither an event loop nor a GIL with this process,
    so its arrival times measure the plugin and the transport alone, even while a FakeKubelet
    here is busy with a large list. Timestamps are ``time.monotonic()`` (CLOCK_MONOTONIC on
    Linux, one clock for every process): compare them with ``time.monotonic()`` here.
    """

    def __init__(self, socket_path: Path) -> None:
        self.socket_path = socket_path
        self.arrivals: list[float] = []
        self.sizes: list[int] = []
        self._changed = anyio.Event()

    @asynccontextmanager
    async def running(self) -> AsyncIterator[ListAndWatchObserver]:
        async with (
            plugin_process("--observe", str(self.socket_path), capture=True) as process,
            anyio.create_task_group() as tg,
        ):
            assert process.stdout is not None
            tg.start_soon(self._read, process.stdout)
            try:
                yield self
            finally:
                tg.cancel_scope.cancel()

    async def _read(self, stdout: anyio.abc.ByteReceiveStream) -> None:
        pending = b""
        async for chunk in stdout:
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                stamp, size = line.split()
                self.arrivals.append(float(stamp))
                self.sizes.append(int(size))
            self._changed.set()
            self._changed = anyio.Event()

    async def wait_for(self, count: int, timeout: float = 120.0) -> float:
        """Wait until ``count`` messages arrived; return the last one's ``monotonic`` time."""
        with anyio.fail_after(timeout):
            while len(self.arrivals) < count:
                await self._changed.wait()
        return self.arrivals[count - 1]
