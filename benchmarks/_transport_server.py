"""One Allocate server for ``bench_transport.py``, in a process of its own: ``VARIANT SOCKET``.

Variants (each answers Allocate with the same constant response; none is the SDK):

* ``aio``: grpc.aio on asyncio, default options (the floor of ``bench_allocate --split``);
* ``aio-options``: grpc.aio with the SDK's server options plus ``grpc.optimization_target``
  ``latency`` and ``grpc.max_concurrent_streams`` 16;
* ``aio-uvloop``: grpc.aio on uvloop (``pip install uvloop``);
* ``aio-migration``: grpc.aio with a plain (non-async) Allocate handler, which grpc.aio runs in
  its ``migration_thread_pool``: the threaded unary path and the asyncio streams on one server;
* ``threaded``: grpcio's threaded server (``grpc.server`` with a thread pool);
* ``sdk`` / ``sdk-uvloop``: the SDK serving a static plugin (``--dir`` is the socket's
  directory), on asyncio or uvloop.

Prints ``ready`` once it serves, and runs until SIGTERM.
"""

from __future__ import annotations

import asyncio
import importlib
import signal
import sys
import threading
from concurrent import futures
from pathlib import Path

import _common
import anyio
import grpc

from devplugin_sdk import Settings, serve
from devplugin_sdk._wire import server as _server
from devplugin_sdk.api.deviceplugin.v1beta1 import deviceplugin_pb2 as pb
from devplugin_sdk.testing import StaticPlugin

RESPONSE = pb.AllocateResponse(
    container_responses=[
        pb.ContainerAllocateResponse(
            devices=[pb.DeviceSpec(container_path="/dev/d0", host_path="/dev/d0")]
        )
    ]
)


def handlers(sync: bool) -> list[grpc.GenericRpcHandler]:
    async def allocate(request: pb.AllocateRequest, context: object) -> pb.AllocateResponse:
        return RESPONSE

    def allocate_sync(request: pb.AllocateRequest, context: object) -> pb.AllocateResponse:
        return RESPONSE

    return [
        grpc.method_handlers_generic_handler(
            "v1beta1.DevicePlugin",
            {
                "Allocate": grpc.unary_unary_rpc_method_handler(
                    allocate_sync if sync else allocate,
                    request_deserializer=pb.AllocateRequest.FromString,
                    response_serializer=pb.AllocateResponse.SerializeToString,
                )
            },
        )
    ]


async def serve_aio(path: Path, variant: str) -> None:
    options: list[tuple[str, object]] = []
    pool = None
    if variant == "aio-options":
        options = [
            *_server._SERVER_OPTIONS,
            ("grpc.optimization_target", "latency"),
            ("grpc.max_concurrent_streams", 16),
        ]
    if variant == "aio-migration":
        pool = futures.ThreadPoolExecutor(max_workers=4)
    server = grpc.aio.server(migration_thread_pool=pool, options=options)
    server.add_generic_rpc_handlers(handlers(sync=variant == "aio-migration"))
    server.add_insecure_port(f"unix:{path}")
    await server.start()
    print("ready", flush=True)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await server.stop(0)


def serve_threaded(path: Path) -> None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    server.add_generic_rpc_handlers(handlers(sync=True))
    server.add_insecure_port(f"unix:{path}")
    server.start()
    print("ready", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    stop.wait()
    server.stop(0)


async def serve_sdk(directory: Path, resource: str) -> None:
    plugin = StaticPlugin(resource, _common.devices("d", 8))
    async with anyio.create_task_group() as tg:

        async def on_term() -> None:
            with anyio.open_signal_receiver(signal.SIGTERM) as signals:
                async for _ in signals:
                    tg.cancel_scope.cancel()

        tg.start_soon(on_term)
        await serve(plugin, settings=Settings(device_plugin_dir=directory))


def main() -> None:
    variant, target = sys.argv[1], Path(sys.argv[2])
    _common.quiet_logs()
    if variant == "threaded":
        serve_threaded(target)
    elif variant in ("sdk", "sdk-uvloop"):
        anyio.run(
            serve_sdk,
            target,
            sys.argv[3],
            backend="asyncio",
            backend_options={"use_uvloop": variant == "sdk-uvloop"},
        )
    elif variant == "aio-uvloop":
        uvloop = importlib.import_module("uvloop")  # not a dependency: pip install uvloop
        uvloop.run(serve_aio(target, variant))
    else:
        asyncio.run(serve_aio(target, variant))


if __name__ == "__main__":
    main()
