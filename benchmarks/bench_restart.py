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

``--resources N`` serves N resources from the one plugin process (independent registrations,
as a multi-resource backend has); a restart counts as recovered once every one is allocatable.

    python benchmarks/bench_restart.py [--restarts 100] [--resources 1] [--inproc]
"""

from __future__ import annotations

import time
from contextlib import AbstractAsyncContextManager

import _common
import anyio

from devplugin_sdk.testing import FakeKubelet, StaticPlugin, serving

RESOURCE = "bench.example.com/dev"
DEVICES = 8


async def main() -> None:
    args_parser = _common.parser(__doc__ or "")
    args_parser.add_argument("--restarts", type=int, default=100)
    args_parser.add_argument("--inproc", action="store_true", help="plugin in this event loop")
    args_parser.add_argument("--resources", type=int, default=1, help="resources in the process")
    args = args_parser.parse_args()
    names = [RESOURCE if i == 0 else f"{RESOURCE}{i}" for i in range(args.resources)]
    _common.print_header(
        "Kubelet-restart recovery",
        restarts=args.restarts,
        resources=args.resources,
        devices=f"{DEVICES} each",
        plugin="same event loop, FakeKubelet.settings()"
        if args.inproc
        else "own process, production Settings()",
    )
    from_call: list[float] = []
    from_socket: list[float] = []
    kubelet_restart: list[float] = []
    to_registers: list[float] = []
    registers_to_allocatable: list[float] = []
    async with FakeKubelet() as kubelet:
        runner: AbstractAsyncContextManager[object]
        if args.inproc:
            plugins = [StaticPlugin(n, _common.devices("d", DEVICES)) for n in names]
            runner = serving(*plugins, settings=kubelet.settings())
        else:
            resources = [a for n in names for a in ("--resource", f"{n}={DEVICES}")]
            runner = _common.plugin_process("--dir", str(kubelet.directory), *resources)
        async with runner:
            await all_allocatable(kubelet, names)
            for _ in range(args.restarts):
                calls = len(kubelet.registrations)
                started = time.perf_counter()
                await kubelet.restart()
                serving_again = time.perf_counter()
                socket_at = time.monotonic()  # the clock of Registration.at
                await all_allocatable(kubelet, names)
                done = time.perf_counter()
                done_at = time.monotonic()
                from_call.append(done - started)
                from_socket.append(done - serving_again)
                kubelet_restart.append(serving_again - started)
                last_register = max(r.at for r in kubelet.registrations[calls:])
                to_registers.append(last_register - socket_at)
                registers_to_allocatable.append(done_at - last_register)
        registrations = len(kubelet.successful_registrations(RESOURCE))
    _common.report("restart() -> allocatable", from_call)
    after = _common.report("new kubelet.sock -> allocatable", from_socket)
    _common.report("  until every Register reached the kubelet", to_registers)
    _common.report("  from the last Register to allocatable", registers_to_allocatable)
    _common.report("(the fake kubelet's own stop + start)", kubelet_restart)
    print(f"registrations: {registrations} for {args.restarts} restarts (+1 at start)")
    target_p50, target_max = (4.0, 10.0) if args.resources == 1 else (5.0, 10.0)
    _common.target("new kubelet.sock -> allocatable, median", after.p50 * 1e3, target_p50)
    _common.target("new kubelet.sock -> allocatable, max", after.maximum * 1e3, target_max)


async def all_allocatable(kubelet: FakeKubelet, names: list[str]) -> None:
    for name in names:
        await kubelet.wait_for_allocatable(name, DEVICES, timeout=30)


if __name__ == "__main__":
    anyio.run(main, backend="asyncio")
