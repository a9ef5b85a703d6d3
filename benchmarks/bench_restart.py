"""Kubelet-restart recovery: from ``FakeKubelet.restart()`` to the resource being allocatable again.

A restart is the kubelet's: it disconnects every plugin, wipes the directory (the plugin's
socket with it) and serves a new ``kubelet.sock``. The plugin notices (inotify on the
directory), stops its old server, serves a new socket, registers, and sends its devices.
Two figures per restart: from the call to ``restart()`` (includes the fake kubelet's own
stop and start) and from the new ``kubelet.sock`` being served. The second is then split where
the plugin hands over to the kubelet: until the kubelet's Register handler has been entered for
every resource (the plugin's notice, rename and Register calls, and the connection), and from
there to allocatable (the kubelet's dial-back, GetDevicePluginOptions and ListAndWatch, with
the plugin answering them; in the fake kubelet, Python handlers on the same cores).

By default the plugin runs in its own process with production settings (``Settings()`` with
only the directory changed); ``--inproc`` serves it in this event loop instead.

``--resources 1,3,8`` runs one series per count, side by side in one run: a fake kubelet and a
plugin process serving that many resources (independent registrations, as a multi-resource
backend has) per series, their restarts interleaved; a restart counts as recovered once every
resource is allocatable. ``--trace`` stamps each resource's path on both sides (the plugin's
Register call and return, the dial-back, its stream and first list; the fake kubelet's Register
handler, dial-back and first list received) and prints each phase's median from the new
``kubelet.sock``.

    python benchmarks/bench_restart.py [--restarts 100] [--resources 1,3] [--inproc] [--trace]
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections import defaultdict
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path

import _common
import anyio

from devplugin_sdk.kubelet.fake import _device_manager
from devplugin_sdk.testing import FakeKubelet, KubeletDevice, StaticPlugin, serving

RESOURCE = "bench.example.com/dev"
DEVICES = 8

#: Stamps of the fake kubelet's side, ``(time.monotonic(), resource, event)``, all series.
KUBELET_STAMPS: list[tuple[float, str, str]] = []


@dataclass
class Series:
    """One resource count: its kubelet, its resources and its figures."""

    count: int
    names: list[str]
    kubelet: FakeKubelet
    trace: Path | None = None
    from_call: list[float] = field(default_factory=list)
    from_socket: list[float] = field(default_factory=list)
    kubelet_restart: list[float] = field(default_factory=list)
    to_registers: list[float] = field(default_factory=list)
    registers_to_allocatable: list[float] = field(default_factory=list)
    socket_times: list[tuple[float, float]] = field(default_factory=list)  # (served, done)


def _trace_kubelet() -> None:
    """Stamp the fake kubelet's dial-back (start and end, options included)."""
    connect = _device_manager.DeviceManager.connect

    async def traced(self: _device_manager.DeviceManager, resource: str, path: Path) -> str | None:
        KUBELET_STAMPS.append((time.monotonic(), resource, "kubelet: dial-back starts"))
        try:
            return await connect(self, resource, path)
        finally:
            KUBELET_STAMPS.append((time.monotonic(), resource, "kubelet: connected, options"))

    _device_manager.DeviceManager.connect = traced  # type: ignore[method-assign]


def _on_list(resource: str, devices: tuple[KubeletDevice, ...]) -> None:
    KUBELET_STAMPS.append((time.monotonic(), resource, "kubelet: list received"))


async def main() -> None:
    args_parser = _common.parser(__doc__ or "")
    args_parser.add_argument("--restarts", type=int, default=100)
    args_parser.add_argument("--inproc", action="store_true", help="plugin in this event loop")
    args_parser.add_argument(
        "--resources", default="1", help="resources in the process; a comma list runs each"
    )
    args_parser.add_argument("--trace", action="store_true", help="print where the time goes")
    args = args_parser.parse_args()
    counts = [int(c) for c in args.resources.split(",")]
    _common.print_header(
        "Kubelet-restart recovery",
        restarts=args.restarts,
        resources=args.resources,
        devices=f"{DEVICES} each",
        plugin="same event loop, FakeKubelet.settings()"
        if args.inproc
        else "own process, production Settings()",
        order="series interleaved, one restart each in turn",
    )
    if args.trace:
        _trace_kubelet()
    all_series: list[Series] = []
    with tempfile.TemporaryDirectory(prefix="dpb-trace-") as traces:
        async with AsyncExitStack() as stack:
            for count in counts:
                names = [RESOURCE if i == 0 else f"{RESOURCE}{i}" for i in range(count)]
                kubelet = await stack.enter_async_context(
                    FakeKubelet(on_list=_on_list if args.trace else None)
                )
                series = Series(count, names, kubelet)
                if args.inproc:
                    plugins = [StaticPlugin(n, _common.devices("d", DEVICES)) for n in names]
                    await stack.enter_async_context(serving(*plugins, settings=kubelet.settings()))
                else:
                    resources = [a for n in names for a in ("--resource", f"{n}={DEVICES}")]
                    extra: list[str] = []
                    if args.trace and not args.inproc:
                        series.trace = Path(traces) / f"plugin-{count}.txt"
                        extra = ["--trace", str(series.trace)]
                    await stack.enter_async_context(
                        _common.plugin_process("--dir", str(kubelet.directory), *resources, *extra)
                    )
                await all_allocatable(kubelet, names)
                all_series.append(series)
            for _ in range(args.restarts):
                for series in all_series:
                    await restart_once(series)
        # The plugin processes have exited: their traces are written.
        for series in all_series:
            report_series(series, args.trace)


async def restart_once(series: Series) -> None:
    kubelet = series.kubelet
    calls = len(kubelet.registrations)
    started = time.perf_counter()
    await kubelet.restart()
    serving_again = time.perf_counter()
    socket_at = time.monotonic()  # the clock of Registration.at
    await all_allocatable(kubelet, series.names)
    done = time.perf_counter()
    done_at = time.monotonic()
    series.from_call.append(done - started)
    series.from_socket.append(done - serving_again)
    series.kubelet_restart.append(serving_again - started)
    last_register = max(r.at for r in kubelet.registrations[calls:])
    series.to_registers.append(last_register - socket_at)
    series.registers_to_allocatable.append(done_at - last_register)
    series.socket_times.append((socket_at, done_at))
    await anyio.sleep(0.02)  # let the plugin stop its old servers before the next series


def report_series(series: Series, trace: bool) -> None:
    print(f"-- {series.count} resource(s) in one process")
    _common.report("restart() -> allocatable", series.from_call)
    after = _common.report("new kubelet.sock -> allocatable", series.from_socket)
    _common.report("  until every Register reached the kubelet", series.to_registers)
    _common.report("  from the last Register to allocatable", series.registers_to_allocatable)
    _common.report("(the fake kubelet's own stop + start)", series.kubelet_restart)
    registrations = len(series.kubelet.successful_registrations(RESOURCE))
    print(f"registrations: {registrations} for {len(series.from_call)} restarts (+1 at start)")
    if trace:
        report_trace(series)
    target_p50, target_max = (4.0, 10.0) if series.count == 1 else (5.0, 10.0)
    _common.target("new kubelet.sock -> allocatable, median", after.p50 * 1e3, target_p50)
    _common.target("new kubelet.sock -> allocatable, max", after.maximum * 1e3, target_max)


def report_trace(series: Series) -> None:
    """Each event's median time after the new kubelet.sock, per resource (first of each kind
    inside the restart's window), the plugin's stamps and the kubelet's merged."""
    stamps = list(KUBELET_STAMPS)
    if series.trace is not None and series.trace.exists():
        for line in series.trace.read_text().splitlines():
            text, who, what = line.split(" ", 2)
            stamps.append((float(text), who, "plugin: " + what))
    stamps.sort()
    names = set(series.names)
    offsets: dict[tuple[str, int], list[float]] = defaultdict(list)
    for socket_at, done_at in series.socket_times:
        seen: set[tuple[str, str]] = set()
        for at, resource, event in stamps:
            if at < socket_at or at > done_at or (resource not in names and resource != "-"):
                continue
            if (resource, event) in seen:
                continue
            seen.add((resource, event))
            index = series.names.index(resource) if resource in names else -1
            offsets[(event, index)].append((at - socket_at) * 1e3)
    print("   trace, ms after the new kubelet.sock (median of restarts; resource index)")
    rows = sorted(offsets.items(), key=lambda kv: statistics.median(kv[1]))
    for (event, index), values in rows:
        who = "all" if index < 0 else str(index)
        print(f"   {statistics.median(values):7.3f}  [{who}] {event} (n={len(values)})")


async def all_allocatable(kubelet: FakeKubelet, names: list[str]) -> None:
    for name in names:
        await kubelet.wait_for_allocatable(name, DEVICES, timeout=30)


if __name__ == "__main__":
    anyio.run(main, backend="asyncio")
