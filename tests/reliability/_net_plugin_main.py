"""A plugin process for the network-fault tests: a static SDK plugin served with HTTP endpoints.

    python _net_plugin_main.py --dir DIR [--registry-dir DIR] [--count N] [--id-width W]
        [--stuck-after S] [--flap SECONDS --flap-for SECONDS] [--nofile N] [--umask OCT]

It serves ``--count`` devices ``d0..`` (IDs padded to ``--id-width`` characters) with the test
speed settings of ``FakeKubelet.settings()`` and the runner's HTTP endpoints on a free loopback
port, which it prints as ``http-port N`` once serving; logs go to stderr in the text format of
``devplugin run``. It stops on SIGTERM/SIGINT, as ``devplugin_sdk.run`` does. ``--nofile`` and
``--umask`` are applied first, as a container runtime or an operator's shell would. SIGUSR1 makes
device ``d0`` flap (Unhealthy, Healthy, ...) every ``--flap`` seconds for ``--flap-for`` seconds.
SIGUSR2 makes the process open file descriptors until it has none left (a backend leaking them)
and hold them for ``--hog-for`` seconds; it prints ``hogging N fds`` and then ``released fds``.
"""

from __future__ import annotations

import argparse
import os
import resource
import signal
from collections.abc import AsyncIterator
from functools import partial
from pathlib import Path

import anyio
from prometheus_client import CollectorRegistry

from devplugin_sdk import Device, DeviceNode, Health, HealthEvent, RescanEvent, Settings
from devplugin_sdk._logging import configure_logging
from devplugin_sdk.runner import Http, serve
from devplugin_sdk.testing import StaticPlugin


class FlappingPlugin(StaticPlugin):
    """Static devices; on SIGUSR1, device ``d0`` flaps for a while (pushed health events)."""

    def __init__(self, resource_name: str, devices: list[Device], flap: float, flap_for: float):
        super().__init__(resource_name, devices)
        self.flapping = devices[0].id
        self.flap = flap
        self.flap_for = flap_for

    async def watch(self) -> AsyncIterator[HealthEvent | RescanEvent]:
        with anyio.open_signal_receiver(signal.SIGUSR1) as signals:
            async for _ in signals:
                health = Health.HEALTHY
                with anyio.move_on_after(self.flap_for):
                    while True:
                        health = Health.UNHEALTHY if health is Health.HEALTHY else Health.HEALTHY
                        yield HealthEvent(self.flapping, health, "flapping")
                        await anyio.sleep(self.flap)
                yield HealthEvent(self.flapping, Health.HEALTHY, "flapping ended")
                print("flapping ended", flush=True)


async def _hog_fds_on_sigusr2(hold: float) -> None:
    with anyio.open_signal_receiver(signal.SIGUSR2) as signals:
        async for _ in signals:
            hogged: list[int] = []
            try:
                while True:
                    hogged.append(os.open(os.devnull, os.O_RDONLY))
            except OSError:
                pass  # EMFILE: none left
            print(f"hogging {len(hogged)} fds", flush=True)
            await anyio.sleep(hold)
            for fd in hogged:
                os.close(fd)
            print("released fds", flush=True)


async def _cancel_on_signal(scope: anyio.CancelScope) -> None:
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for _ in signals:
            scope.cancel()
            return


async def _main(args: argparse.Namespace) -> None:
    devices = [
        Device(f"d{i}".ljust(args.id_width, "x"), device_nodes=(DeviceNode(f"/dev/d{i}"),))
        for i in range(args.count)
    ]
    plugin = FlappingPlugin(args.resource, devices, args.flap, args.flap_for)
    settings = Settings(
        device_plugin_dir=args.dir,
        plugins_registry_dir=args.registry_dir or args.dir.parent / "plugins_registry",
        registration="watcher" if args.registry_dir else "kubelet",
        register_timeout=15.0,
        register_backoff_initial=0.02,
        register_backoff_max=0.5,
        restart_poll_interval=0.5,
        stream_lost_grace=1.0,
        reregister_delay=0.2,
        health_interval=0.5,
        stop_grace=1.0,
    )
    http = Http(
        port=0, host="127.0.0.1", stuck_after=args.stuck_after, registry=CollectorRegistry()
    )
    async with anyio.create_task_group() as tg:
        tg.start_soon(_cancel_on_signal, tg.cancel_scope)
        tg.start_soon(_hog_fds_on_sigusr2, args.hog_for)
        running = await tg.start(partial(serve, plugin, settings=settings, http=http))
        print(f"http-port {running.http_port}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--registry-dir", type=Path, default=None)
    parser.add_argument("--resource", default="reliability.example.com/dev")
    parser.add_argument("--count", type=int, default=4)
    parser.add_argument("--id-width", type=int, default=0)
    parser.add_argument("--stuck-after", type=float, default=30.0)
    parser.add_argument("--flap", type=float, default=0.02)
    parser.add_argument("--flap-for", type=float, default=3.0)
    parser.add_argument("--hog-for", type=float, default=3.0)
    parser.add_argument("--nofile", type=int, default=None)
    parser.add_argument("--umask", type=lambda text: int(text, 8), default=None)
    args = parser.parse_args()
    if args.nofile is not None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (args.nofile, args.nofile))
    if args.umask is not None:
        os.umask(args.umask)
    configure_logging("info", "text")
    anyio.run(_main, args, backend="asyncio")


if __name__ == "__main__":
    main()
