"""Soak: a plugin process through thousands of kubelet restarts, crashes, flaps and allocations.

The long form of the reliability suite, as a script (it asserts nothing about time). A plugin
process with production settings serves one resource; in a loop for ``--minutes``, the
FakeKubelet in this process restarts (or crashes and starts over a stale ``kubelet.sock``, or
flaps several times in a row), the resource must become allocatable again, pods are admitted
and released, and a device's health is flipped through the plugin's event pipe. Every
``--report`` seconds it prints the cycle count, failures, and the plugin's RSS, threads and
open file descriptors, so that leaks show as growth. A failure is printed and counted, and
the soak goes on; the exit status is 1 if any cycle failed.

    python benchmarks/soak.py [--minutes 10] [--report 30]
"""

from __future__ import annotations

import os
import sys
import time

import _common
import anyio

from devplugin_sdk.testing import AdmissionError, ContainerAllocation, FakeKubelet

RESOURCE = "soak.example.com/dev"
DEVICES = 8


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


class Counts:
    cycles = 0
    failures = 0
    cleanup_races = 0
    starts = 0


async def start(kubelet: FakeKubelet, counts: Counts) -> None:
    """``kubelet.start()``, once more if its directory cleanup lost a race with the plugin.

    FakeKubelet removes each entry it listed with a plain unlink; a plugin in another process
    may remove its own socket in between (the real kubelet ignores a file already gone).
    """
    counts.starts += 1
    try:
        await kubelet.start()
    except FileNotFoundError as exc:
        counts.cleanup_races += 1
        print(f"cycle {counts.cycles}: FakeKubelet cleanup race ({exc}); starting again")
        await kubelet.start()


async def cycle(
    kubelet: FakeKubelet, counts: Counts, write_end: int, held: list[ContainerAllocation]
) -> None:
    """One round: a kubelet disruption, recovery, allocations and a health flip."""
    number = counts.cycles
    kind = number % 4
    if kind == 0:
        await kubelet.stop()
        await start(kubelet, counts)
    elif kind == 1:
        await kubelet.crash()
        await start(kubelet, counts)
    elif kind == 2:
        for _ in range(3):
            await kubelet.stop()
            await start(kubelet, counts)
    # kind 3: no disruption, only allocations and health
    await kubelet.wait_for_allocatable(RESOURCE, DEVICES, timeout=30)
    device = f"d{number % DEVICES}"
    os.write(write_end, f"{device} Unhealthy\n".encode())
    await kubelet.wait_for_health(RESOURCE, device, "Unhealthy", timeout=30)
    got = await kubelet.allocate(RESOURCE, 2)
    if device in got.device_ids:
        raise AdmissionError(f"unhealthy {device} was allocated")
    held.append(got)
    while len(held) > 2:
        kubelet.release(held.pop(0))
    os.write(write_end, f"{device} Healthy\n".encode())
    await kubelet.wait_for_health(RESOURCE, device, "Healthy", timeout=30)


async def main() -> None:
    args_parser = _common.parser(__doc__ or "")
    args_parser.add_argument("--minutes", type=float, default=10.0)
    args_parser.add_argument("--report", type=float, default=30.0, help="seconds between lines")
    args = args_parser.parse_args()
    _common.print_header("Soak", minutes=args.minutes, devices=DEVICES)
    read_end, write_end = os.pipe()
    counts = Counts()
    try:
        async with (
            FakeKubelet() as kubelet,
            _common.plugin_process(
                *("--dir", str(kubelet.directory), "--resource", f"{RESOURCE}={DEVICES}"),
                *("--control-fd", str(read_end)),
                pass_fds=[read_end],
            ) as process,
        ):
            await kubelet.wait_for_allocatable(RESOURCE, DEVICES, timeout=30)
            first = _common.process_stats(process.pid)
            first_fds = open_fds(process.pid)
            print(
                f"start: RSS {_common.mib(first.rss_bytes)}, {first.threads} threads, "
                f"{first_fds} fds"
            )
            held: list[ContainerAllocation] = []
            started = time.monotonic()
            next_report = started + args.report
            while time.monotonic() - started < args.minutes * 60:
                try:
                    await cycle(kubelet, counts, write_end, held)
                except (TimeoutError, AdmissionError) as exc:
                    counts.failures += 1
                    print(f"cycle {counts.cycles} failed: {exc}", flush=True)
                counts.cycles += 1
                if time.monotonic() >= next_report:
                    next_report += args.report
                    stats = _common.process_stats(process.pid)
                    print(
                        f"{time.monotonic() - started:7.0f} s: {counts.cycles} cycles, "
                        f"{counts.failures} failed, {counts.starts} kubelet starts, "
                        f"RSS {_common.mib(stats.rss_bytes)}, {stats.threads} threads, "
                        f"{open_fds(process.pid)} fds, "
                        f"{len(kubelet.successful_registrations(RESOURCE))} registrations",
                        flush=True,
                    )
            last = _common.process_stats(process.pid)
            print(
                f"end: {counts.cycles} cycles, {counts.failures} failed, "
                f"{counts.cleanup_races} FakeKubelet cleanup races; RSS "
                f"{_common.mib(first.rss_bytes)} -> {_common.mib(last.rss_bytes)}, threads "
                f"{first.threads} -> {last.threads}, fds {first_fds} -> {open_fds(process.pid)}"
            )
    finally:
        os.close(read_end)
        os.close(write_end)
    if counts.failures:
        sys.exit(1)


if __name__ == "__main__":
    anyio.run(main, backend="asyncio")
