"""Kubelet-restart recovery: from ``FakeKubelet.restart()`` to the resource being allocatable again.

A restart is the kubelet's: it disconnects every plugin, wipes the directory (the plugin's
socket with it) and serves a new ``kubelet.sock``. The plugin notices (inotify on the
directory), stops its old server, serves a new socket, registers, and sends its devices.
Two figures per restart: from the call to ``restart()`` (includes the fake kubelet's own
stop and start) and from the new ``kubelet.sock`` being served.

By default the plugin runs in its own process with production settings (``Settings()`` with
only the directory changed); ``--inproc`` serves it in this event loop instead.

    python benchmarks/bench_restart.py [--restarts 100] [--inproc]
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
    args = args_parser.parse_args()
    _common.print_header(
        "Kubelet-restart recovery",
        restarts=args.restarts,
        devices=DEVICES,
        plugin="same event loop, FakeKubelet.settings()"
        if args.inproc
        else "own process, production Settings()",
    )
    from_call: list[float] = []
    from_socket: list[float] = []
    kubelet_restart: list[float] = []
    async with FakeKubelet() as kubelet:
        runner: AbstractAsyncContextManager[object]
        if args.inproc:
            plugin = StaticPlugin(RESOURCE, _common.devices("d", DEVICES))
            runner = serving(plugin, settings=kubelet.settings())
        else:
            runner = _common.plugin_process(
                "--dir", str(kubelet.directory), "--resource", f"{RESOURCE}={DEVICES}"
            )
        async with runner:
            await kubelet.wait_for_allocatable(RESOURCE, DEVICES, timeout=30)
            for _ in range(args.restarts):
                started = time.perf_counter()
                await kubelet.restart()
                serving_again = time.perf_counter()
                await kubelet.wait_for_allocatable(RESOURCE, DEVICES, timeout=30)
                done = time.perf_counter()
                from_call.append(done - started)
                from_socket.append(done - serving_again)
                kubelet_restart.append(serving_again - started)
        registrations = len(kubelet.successful_registrations(RESOURCE))
    recovery = _common.report("restart() -> allocatable", from_call)
    _common.report("new kubelet.sock -> allocatable", from_socket)
    _common.report("(the fake kubelet's own stop + start)", kubelet_restart)
    print(f"registrations: {registrations} for {args.restarts} restarts (+1 at start)")
    _common.target("restart recovery, median", recovery.p50 * 1e3, 10.0)


if __name__ == "__main__":
    anyio.run(main, backend="asyncio")
