"""GetPreferredAllocation for GPU memory units (sharing.memory), at the two sizes that matter.

The nvidia backend with ``sharing.memory`` runs on a fake NVML machine and answers
GetPreferredAllocation the way a node would: from the kubelet's ``available`` list alone. Two
configurations:

* GiB units on an A100x8 40 GiB node: 320 units;
* MiB units on the largest A100 40 GiB node whose list stays under the kubelet's 4 MiB limit
  with every unit Unhealthy (``--mib-gpus``, 2 by default: 81,920 units).

For each, ``--calls`` sequential calls with every unit available (random order, as the kubelet's
Go sets give them) asking for one container's share (``--share``, in GiB), and as many asking
for more than any GPU holds (the fewest-GPUs answer). Two timings per call:

* hook: ``NvmlPlugin.preferred_allocation`` alone (the placement);
* rpc: GetPreferredAllocation over the plugin's unix socket through grpc.aio, as the kubelet
  calls it (request decoding, the SDK's checks, the hook, the answer), client and plugin in one
  event loop.

    python benchmarks/bench_sharing.py [--calls 200] [--mib-gpus 2]
"""

from __future__ import annotations

import random
import shutil
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import _common
import anyio
import grpc

from devplugin_sdk.allocation import list_message_bytes
from devplugin_sdk.api.deviceplugin.v1beta1 import deviceplugin_pb2 as pb
from devplugin_sdk.api.deviceplugin.v1beta1 import deviceplugin_pb2_grpc as pb_grpc
from devplugin_sdk.backends.nvidia import NvmlPlugin
from devplugin_sdk.testing import FakeKubelet, fake_nvml, serving
from devplugin_sdk.testing.fake_nvml import FakeNVML
from devplugin_sdk.types import Health

RESOURCE = "nvidia.com/gpu-memory"


async def timed(call: Callable[[], Awaitable[object]], calls: int) -> list[float]:
    samples = []
    for _ in range(calls):
        started = time.perf_counter()
        await call()
        samples.append(time.perf_counter() - started)
    return samples


async def measure(label: str, nvml: FakeNVML, unit: str, share_gib: int, calls: int) -> None:
    root = Path(tempfile.mkdtemp(prefix="dps-", dir="/tmp"))
    try:
        roots = nvml.write_host(root / "host")
        config = {
            **roots.config(),
            "sharing": {"memory": {"unit": unit}},
            "health": {"probeInterval": 3600},
        }
        with nvml.installed():
            [plugin] = NvmlPlugin.from_config(config)
        async with FakeKubelet() as kubelet, serving(plugin, settings=kubelet.settings()):
            devices = list(await plugin.discover())
            await kubelet.wait_for_allocatable(RESOURCE, len(devices), timeout=60)
            per_gib = 1024 if unit == "MiB" else 1
            gpu_units = len(devices) // len(nvml.gpus)
            listed = list_message_bytes(devices)
            worst = list_message_bytes(devices, Health.UNHEALTHY)
            print(
                f"{label}: {len(devices):,} units of 1 {unit} on {len(nvml.gpus)} GPUs;"
                f" ListAndWatch message {listed:,} bytes, {worst:,} with every unit Unhealthy"
            )
            ids = [d.id for d in devices]
            random.Random(1).shuffle(ids)
            shuffled = {d.id: d for d in devices}
            available = [shuffled[i] for i in ids]
            path = kubelet.directory / plugin.effective_socket_name
            async with grpc.aio.insecure_channel(
                f"unix:{path}", options=[("grpc.max_send_message_length", -1)]
            ) as channel:
                stub = pb_grpc.DevicePluginStub(channel)
                for what, size in (
                    (f"{share_gib} GiB", share_gib * per_gib),
                    ("more than a GPU", gpu_units + per_gib),
                ):
                    request = pb.PreferredAllocationRequest(
                        container_requests=[
                            pb.ContainerPreferredAllocationRequest(
                                available_deviceIDs=ids, allocation_size=size
                            )
                        ]
                    )
                    print(f"  request for {what}: {request.ByteSize():,} bytes")

                    async def hook(size: int = size) -> object:
                        return await plugin.preferred_allocation(available, [], size)

                    async def rpc(request: pb.PreferredAllocationRequest = request) -> object:
                        return await stub.GetPreferredAllocation(request)

                    await timed(hook, 3)  # warm-up
                    await timed(rpc, 3)
                    _common.report(f"  hook, {what}", await timed(hook, calls))
                    _common.report(f"  rpc, {what}", await timed(rpc, calls))
    finally:
        shutil.rmtree(root, ignore_errors=True)


async def main() -> None:
    args_parser = _common.parser(__doc__ or "")
    args_parser.add_argument("--calls", type=int, default=200)
    args_parser.add_argument("--mib-calls", type=int, default=50)
    args_parser.add_argument("--mib-gpus", type=int, default=2, help="A100 40 GiB GPUs in MiB")
    args_parser.add_argument("--share", type=int, default=10, help="GiB one container asks")
    args = args_parser.parse_args()
    _common.print_header(
        "GetPreferredAllocation of GPU memory units",
        calls=args.calls,
        mib_calls=args.mib_calls,
        mib_gpus=args.mib_gpus,
        share=f"{args.share} GiB",
        client="same event loop as the plugin",
    )
    await measure("GiB, A100x8 40 GiB", fake_nvml.dgx_a100_40gb(), "GiB", args.share, args.calls)
    gpus = fake_nvml.dgx_a100_40gb().gpus[: args.mib_gpus]
    await measure(
        f"MiB, A100x{args.mib_gpus} 40 GiB", FakeNVML(gpus), "MiB", args.share, args.mib_calls
    )


if __name__ == "__main__":
    anyio.run(main, backend="asyncio")
