"""Allocate latency through FakeKubelet, beside a bare grpc.aio unary call as the floor.

Four figures, each over ``--calls`` sequential calls after a warm-up, all on unix sockets:

* floor: a grpc.aio server whose Allocate returns a constant response (no SDK at all);
* sdk: the same client calling Allocate on an SDK plugin for one device;
* FakeKubelet.call_allocate: the same through FakeKubelet's own client (adds its conversion);
* FakeKubelet.allocate: the kubelet's whole admission (choice, Allocate, checkpoint write).

``--split`` runs the servers in a separate process, as a real kubelet and plugin are;
otherwise client and server share one event loop (both sides' costs add up).

    python benchmarks/bench_allocate.py [--calls 5000] [--split]
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import _common
import anyio
import grpc

from devplugin_sdk.api.deviceplugin.v1beta1 import deviceplugin_pb2 as pb
from devplugin_sdk.api.deviceplugin.v1beta1 import deviceplugin_pb2_grpc as pb_grpc
from devplugin_sdk.testing import FakeKubelet, StaticPlugin, serving

RESOURCE = "bench.example.com/dev"
DEVICES = 8


async def measure(call: Callable[[], Awaitable[object]], calls: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        await call()
    samples = []
    clock = time.perf_counter
    for _ in range(calls):
        started = clock()
        await call()
        samples.append(clock() - started)
    return samples


@asynccontextmanager
async def bare_server(directory: Path, split: bool) -> AsyncIterator[Path]:
    """A bare Allocate server on ``directory/bare.sock``, in this process or another."""
    path = directory / "bare.sock"
    if split:
        async with _common.plugin_process("--bare", str(path), wait_line=True):
            yield path
        return
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
                    )
                },
            )
        ]
    )
    server.add_insecure_port(f"unix:{path}")
    await server.start()
    try:
        yield path
    finally:
        await server.stop(0)


async def time_stub(path: Path, calls: int, warmup: int) -> list[float]:
    """Sequential Allocate calls for device d0 through a plain async stub."""
    request = pb.AllocateRequest(
        container_requests=[pb.ContainerAllocateRequest(devices_ids=["d0"])]
    )
    async with grpc.aio.insecure_channel(f"unix:{path}") as channel:
        stub = pb_grpc.DevicePluginStub(channel)
        return await measure(lambda: stub.Allocate(request), calls, warmup)


async def main() -> None:
    args_parser = _common.parser(__doc__ or "")
    args_parser.add_argument("--calls", type=int, default=5000)
    args_parser.add_argument("--warmup", type=int, default=200)
    args_parser.add_argument("--split", action="store_true", help="servers in another process")
    args = args_parser.parse_args()
    calls, warmup = args.calls, args.warmup
    _common.print_header(
        "Allocate latency",
        calls=calls,
        warmup=warmup,
        servers="other process" if args.split else "same event loop as the client",
        devices=DEVICES,
    )
    directory = Path(tempfile.mkdtemp(prefix="dpb-", dir="/tmp"))
    try:
        async with bare_server(directory, args.split) as path:
            floor = _common.report(
                "floor: bare grpc.aio Allocate", await time_stub(path, calls, warmup)
            )
    finally:
        shutil.rmtree(directory, ignore_errors=True)

    async with FakeKubelet() as kubelet:
        plugin = StaticPlugin(RESOURCE, _common.devices("d", DEVICES))
        runner = (
            _common.plugin_process(
                "--dir", str(kubelet.directory), "--resource", f"{RESOURCE}={DEVICES}"
            )
            if args.split
            else serving(plugin, settings=kubelet.settings())
        )
        async with runner:
            await kubelet.wait_for_allocatable(RESOURCE, DEVICES, timeout=30)
            socket_path = kubelet.directory / "bench.example.com_dev.sock"
            sdk = _common.report(
                "sdk: Allocate of one device", await time_stub(socket_path, calls, warmup)
            )
            _common.report(
                "FakeKubelet.call_allocate",
                await measure(lambda: kubelet.call_allocate(RESOURCE, ["d1"]), calls, warmup),
            )

            async def admit() -> None:
                got = await kubelet.allocate(RESOURCE, 1)
                kubelet.release(got)

            _common.report(
                "FakeKubelet.allocate (whole admission)",
                await measure(admit, max(calls // 5, 1), warmup // 5),
            )
    overhead = sdk.p50 - floor.p50
    print(f"sdk overhead over the floor at p50: {overhead * 1e3:.3f} ms")
    _common.target("Allocate p50 over the bare gRPC floor", overhead * 1e3, 0.3)


if __name__ == "__main__":
    anyio.run(main, backend="asyncio")
