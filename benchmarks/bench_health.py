"""Health propagation: from a backend's health event to FakeKubelet seeing the new device list.

* pushed: a ``HealthEvent`` yielded by ``watch()`` until the kubelet's view of that device
  flips (alternating Unhealthy/Healthy);
* path removed: a device file of the generic backend (``GenericPlugin``, ``/dev/h*`` under a
  temporary root) is deleted (then recreated) until the kubelet sees that device Unhealthy
  (Healthy again).

Each figure is given twice: until the kubelet *receives* the ListAndWatch message (the
plugin's share plus the transport) and until its view is updated (adds the fake kubelet's
bookkeeping, including its checkpoint write, as the real kubelet does). By default plugin and
kubelet share one event loop; ``--split`` runs the plugin in its own process, as on a node,
and pushes its health events through a pipe.

    python benchmarks/bench_health.py [--events 2000] [--split]
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from pathlib import Path

import _common
import anyio

from devplugin_sdk import Health
from devplugin_sdk.backends.generic import GenericPlugin
from devplugin_sdk.testing import StaticPlugin, serving

RESOURCE = "bench.example.com/dev"
FILES_RESOURCE = "bench.example.com/file"
DEVICES = 8


async def pushed(
    kubelet: _common.TimedKubelet, set_health: Callable[[str, Health], None], events: int
) -> tuple[list[float], list[float]]:
    """Return (event -> kubelet receives the message, event -> kubelet's view) samples."""
    received: list[float] = []
    seen: list[float] = []
    for i in range(events):
        device = f"d{i % DEVICES}"
        health = Health.UNHEALTHY if (i // DEVICES) % 2 == 0 else Health.HEALTHY
        count = kubelet.received
        started = time.perf_counter()
        set_health(device, health)
        arrived = await kubelet.wait_for_message(count)
        await kubelet.wait_for_health(RESOURCE, device, health.value)
        seen.append(time.perf_counter() - started)
        received.append(arrived - started)
    return received, seen


async def paths(
    kubelet: _common.TimedKubelet, dev: Path, events: int
) -> tuple[list[float], list[float], list[float]]:
    """Return (deleted -> received, deleted -> kubelet's view, created -> view) samples."""
    received: list[float] = []
    removed: list[float] = []
    added: list[float] = []
    for i in range(events):
        name = f"h{i % DEVICES}"
        path = dev / name
        count = kubelet.received
        started = time.perf_counter()
        path.unlink()
        arrived = await kubelet.wait_for_message(count)
        await kubelet.wait_for_health(FILES_RESOURCE, name, "Unhealthy")
        removed.append(time.perf_counter() - started)
        received.append(arrived - started)
        started = time.perf_counter()
        path.touch()
        await kubelet.wait_for_health(FILES_RESOURCE, name, "Healthy")
        added.append(time.perf_counter() - started)
    return received, removed, added


async def main() -> None:
    args_parser = _common.parser(__doc__ or "")
    args_parser.add_argument("--events", type=int, default=2000)
    args_parser.add_argument("--split", action="store_true", help="plugin in its own process")
    args = args_parser.parse_args()
    _common.print_header(
        "Health propagation",
        events=args.events,
        devices=DEVICES,
        plugin="own process" if args.split else "same event loop as FakeKubelet",
    )
    directory = Path(tempfile.mkdtemp(prefix="dpb-dev-"))
    read_end, write_end = os.pipe()
    try:
        dev = directory / "dev"
        dev.mkdir()
        for i in range(DEVICES):
            (dev / f"h{i}").touch()
        static = StaticPlugin(RESOURCE, _common.devices("d", DEVICES))
        kubelet = _common.TimedKubelet()
        async with kubelet:
            runner: AbstractAsyncContextManager[object]
            if args.split:
                runner = _common.plugin_process(
                    *("--dir", str(kubelet.directory), "--control-fd", str(read_end)),
                    *("--resource", f"{RESOURCE}={DEVICES}", "--kind", "static"),
                    *("--resource", FILES_RESOURCE, "--kind", "generic"),
                    *("--watch-dir", str(directory)),
                    pass_fds=[read_end],
                )

                def set_health(device: str, health: Health) -> None:
                    os.write(write_end, f"{device} {health.value}\n".encode())

            else:
                generic = GenericPlugin(FILES_RESOURCE, ["/dev/h*"], root=directory)
                runner = serving(static, generic, settings=kubelet.settings())

                def set_health(device: str, health: Health) -> None:
                    static.set_health(device, health, "bench")

            async with runner:
                await kubelet.wait_for_allocatable(RESOURCE, DEVICES, timeout=30)
                await kubelet.wait_for_allocatable(FILES_RESOURCE, DEVICES, timeout=30)
                received, seen = await pushed(kubelet, set_health, args.events)
                _common.report("pushed HealthEvent -> kubelet receives", received)
                push = _common.report("pushed HealthEvent -> kubelet's view", seen)
                arrived, removed, added = await paths(kubelet, dev, args.events // 4 or 1)
                _common.report("generic: path deleted -> kubelet receives", arrived)
                gone = _common.report("generic: path deleted -> kubelet's view", removed)
                _common.report("generic: path back -> kubelet's view", added)
    finally:
        os.close(read_end)
        os.close(write_end)
        shutil.rmtree(directory, ignore_errors=True)
    _common.target("pushed health propagation, median", push.p50 * 1e3, 2.0)
    _common.target("path-disappearing propagation, median", gone.p50 * 1e3, 2.0)


if __name__ == "__main__":
    anyio.run(main, backend="asyncio")
