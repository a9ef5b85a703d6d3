"""DRA publishing under flaps and mass faults: a DRA driver on FakeKubelet and MemoryApi.

* storm: every device of a pool reported unhealthy at once, one event per device, until the
  pool's slices show every taint (and back, every device healthy again);
* flaps: devices flapping at random (``--flips`` in ``--window`` seconds) while a claim on a
  device that does not flap is prepared and unprepared again and again: slice writes a second,
  the states a reader could sample between two writes that show the pool's newest generation
  short of its slice count, and the prepares' latency.

    python benchmarks/bench_publish.py [--storm 500,1000,1500] [--devices 200] [--flips 1400]
        [--window 5]
"""

from __future__ import annotations

import random
import time

import _common
import anyio

from devplugin_sdk import Device
from devplugin_sdk.dra import ResourceSlice
from devplugin_sdk.testing import DraNode, MemoryApi, StaticPlugin

DRIVER = "bench.example.com"
RESOURCE = "bench.example.com/dev"
WRITES = ("create_slice", "update_slice", "delete_slice")


async def storm(count: int) -> tuple[float, float]:
    """Seconds until ``count`` taints are published, and until they are gone again."""
    devices = [Device(f"d{i:05}") for i in range(count)]
    plugin = StaticPlugin(RESOURCE, devices)
    async with DraNode(plugin, driver=DRIVER, timeout=120) as node:
        figures: list[float] = []
        for health, tainted in (("Unhealthy", True), ("Healthy", False)):

            def shown(tainted: bool = tainted) -> bool:
                return all(bool(d.taints) == tainted for d in node.published().values())

            # A quiet node: its last write over a second ago (a storm right after a write waits
            # for the half-second bound between writes, and would measure that instead).
            await anyio.sleep(1.0)
            started = time.perf_counter()
            for device in devices:
                plugin.set_health(device.id, health)
            await node.kubelet.wait_for(shown, timeout=120, what=f"every device {health}")
            figures.append(time.perf_counter() - started)
    return figures[0], figures[1]


def short_states(memory: MemoryApi, before: list[ResourceSlice], since: int) -> tuple[int, int]:
    """How many states between two slice writes after ``since`` showed the pool's newest
    generation short of its slice count, out of how many."""
    held = {s.name: s for s in before}
    changes = memory.changes_since(since)
    if changes is None:
        raise RuntimeError("MemoryApi's history is too short for this window")
    short = 0
    for kind, s in changes[1]:
        if kind == "DELETED":
            held.pop(s.name, None)
        else:
            held[s.name] = s
        top = max((x.generation for x in held.values()), default=0)
        newest = [x for x in held.values() if x.generation == top]
        if not newest or any(x.slice_count != len(newest) for x in newest):
            short += 1
    return short, len(changes[1])


async def flaps(count: int, flips: int, window: float) -> None:
    flapping = [Device(f"f{i:05}") for i in range(count)]
    plugin = StaticPlugin(RESOURCE, [*flapping, Device("steady")])
    rng = random.Random(13)
    async with DraNode(plugin, driver=DRIVER, timeout=60) as node:
        memory = node.api
        pod = node.pod("steady", uid="pod-steady")
        node.claim("steady", ["steady"], pods=[pod])
        before, since = list(memory.slices.values()), memory.generation
        writes = sum(memory.calls.get(c, 0) for c in WRITES)
        took: list[float] = []
        stop = anyio.Event()

        async def prepares() -> None:
            while not stop.is_set():
                started = time.perf_counter()
                await node.prepare(pod)
                took.append(time.perf_counter() - started)
                await node.unprepare(pod)

        done = 0
        unhealthy: set[str] = set()
        started = time.perf_counter()
        async with anyio.create_task_group() as tg:
            tg.start_soon(prepares)
            while (elapsed := time.perf_counter() - started) < window:
                while done < flips * elapsed / window:  # the flips due by now
                    device = flapping[rng.randrange(count)].id
                    plugin.set_health(device, "Healthy" if device in unhealthy else "Unhealthy")
                    unhealthy.symmetric_difference_update({device})
                    done += 1
                await anyio.sleep(0.005)
            stop.set()
        lasted = time.perf_counter() - started
        written = sum(memory.calls.get(c, 0) for c in WRITES) - writes
        short, states = short_states(memory, before, since)
    print(
        f"flaps: {done} flips of {count} devices in {lasted:.1f} s: "
        f"{written / lasted:.1f} slice writes/s; {short} of {states} states between writes "
        f"showed the pool short ({100 * short / max(states, 1):.0f} %)"
    )
    _common.report("flaps: prepare (NodePrepareResources)", took)


async def main(sizes: list[int], count: int, flips: int, window: float) -> None:
    _common.print_header("DRA publishing", storm=sizes, devices=count, flips=flips, window=window)
    for size in sizes:
        tainted, healed = await storm(size)
        print(
            f"storm: {size} devices unhealthy at once: tainted in {tainted:.2f} s, "
            f"healed in {healed:.2f} s"
        )
    _common.target(f"storm: {sizes[-1]} taints published", tainted, 1.0, "s")
    await flaps(count, flips, window)


if __name__ == "__main__":
    args = _common.parser(__doc__ or "")
    args.add_argument("--storm", default="500,1000,1500")
    args.add_argument("--devices", type=int, default=200)
    args.add_argument("--flips", type=int, default=1400)
    args.add_argument("--window", type=float, default=5.0)
    parsed = args.parse_args()
    sizes = [int(n) for n in parsed.storm.split(",")]
    anyio.run(main, sizes, parsed.devices, parsed.flips, parsed.window, backend="asyncio")
