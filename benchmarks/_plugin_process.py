"""A plugin process for the benchmarks that need the plugin outside the measuring process.

``--resource NAME=COUNT`` (repeatable) serves one plugin per resource with production
settings, pointed at ``--dir``. ``--kind`` picks what each plugin does between RPCs: ``static``
(pushed health only: idle until an event), ``polled`` (``check_health`` every
``Settings.health_interval``) or ``generic`` (the generic backend: ``<watch-dir>/dev/h*``
files, followed with fswatch).
``--bare SOCKET`` instead serves bare grpc.aio floors (Allocate, ListAndWatch), and
``--observe SOCKET`` is a raw ListAndWatch client printing each message's arrival time.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import tempfile
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path

import _common
import _trace
import anyio
import grpc
from _common import devices

from devplugin_sdk import (
    Device,
    DevicePlugin,
    Health,
    HealthEvent,
    Settings,
    run,
)
from devplugin_sdk.api.deviceplugin.v1beta1 import deviceplugin_pb2 as pb
from devplugin_sdk.backends.generic import GenericPlugin
from devplugin_sdk.testing import StaticPlugin
from devplugin_sdk.types import RescanEvent


class PolledPlugin(DevicePlugin):
    """Health polled through ``check_health`` at the production interval."""

    def __init__(self, resource_name: str, count: int) -> None:
        super().__init__(resource_name=resource_name)
        self._devices = devices("p", count)

    async def discover(self) -> Sequence[Device]:
        return self._devices

    async def check_health(self, devices: Sequence[Device]) -> Mapping[str, Health]:
        return {d.id: Health.HEALTHY for d in devices}


class ControlledPlugin(StaticPlugin):
    """A static plugin whose health events come from lines ``<id> <health>`` on a pipe."""

    def __init__(self, resource_name: str, count: int, control_fd: int) -> None:
        super().__init__(resource_name, devices("d", count))
        self._fd = control_fd
        os.set_blocking(control_fd, False)

    async def watch(self) -> AsyncIterator[HealthEvent | RescanEvent]:
        pending = b""
        while True:
            await anyio.wait_readable(self._fd)
            data = os.read(self._fd, 65536)
            if not data:
                return
            pending += data
            *lines, pending = pending.split(b"\n")
            for line in lines:
                device_id, health = line.decode().split()
                yield HealthEvent(device_id, Health(health), "control pipe")


async def serve_bare(path: Path, stream_bytes: int, control_fd: int | None) -> None:
    """Serve grpc.aio alone, as floors: Allocate with a constant response, and ListAndWatch
    sending ``stream_bytes`` bytes at once and again for every line read from ``control_fd``.
    """
    lines = asyncio.Queue[None]()
    if control_fd is not None:
        os.set_blocking(control_fd, False)

        def readable() -> None:
            for _ in range(os.read(control_fd, 65536).count(b"\n")):
                lines.put_nowait(None)

        asyncio.get_running_loop().add_reader(control_fd, readable)

    async def list_and_watch(request: pb.Empty, context: object) -> AsyncIterator[bytes]:
        payload = bytearray(stream_bytes)
        while True:
            payload[-1] ^= 1  # a new message each time, as a flip makes
            yield bytes(payload)
            await lines.get()

    response = pb.AllocateResponse(
        container_responses=[
            pb.ContainerAllocateResponse(
                devices=[pb.DeviceSpec(container_path="/dev/d0", host_path="/dev/d0")]
            )
        ]
    )

    async def allocate(request: pb.AllocateRequest, context: object) -> pb.AllocateResponse:
        return response

    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        [
            grpc.method_handlers_generic_handler(
                "v1beta1.DevicePlugin",
                {
                    "Allocate": grpc.unary_unary_rpc_method_handler(
                        allocate,
                        request_deserializer=pb.AllocateRequest.FromString,
                        response_serializer=pb.AllocateResponse.SerializeToString,
                    ),
                    "ListAndWatch": grpc.unary_stream_rpc_method_handler(
                        list_and_watch,
                        request_deserializer=pb.Empty.FromString,
                        response_serializer=bytes,
                    ),
                },
            )
        ]
    )
    server.add_insecure_port(f"unix:{path}")
    await server.start()
    print("ready", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await server.stop(0)


def observe(path: Path) -> None:
    """Print ``<monotonic time> <bytes>`` for each ListAndWatch message, unparsed."""
    with grpc.insecure_channel(f"unix:{path}") as channel:
        stream: grpc.UnaryStreamMultiCallable[pb.Empty, bytes] = channel.unary_stream(
            "/v1beta1.DevicePlugin/ListAndWatch",
            request_serializer=pb.Empty.SerializeToString,
            response_deserializer=None,
        )
        try:
            for message in stream(pb.Empty()):
                print(f"{time.monotonic():.9f} {len(message)}", flush=True)
        except grpc.RpcError:
            pass  # the plugin went away


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dir", type=Path, help="the device-plugin directory")
    parser.add_argument("--resource", action="append", default=[], help="NAME=COUNT")
    parser.add_argument("--kind", action="append", default=[], help="static|polled|generic")
    parser.add_argument("--bare", type=Path, help="serve bare gRPC floors on this socket")
    parser.add_argument("--stream-bytes", type=int, default=1, help="--bare ListAndWatch size")
    parser.add_argument("--observe", type=Path, help="time ListAndWatch messages on this socket")
    parser.add_argument("--control-fd", type=int, help="static plugins read health from this fd")
    parser.add_argument("--watch-dir", type=Path, help="root of the generic plugin's /dev")
    parser.add_argument("--trace", type=Path, help="write registration timestamps here at exit")
    args = parser.parse_args()
    _common.quiet_logs()
    if args.trace is not None:
        _trace.install(args.trace)
    if args.observe is not None:
        observe(args.observe)
        return
    if args.bare is not None:
        asyncio.run(serve_bare(args.bare, args.stream_bytes, args.control_fd))
        return
    plugins: list[DevicePlugin] = []
    own_dir = args.watch_dir is None
    watched = Path(tempfile.mkdtemp(prefix="dpb-dev-")) if own_dir else args.watch_dir
    for index, spec in enumerate(args.resource):
        name, _, count_text = spec.partition("=")
        count = int(count_text or "4")
        kind = args.kind[index] if index < len(args.kind) else "static"
        if kind == "polled":
            plugins.append(PolledPlugin(name, count))
        elif kind == "generic":
            if own_dir:
                (watched / "dev").mkdir(exist_ok=True)
                for i in range(count):
                    (watched / "dev" / f"h{i}").touch()
            plugins.append(GenericPlugin(name, ["/dev/h*"], root=watched))
        elif args.control_fd is not None:
            plugins.append(ControlledPlugin(name, count, args.control_fd))
        else:
            plugins.append(StaticPlugin(name, devices("d", count)))
    try:
        run(*plugins, settings=Settings(device_plugin_dir=args.dir))
    finally:
        if own_dir:
            shutil.rmtree(watched, ignore_errors=True)


if __name__ == "__main__":
    main()
