"""Rolling upgrades under load: a DaemonSet's ``maxSurge: 1, maxUnavailable: 0`` update, N times.

Each upgrade starts the next pod's instance (its own pod UID, so sockets of its own names)
beside the running one, waits until the kubelet has registered it, then stops the old one as
SIGTERM does. All the while a steady stream of admissions runs: for the device plugin, a
container asking for one device (FakeKubelet's admission: Allocate on the resource's endpoint);
for DRA, a pod with a fresh ResourceClaim prepared and unprepared through the fake kubelet's DRA
manager. Printed: failed admissions (total, and the most in one upgrade), the longest gap
between two successful admissions per upgrade, and the handover (new instance started ->
registered, SIGTERM -> the old instance gone).

Kubelet behaviours: ``newest`` (device manager of v1.37, clients per socket; DRA manager of
1.33+, several plugins per driver) and ``old`` (device manager of v1.32 to v1.36, kubelet issue
#121994: the old stream's end tears down the new registration, which registers again by itself).

Both instances run in this event loop with FakeKubelet's test timings, except the two that bound
a re-registration on the old behaviour, which keep their production values (stream-lost grace
5 s, re-register delay 1.5 s): the figures show that the new instance does not wait for them.

    python benchmarks/bench_upgrade.py [--upgrades 100] [--api both|device-plugin|dra]
        [--kubelet newest|old|both] [--interval 0.002] [--registration kubelet|watcher]
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import _common
import anyio
import anyio.abc

from devplugin_sdk.kubelet.fake_dra import PodPreparationError
from devplugin_sdk.runner import Running
from devplugin_sdk.testing import AdmissionError, DaemonSetPod, DraNode, FakeKubelet, StaticPlugin

RESOURCE = "bench.example.com/dev"
DRIVER = "dev.bench.example.com"
DEVICES = 8
#: The production values of the settings that bound a re-registration (Settings' defaults).
PRODUCTION = {"stream_lost_grace": 5.0, "reregister_delay": 1.5}


@dataclass
class Load:
    """A paced stream of admissions, with when each succeeded and which failed."""

    admit: Callable[[int], Awaitable[None]]
    interval: float
    ok_at: list[float] = field(default_factory=list)
    failed_at: list[float] = field(default_factory=list)
    reasons: dict[str, int] = field(default_factory=dict)

    async def run(self) -> None:
        n = 0
        while True:
            n += 1
            try:
                await self.admit(n)
            except (AdmissionError, PodPreparationError) as exc:
                self.failed_at.append(time.perf_counter())
                reason = str(exc)[:90]
                self.reasons[reason] = self.reasons.get(reason, 0) + 1
            else:
                self.ok_at.append(time.perf_counter())
            await anyio.sleep(self.interval)  # pacing, not a wait for a condition

    def since(self, start: float) -> tuple[int, float]:
        """Failures since ``start``, and the longest gap between successes since then."""
        failed = sum(1 for t in self.failed_at if t >= start)
        times = [start, *(t for t in self.ok_at if t >= start)]
        gap = max((b - a for a, b in itertools.pairwise(times)), default=0.0)
        return failed, gap


@dataclass
class Figures:
    failed: list[int] = field(default_factory=list)
    gaps: list[float] = field(default_factory=list)
    to_registered: list[float] = field(default_factory=list)
    to_stopped: list[float] = field(default_factory=list)


async def device_plugin(
    upgrades: int, interval: float, *, newest: bool, watcher: bool
) -> tuple[Figures, Load]:
    figures = Figures()
    async with FakeKubelet(per_socket_clients=newest, plugin_watcher=watcher) as kubelet:

        async def admit(_n: int) -> None:
            kubelet.release(await kubelet.allocate(RESOURCE, 1))

        def instance() -> DaemonSetPod:
            plugin = StaticPlugin(RESOURCE, _common.devices("d", DEVICES))
            return DaemonSetPod(plugin, settings=kubelet.settings(**PRODUCTION))

        load = Load(admit, interval)
        async with anyio.create_task_group() as tg:
            old = instance()
            await old.start(tg)
            await kubelet.wait_for_allocatable(RESOURCE, DEVICES, timeout=30)
            tg.start_soon(load.run)
            for upgrade in range(upgrades):
                started = time.perf_counter()
                new = instance()
                running = await new.start(tg)

                # The DaemonSet stops the old pod once the new one is Ready (/healthz: registered,
                # and the kubelet's stream open).
                def ready(running: Running = running) -> bool:
                    return all(s.registered for s in running.statuses())

                await kubelet.wait_for(ready, timeout=30, what="the new instance ready")
                registered = time.perf_counter()
                await old.stop()
                stopped = time.perf_counter()
                old = new
                # Back to steady: the kubelet holds the new instance's devices, healthy.
                wanted = 0 if newest else 3 + 2 * upgrade

                def steady(wanted: int = wanted) -> bool:
                    return (
                        kubelet.is_registered(RESOURCE)
                        and kubelet.allocatable(RESOURCE) == DEVICES
                        and len(kubelet.successful_registrations(RESOURCE)) >= wanted
                    )

                await kubelet.wait_for(steady, timeout=30, what="the new instance holding them")
                await _successes(kubelet, load, 3)
                failed, gap = load.since(started)
                figures.failed.append(failed)
                figures.gaps.append(gap)
                figures.to_registered.append(registered - started)
                figures.to_stopped.append(stopped - registered)
            tg.cancel_scope.cancel()
    return figures, load


async def dra(upgrades: int, interval: float) -> tuple[Figures, Load]:
    figures = Figures()
    async with DraNode(driver=DRIVER) as node:
        kubelet, api = node.kubelet, node.api

        async def admit(n: int) -> None:
            name = f"claim-{n}"
            pod = node.pod(name, name=f"pod-{n}")
            node.claim(name, {"dev": [f"d{n % DEVICES}"]}, pods=[pod])
            try:
                await node.prepare(pod)
                await node.unprepare(pod)
            finally:
                api.delete_claim("default", name)

        def instance() -> DaemonSetPod:
            plugin = StaticPlugin(RESOURCE, _common.devices("d", DEVICES))
            settings = kubelet.settings(**PRODUCTION)
            return DaemonSetPod(plugin, settings=settings, api="dra", dra=node.options)

        def registrations() -> int:
            return len(kubelet.dra.successful_registrations(DRIVER))

        load = Load(admit, interval)
        async with anyio.create_task_group() as tg:
            old = instance()
            await old.start(tg)
            node.timeout = 30
            await node.ready()
            await kubelet.wait_for(lambda: registrations() == 1, timeout=30)
            tg.start_soon(load.run)
            for upgrade in range(upgrades):
                started = time.perf_counter()
                before = kubelet.dra.endpoint(DRIVER)
                new = instance()
                await new.start(tg)

                def connected(count: int = upgrade + 2, before: str | None = before) -> bool:
                    return registrations() == count and kubelet.dra.endpoint(DRIVER) != before

                await kubelet.wait_for(connected, timeout=30, what="the new instance connected")
                registered = time.perf_counter()
                await old.stop()
                stopped = time.perf_counter()
                old = new
                await _successes(kubelet, load, 3)
                failed, gap = load.since(started)
                figures.failed.append(failed)
                figures.gaps.append(gap)
                figures.to_registered.append(registered - started)
                figures.to_stopped.append(stopped - registered)
            tg.cancel_scope.cancel()
        print(
            f"slices after the last upgrade: pool complete = {api.pool_complete(DRIVER, 'node-1')}"
        )
    return figures, load


async def _successes(kubelet: FakeKubelet, load: Load, count: int) -> None:
    target = len(load.ok_at) + count
    try:
        await kubelet.wait_for(lambda: len(load.ok_at) >= target, timeout=30, what="admissions")
    except TimeoutError as exc:
        raise TimeoutError(f"{exc}; failures: {load.reasons}") from None


def show(title: str, figures: Figures, load: Load) -> None:
    print(f"\n== {title}")
    print(
        f"admissions: {len(load.ok_at)} ok, {len(load.failed_at)} failed over "
        f"{len(figures.failed)} upgrades (most in one upgrade: {max(figures.failed, default=0)})"
    )
    for reason, count in sorted(load.reasons.items(), key=lambda kv: -kv[1])[:3]:
        print(f"  {count} x {reason}")
    _common.report("longest gap between admissions, per upgrade", figures.gaps)
    _common.report("new instance start -> registered", figures.to_registered)
    _common.report("SIGTERM -> old instance gone", figures.to_stopped)


async def main() -> None:
    args_parser = _common.parser(__doc__ or "")
    args_parser.add_argument("--upgrades", type=int, default=100)
    args_parser.add_argument("--api", choices=("both", "device-plugin", "dra"), default="both")
    args_parser.add_argument("--kubelet", choices=("newest", "old", "both"), default="both")
    args_parser.add_argument("--interval", type=float, default=0.002, help="between admissions")
    args_parser.add_argument(
        "--registration",
        choices=("kubelet", "watcher"),
        default="kubelet",
        help="device plugins: kubelet.sock, or the plugin watcher (its reconciler's 1 s period "
        "is not modelled: a real kubelet adds up to 1 s to a re-registration there)",
    )
    args = args_parser.parse_args()
    _common.quiet_logs()
    _common.print_header(
        "Rolling upgrades under load",
        upgrades=args.upgrades,
        devices=DEVICES,
        interval=f"{args.interval * 1e3:g} ms between admissions",
        plugin="same event loop, FakeKubelet.settings() with production re-registration bounds",
    )
    behaviours = {"newest": [True], "old": [False], "both": [True, False]}[args.kubelet]
    if args.api in ("both", "device-plugin"):
        for newest in behaviours:
            watcher = args.registration == "watcher"
            figures, load = await device_plugin(
                args.upgrades, args.interval, newest=newest, watcher=watcher
            )
            kubelet = "v1.37 (newest)" if newest else "v1.32-v1.36 (#121994)"
            show(f"device plugin ({args.registration}), kubelet {kubelet}", figures, load)
            if newest:
                _common.target("failed admissions", len(load.failed_at), 1, unit="")
            else:
                # Failures only inside one re-registration window per upgrade.
                _common.target("longest gap (re-registration window)", max(figures.gaps) * 1e3, 200)
    if args.api in ("both", "dra"):
        figures, load = await dra(args.upgrades, args.interval)
        show("DRA, kubelet 1.33+ (newest)", figures, load)
        _common.target("failed prepares", len(load.failed_at), 1, unit="")


if __name__ == "__main__":
    anyio.run(main, backend="asyncio")
