"""Scale: 1k, 10k and 50k devices on one resource.

For each size:

* initial ListAndWatch (plugin and FakeKubelet in one event loop): from starting to serve
  (encoding every device, socket, Register) until the kubelet receives the full list, and
  until its view holds every device;
* one health flip (plugin in its own process with production settings, events through a
  pipe): from writing the event until a raw ListAndWatch client in a third process receives
  the new list (the SDK re-encodes one entry and joins the cached rest: the plugin's share plus the
  transport), and until the fake kubelet's view changed (adds its parsing of every device
  and its checkpoint write, in Python);
* the transport floor: a bare grpc.aio ListAndWatch sending a message of the same size on
  each line written to its pipe, to the same raw client;
* memory: RSS of that plugin process, beside the same process serving 8 devices.

    python benchmarks/bench_scale.py [--sizes 1000,10000,50000] [--flips 20]
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

import _common
import anyio

from devplugin_sdk import Health
from devplugin_sdk.api.deviceplugin.v1beta1 import deviceplugin_pb2 as pb
from devplugin_sdk.testing import StaticPlugin, serving

RESOURCE = "bench.example.com/dev"
SOCKET = "bench.example.com_dev.sock"


def message_bytes(count: int) -> int:
    """Size of the ListAndWatch message for ``count`` devices of ``_common.devices``."""
    message = pb.ListAndWatchResponse()
    for device in _common.devices("d", count):
        entry = message.devices.add(ID=device.id, health="Healthy")
        entry.topology.nodes.extend(pb.NUMANode(ID=n) for n in device.numa_nodes)
    return message.ByteSize()


async def initial_list(count: int) -> None:
    devices = _common.devices("d", count)
    kubelet = _common.TimedKubelet()
    async with kubelet:
        plugin = StaticPlugin(RESOURCE, devices)
        started = time.perf_counter()
        async with serving(plugin, settings=kubelet.settings()):
            arrived = await kubelet.wait_for_message(0, timeout=120)
            await kubelet.wait_for_allocatable(RESOURCE, count, timeout=120)
            listed = time.perf_counter()
    print(
        f"{count:>6} devices: initial list: received {(arrived - started) * 1e3:.1f} ms, "
        f"kubelet's view complete {(listed - started) * 1e3:.1f} ms "
        f"(message {message_bytes(count) / 1024:.0f} KiB)"
    )


async def flips_and_memory(count: int, flips: int) -> int:
    """Time ``flips`` health flips of a plugin process; return its RSS."""
    read_end, write_end = os.pipe()
    kubelet = _common.TimedKubelet()
    try:
        async with (
            kubelet,
            _common.plugin_process(
                *("--dir", str(kubelet.directory), "--resource", f"{RESOURCE}={count}"),
                *("--control-fd", str(read_end)),
                pass_fds=[read_end],
            ) as process,
        ):
            await kubelet.wait_for_allocatable(RESOURCE, count, timeout=120)
            rss = _common.process_stats(process.pid).rss_bytes
            received: list[float] = []
            seen: list[float] = []
            observer = _common.ListAndWatchObserver(kubelet.directory / SOCKET)
            async with observer.running():
                expected = 1
                await observer.wait_for(expected)
                for i in range(flips):
                    device = f"d{(i * 7919) % count}"
                    for health in (Health.UNHEALTHY, Health.HEALTHY):
                        expected += 1
                        started = time.monotonic()
                        os.write(write_end, f"{device} {health.value}\n".encode())
                        arrived = await observer.wait_for(expected)
                        await kubelet.wait_for_health(RESOURCE, device, health.value, timeout=120)
                        done = time.monotonic()
                        if health is Health.UNHEALTHY:
                            received.append(arrived - started)
                            seen.append(done - started)
            rss = max(rss, _common.process_stats(process.pid).rss_bytes)
    finally:
        os.close(read_end)
        os.close(write_end)
    if received:
        on_wire = _common.report(f"{count:>6} devices: flip -> message received", received)
        _common.report(f"{count:>6} devices: flip -> fake kubelet's view", seen)
        if count >= 50_000:
            _common.target(f"health flip at {count} devices, median", on_wire.p50 * 1e3, 50.0)
    return rss


async def transport_floor(count: int, flips: int) -> list[float]:
    """Pipe write -> a bare grpc.aio ListAndWatch of the same size received, ``flips`` times."""
    read_end, write_end = os.pipe()
    directory = Path(tempfile.mkdtemp(prefix="dpb-", dir="/tmp"))
    samples: list[float] = []
    try:
        async with _common.plugin_process(
            *("--bare", str(directory / "bare.sock"), "--control-fd", str(read_end)),
            *("--stream-bytes", str(message_bytes(count))),
            pass_fds=[read_end],
            wait_line=True,
        ):
            observer = _common.ListAndWatchObserver(directory / "bare.sock")
            async with observer.running():
                await observer.wait_for(1)
                for expected in range(2, flips + 2):
                    started = time.monotonic()
                    os.write(write_end, b"next\n")
                    samples.append(await observer.wait_for(expected) - started)
    finally:
        os.close(read_end)
        os.close(write_end)
        shutil.rmtree(directory, ignore_errors=True)
    return samples


async def main() -> None:
    args_parser = _common.parser(__doc__ or "")
    args_parser.add_argument("--sizes", default="1000,10000,50000")
    args_parser.add_argument("--flips", type=int, default=20)
    args = args_parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    _common.print_header("Scale", sizes=args.sizes, flips=args.flips)
    for count in sizes:
        await initial_list(count)
    base = await flips_and_memory(8, 0)
    print(f"plugin process RSS with 8 devices: {_common.mib(base)}")
    for count in sizes:
        floor = await transport_floor(count, args.flips)
        _common.report(f"{count:>6} devices: floor: bare stream received", floor)
        rss = await flips_and_memory(count, args.flips)
        print(
            f"{count:>6} devices: plugin process RSS {_common.mib(rss)} "
            f"(+{_common.mib(rss - base)} over 8 devices, {(rss - base) / count:.0f} B/device)"
        )


if __name__ == "__main__":
    anyio.run(main, backend="asyncio")
