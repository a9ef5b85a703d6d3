"""Allocate's transport and loop, side by side: which server runs one unary call fastest.

Each server runs in a process of its own and a blocking grpcio client in another process plays
the kubelet (one connection per server), calling Allocate in interleaved rounds so that every
variant sees the same load. The variants (``_transport_server.py``): grpc.aio on asyncio with
default options (the floor), with the SDK's options plus ``grpc.optimization_target=latency``
and ``grpc.max_concurrent_streams``, on uvloop, with a plain handler in grpc.aio's migration
thread pool, grpcio's threaded server, and the SDK itself on asyncio and on uvloop (each
registered with a FakeKubelet of its own in this process, which then stays idle).

    python benchmarks/bench_transport.py [--calls 5000] [--rounds 10] [--variants aio,sdk,...]
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from contextlib import AsyncExitStack
from pathlib import Path

import _common
import anyio

from devplugin_sdk.testing import FakeKubelet

HERE = Path(__file__).resolve().parent
RESOURCE = "bench.example.com/dev"
SOCKET = "bench.example.com_dev.sock"
VARIANTS = "aio,aio-options,aio-uvloop,aio-migration,threaded,sdk,sdk-uvloop"


async def start(stack: AsyncExitStack, variant: str, root: Path) -> Path:
    """Start ``variant``'s server; return its socket."""
    script = str(HERE / "_transport_server.py")
    if variant.startswith("sdk"):
        kubelet = await stack.enter_async_context(FakeKubelet(directory=root / variant))
        args = [script, variant, str(kubelet.directory), RESOURCE]
    else:
        args = [script, variant, str(root / f"{variant}.sock")]
    process = await anyio.open_process(
        [sys.executable, *args], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE
    )

    async def stop() -> None:
        with anyio.CancelScope(shield=True):
            if process.returncode is None:
                process.terminate()
            await process.wait()
            await process.aclose()

    stack.push_async_callback(stop)
    if variant.startswith("sdk"):
        await kubelet.wait_for_allocatable(RESOURCE, 8, timeout=30)
        return kubelet.directory / SOCKET
    assert process.stdout is not None
    buffered = b""
    while b"\n" not in buffered:
        buffered += await process.stdout.receive()
    return root / f"{variant}.sock"


async def main() -> None:
    args_parser = _common.parser(__doc__ or "")
    args_parser.add_argument("--calls", type=int, default=5000)
    args_parser.add_argument("--warmup", type=int, default=20, help="per variant per round")
    args_parser.add_argument("--rounds", type=int, default=10, help="interleaved batches")
    args_parser.add_argument("--variants", default=VARIANTS)
    args = args_parser.parse_args()
    variants = args.variants.split(",")
    _common.print_header(
        "Allocate: transport and loop",
        calls=args.calls,
        rounds=args.rounds,
        client="blocking grpcio stub in its own process, one connection per server",
        servers="one process each",
    )
    with tempfile.TemporaryDirectory(prefix="dpt-", dir="/tmp") as root:
        async with AsyncExitStack() as stack:
            sockets = {v: await start(stack, v, Path(root)) for v in variants}
            specs = [f"{v}={p}" for v, p in sockets.items()]
            result = await anyio.run_process(
                [
                    sys.executable,
                    str(HERE / "_transport_client.py"),
                    str(args.calls),
                    str(args.rounds),
                    str(args.warmup),
                    *specs,
                ],
                stderr=None,
            )
    samples: dict[str, list[float]] = json.loads(result.stdout)
    summaries = {v: _common.report(v, s) for v, s in samples.items()}
    if "aio" in summaries:
        floor = summaries["aio"].p50
        for variant, summary in summaries.items():
            print(f"{variant:>14}: p50 {(summary.p50 - floor) * 1e3:+.3f} ms over aio")
        if "sdk" in summaries:
            _common.target(
                "SDK overhead over a bare grpc.aio server, p50",
                (summaries["sdk"].p50 - floor) * 1e3,
                0.03,
            )


if __name__ == "__main__":
    anyio.run(main, backend="asyncio")
