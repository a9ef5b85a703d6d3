"""Fleet: the API server's load from N DRA drivers, one node each, in one process.

Each node runs the driver's ResourceSlice publisher (``dra/_pool/publisher.py`` and its watch-fed
``view.py``: the pieces that talk to the API server; the health feed reaches it as ``want()`` of
the pool with a device tainted or not) against its own in-memory API (``MemoryApi``, which counts
every call), so a node's watch sees only its own slices, as a field-selected watch does. The API
server ends each watch after its ``timeoutSeconds`` (the client asks 300 s times a random factor
in [1, 2), as client-go does), sends a quiet watch a BOOKMARK about once a minute, and ends every
open watch at once when it goes down (unreachable: every request fails as a refused connection
does).

Time is scaled (``--scale``, 0.05 by default: a simulated minute lasts 3 s): every timer of the
publisher (retry backoff, resync) and of the server (watch timeouts, the outage) is multiplied
by it, so counts per simulated hour and the shape of the retries are those of real time, while
latencies (``health change -> slice written``) are real milliseconds: the coalescing window is
not scaled. Printed:

* steady state: requests per node per simulated hour, by method, after every pool is published;
* a health change: requests (and slice writes) per change, and the change's latency until the
  slice holds the taint, one node at a time; then flaps (the same device unhealthy, healthy,
  unhealthy 1 ms apart) and the writes they cost;
* an outage: the whole API unreachable for ``--outage`` simulated seconds; requests per
  simulated second, fleet-wide, from before it until two minutes after it ends, beside the
  steady rate; the peak after the outage, as a multiple of the steady rate.

    python benchmarks/bench_fleet.py [--nodes 1000] [--scale 0.05] [--steady-minutes 20]
        [--outage 60] [--changes 100]
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import AsyncIterator, Sequence

import _common
import anyio
import anyio.abc
from anyio.streams.memory import MemoryObjectSendStream

from devplugin_sdk.dra._pool.publisher import Publisher
from devplugin_sdk.dra.resources import DeviceTaint, SliceDevice, SliceEvent
from devplugin_sdk.errors import KubeApiError
from devplugin_sdk.testing import MemoryApi

DRIVER = "fleet.example.com"
DEVICES = 8
WATCH_TIMEOUT = 300.0  # dra/_kube.py: WATCH_TIMEOUT, times [1, 2)
RETRY_FIRST = 0.5  # dra/_pool/publisher.py: _RETRY_FIRST
RETRY_MAX = 30.0  # dra/_pool/publisher.py: _RETRY_MAX
RESYNC = 300.0  # dra/_pool/publisher.py: _RESYNC
BOOKMARK_EVERY = 60.0  # the API server's bookmarks to a quiet watch (about once a minute)
WRITES = ("create_slice", "update_slice", "delete_slice")


class Fleet:
    """The API server's side: whether it is up, and every node's API."""

    def __init__(self, scale: float) -> None:
        self.scale = scale
        self.down = False
        self.apis: list[NodeApi] = []
        self._tasks: anyio.abc.TaskGroup | None = None

    def tasks(self) -> anyio.abc.TaskGroup:
        """Where the watches' helper tasks run."""
        assert self._tasks is not None
        return self._tasks

    def total(self, methods: Sequence[str] | None = None) -> int:
        """Requests so far, all nodes (of ``methods`` only, when given)."""
        return sum(
            n for api in self.apis for m, n in api.calls.items() if methods is None or m in methods
        )

    def by_method(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for api in self.apis:
            for method, n in api.calls.items():
                out[method] = out.get(method, 0) + n
        return out

    def go_down(self) -> None:
        """Every request fails from now on, and every open watch ends with an error."""
        self.down = True
        for api in self.apis:
            # More failures than a node's retries in any outage (each backs off to 30 s).
            api.fail_next(0, "connection refused (the API server is down)", times=1000)
            if api.step is not None:
                api.step.cancel()

    def come_back(self) -> None:
        self.down = False
        for api in self.apis:
            api.clear_failures()


class NodeApi(MemoryApi):
    """One node's view of the API server: its own slices, a watch the server ends after its
    timeout or when it goes down."""

    def __init__(self, fleet: Fleet, node: str) -> None:
        super().__init__(nodes=[node])
        self.fleet = fleet
        self.step: anyio.CancelScope | None = None

    async def watch_slices(
        self, driver: str, node_name: str, resource_version: str = ""
    ) -> AsyncIterator[SliceEvent | None]:
        scale = self.fleet.scale
        deadline = anyio.current_time() + WATCH_TIMEOUT * (1 + random.random()) * scale
        version = resource_version
        # MemoryApi's watch runs in a task of its own, so that waiting for its next event can
        # be given up (for a bookmark, the timeout, the outage) without ending it.
        send, receive = anyio.create_memory_object_stream[SliceEvent | KubeApiError | None](64)
        pump = anyio.CancelScope()
        self.fleet.tasks().start_soon(self._pump, driver, node_name, resource_version, send, pump)
        try:
            while True:
                # The API server sends a BOOKMARK about once a minute to a watch that asked
                # for them (allowWatchBookmarks), with the version the watch has reached.
                wake = min(deadline, anyio.current_time() + BOOKMARK_EVERY * scale)
                with anyio.CancelScope(deadline=wake) as step:
                    self.step = step
                    item = await receive.receive()
                self.step = None
                if self.fleet.down:
                    raise KubeApiError(0, "connection reset (the API server went down)")
                if step.cancelled_caught:
                    if anyio.current_time() >= deadline:
                        return  # the server ended the watch: its timeoutSeconds
                    if version:
                        yield SliceEvent("BOOKMARK", None, version)
                    continue
                if isinstance(item, KubeApiError):
                    raise item
                if item is not None:
                    version = item.resource_version or version
                yield item
        finally:
            self.step = None
            pump.cancel()

    async def _pump(
        self,
        driver: str,
        node_name: str,
        version: str,
        send: MemoryObjectSendStream[SliceEvent | KubeApiError | None],
        scope: anyio.CancelScope,
    ) -> None:
        with scope, send:
            try:
                async for event in super().watch_slices(driver, node_name, version):
                    await send.send(event)
            except KubeApiError as exc:
                await send.send(exc)


def pool(node: int, *, tainted: bool = False) -> list[SliceDevice]:
    taints = (DeviceTaint("fleet.example.com/unhealthy", "", "NoSchedule"),) if tainted else ()
    return [
        SliceDevice(f"dev-{i}", attributes={"index": i}, taints=taints if i == 0 else ())
        for i in range(DEVICES)
    ]


def has_taint(api: MemoryApi, node: str) -> bool:
    return any(d.taints for s in api.pool(DRIVER, node) for d in s.devices)


async def main(
    nodes: int, scale: float, steady_minutes: float, outage: float, changes: int
) -> None:
    _common.print_header(
        "fleet",
        nodes=nodes,
        scale=scale,
        steady_minutes=steady_minutes,
        outage_s=outage,
        changes=changes,
        devices_per_node=DEVICES,
    )
    # A thousand nodes retrying say so a thousand times: only the figures.
    logging.getLogger("devplugin_sdk").setLevel(logging.CRITICAL)
    fleet = Fleet(scale)
    publishers: list[Publisher] = []
    for i in range(nodes):
        api = NodeApi(fleet, f"node-{i}")
        fleet.apis.append(api)
        publishers.append(
            Publisher(
                api,
                DRIVER,
                f"node-{i}",
                retry_first=RETRY_FIRST * scale,
                retry_max=RETRY_MAX * scale,
                resync_seconds=RESYNC * scale,
            )
        )
    async with anyio.create_task_group() as tg:
        fleet._tasks = tg
        started = time.perf_counter()
        for i, publisher in enumerate(publishers):
            tg.start_soon(publisher.run)
            publisher.want(pool(i))
        for publisher in publishers:
            await publisher.wait_published()
        print(
            f"start: {nodes} pools published in {time.perf_counter() - started:.2f} s wall, "
            f"{fleet.total()} requests ({fleet.total(WRITES)} writes)"
        )
        # Let the start-up's echoes settle (a simulated minute) before counting.
        await anyio.sleep(60 * scale)
        steady_rate = await _steady(fleet, nodes, scale, steady_minutes)
        await _changes(fleet, publishers, changes)
        await _outage(fleet, nodes, scale, outage, steady_rate)
        tg.cancel_scope.cancel()


async def _steady(fleet: Fleet, nodes: int, scale: float, minutes: float) -> float:
    """Requests per simulated hour and node at steady state; returns the fleet's rate per
    simulated second."""
    before = fleet.by_method()
    await anyio.sleep(minutes * 60 * scale)
    after = fleet.by_method()
    delta = {m: after.get(m, 0) - before.get(m, 0) for m in after}
    total = sum(delta.values())
    per_hour = 60 / minutes
    shown = ", ".join(f"{m} {n * per_hour / nodes:.1f}" for m, n in sorted(delta.items()) if n)
    print(
        f"steady state ({minutes:g} simulated min): {total * per_hour / nodes:.1f} requests per "
        f"node per hour ({shown}); fleet {total * per_hour:.0f} per hour = "
        f"{total / (minutes * 60):.2f} per second; writes "
        f"{sum(delta.get(m, 0) for m in WRITES)}"
    )
    return total / (minutes * 60)


async def _changes(fleet: Fleet, publishers: list[Publisher], changes: int) -> None:
    """One health change at a time on a node: its requests, writes and latency."""
    requests: list[int] = []
    writes: list[int] = []
    latency: list[float] = []
    for k in range(changes):
        i = k % len(publishers)
        api, publisher, node = fleet.apis[i], publishers[i], f"node-{i}"
        tainted = not has_taint(api, node)
        before, before_writes = sum(api.calls.values()), _writes(api)
        started = time.perf_counter()
        publisher.want(pool(i, tainted=tainted))
        while has_taint(api, node) is not tainted:
            await api.wait_changed(api.generation)
        latency.append(time.perf_counter() - started)
        await anyio.sleep(0.1)  # the echo of the write, and what it leads to
        requests.append(sum(api.calls.values()) - before)
        writes.append(_writes(api) - before_writes)
    print(
        f"health change, one node at a time (n={changes}): requests per change "
        f"p50={sorted(requests)[len(requests) // 2]} max={max(requests)}, slice writes per "
        f"change p50={sorted(writes)[len(writes) // 2]} max={max(writes)}"
    )
    _common.report("health change -> slice written", latency)
    flap_writes: list[int] = []
    for k in range(changes):
        i = k % len(publishers)
        api, publisher = fleet.apis[i], publishers[i]
        await publisher.wait_published()
        tainted = not has_taint(api, f"node-{i}")
        before_writes = _writes(api)
        for state in (tainted, not tainted, tainted):
            publisher.want(pool(i, tainted=state))
            await anyio.sleep(0.001)
        await publisher.wait_published()
        await anyio.sleep(0.1)
        flap_writes.append(_writes(api) - before_writes)
    print(
        f"flaps (3 changes 1 ms apart, n={changes}): slice writes p50="
        f"{sorted(flap_writes)[len(flap_writes) // 2]} max={max(flap_writes)}"
    )


def _writes(api: MemoryApi) -> int:
    return sum(api.calls.get(m, 0) for m in WRITES)


async def _outage(fleet: Fleet, nodes: int, scale: float, outage: float, steady: float) -> None:
    """The API down for ``outage`` simulated seconds: requests per simulated second around it."""
    bucket = 1.0  # simulated seconds
    before, after = 30.0, 120.0
    counts: list[int] = []
    ended_at = int((before + outage) / bucket)
    last = fleet.total()
    start = anyio.current_time()
    steps = int((before + outage + after) / bucket)
    for step in range(steps):
        if step == int(before / bucket):
            fleet.go_down()
        if step == ended_at:
            fleet.come_back()
        await anyio.sleep_until(start + (step + 1) * bucket * scale)
        now = fleet.total()
        counts.append(now - last)
        last = now
    during = counts[int(before / bucket) : ended_at]
    recovery = counts[ended_at:]
    peak = max(recovery)
    peak_at = recovery.index(peak) * bucket
    print(
        f"outage of {outage:g} s: requests per second fleet-wide, steady {steady:.2f}; during "
        f"the outage mean {sum(during) / len(during) / bucket:.1f} max {max(during) / bucket:.0f}"
        f"; after it: peak {peak / bucket:.0f} at +{peak_at:g} s = {peak / bucket / steady:.1f}x "
        f"the steady rate; first 30 s after {sum(recovery[:30]) / nodes:.2f} requests per node"
    )
    print("requests per 5 s (from 30 s before the outage; | marks its start and end):")
    rows = []
    for i in range(0, len(counts), 5):
        mark = "|" if i in (int(before / bucket), ended_at) else " "
        rows.append(f"{mark}{i - before:+.0f}s:{sum(counts[i : i + 5])}")
    for i in range(0, len(rows), 10):
        print("  " + " ".join(rows[i : i + 10]))
    _common.target("peak after the outage / steady rate", peak / bucket / steady, 2.0, unit="x")


if __name__ == "__main__":
    args = _common.parser(__doc__ or "")
    args.add_argument("--nodes", type=int, default=1000)
    args.add_argument("--scale", type=float, default=0.05)
    args.add_argument("--steady-minutes", type=float, default=20.0)
    args.add_argument("--outage", type=float, default=60.0)
    args.add_argument("--changes", type=int, default=100)
    parsed = args.parse_args()
    anyio.run(
        main,
        parsed.nodes,
        parsed.scale,
        parsed.steady_minutes,
        parsed.outage,
        parsed.changes,
        backend="asyncio",
    )
