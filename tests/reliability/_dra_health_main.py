"""A DRA node in a process of its own, for the health-stream load tests (issue 36, rows 11, 12, 26).

    python _dra_health_main.py --devices N [--flips-per-s F] [--flap-for S] [--prepares]

It runs ``DraNode`` (the driver, the fake kubelet following its health stream, the in-memory
API) serving ``--devices`` widgets ``w0..``, prints ``socket PATH`` (the driver's ``dra.sock``)
once ready, then waits for SIGUSR1: on it, devices ``w0..`` flip health round-robin at
``--flips-per-s`` for ``--flap-for`` seconds while, with ``--prepares``, a pod after pod has a
one-device claim (on the last widget, which never flips) prepared and unprepared through the
kubelet. A flip is the plugin's health event, through the pool (rebuilt once per batch of
events since rows 13 and 14) to the health board and its streams. It then prints
``prepares COUNT P50_MS P99_MS`` and ``flapping ended``, and serves on until SIGTERM. Tests read its RSS from ``/proc`` and open their own streams on the socket.
"""

from __future__ import annotations

import argparse
import logging
import signal
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the shared helpers

from dra_helpers import DRIVER
from sdk_helpers import RESOURCE, widgets

from devplugin_sdk import Health
from devplugin_sdk.testing import DraNode, StaticPlugin

Flip = Callable[[str, bool], None]


def _through_the_plugin(plugin: StaticPlugin) -> Flip:
    def flip(name: str, down: bool) -> None:
        plugin.set_health(name, Health.UNHEALTHY if down else Health.HEALTHY, "flapping")

    return flip


async def _flap(flip: Flip, devices: int, rate: float, seconds: float) -> None:
    """Flip ``w0..w{devices-2}`` round-robin, ``rate`` flips a second, for ``seconds``."""
    flips = 0
    started = time.monotonic()
    with anyio.move_on_after(seconds):
        while True:
            flip(f"w{flips % (devices - 1)}", (flips // (devices - 1)) % 2 == 0)
            flips += 1
            # The flips' own schedule (a load generator's clock, not a wait for an event).
            await anyio.sleep(max(0.0, started + flips / rate - time.monotonic()))


async def _prepares(node: DraNode, devices: int, seconds: float) -> list[float]:
    """Prepare and unprepare one pod after another for ``seconds``; each prepare's time."""
    took: list[float] = []
    with anyio.move_on_after(seconds):
        while True:
            name = f"c{len(took)}"
            pod = node.pod(name)
            node.claim(name, [f"w{devices - 1}"], pods=[pod])
            started = time.perf_counter()
            await node.prepare(pod)
            took.append(time.perf_counter() - started)
            await node.unprepare(pod)
            node.api.delete_claim("default", name)
    return took


async def _main(args: argparse.Namespace) -> None:
    plugin = StaticPlugin(RESOURCE, widgets(args.devices))
    async with DraNode(
        plugin, driver=DRIVER, timeout=60, health_timeout=args.health_timeout
    ) as node:
        with anyio.open_signal_receiver(signal.SIGUSR1, signal.SIGTERM) as signals:
            print(f"socket {node.options.resolved_plugin_dir / 'dra.sock'}", flush=True)
            async for signum in signals:
                if signum == signal.SIGTERM:
                    return
                took: list[float] = []
                cpu = time.process_time()
                async with anyio.create_task_group() as tg:
                    flip = _through_the_plugin(plugin)
                    tg.start_soon(_flap, flip, args.devices, args.flips_per_s, args.flap_for)
                    if args.prepares:
                        took = await _prepares(node, args.devices, args.flap_for)
                ms = sorted(t * 1000 for t in took) or [0.0]
                p99 = ms[min(len(ms) - 1, int(len(ms) * 0.99))]
                print(f"prepares {len(took)} {statistics.median(ms):.2f} {p99:.2f}", flush=True)
                cpu = (time.process_time() - cpu) / args.flap_for
                print(f"cpu {cpu:.2f}", flush=True)  # of a core, over the load
                print(f"streams {node.status.health_streams}", flush=True)
                print("flapping ended", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--devices", type=int, default=50)
    parser.add_argument("--flips-per-s", type=float, default=30.0)
    parser.add_argument("--flap-for", type=float, default=5.0)
    parser.add_argument("--prepares", action="store_true")
    parser.add_argument("--health-timeout", type=int, default=30)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    anyio.run(_main, args)


if __name__ == "__main__":
    main()
