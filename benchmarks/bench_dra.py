"""DRA: what a DRA driver built from a plugin costs, against FakeKubelet's DRA side and MemoryApi.

* prepare: NodePrepareResources of a one-device claim over gRPC (the claim read, the plugin's
  ``allocate()``, one CDI spec and the checkpoint written, both durable), then
  NodeUnprepareResources (entry and spec removed). Interleaved, claim by claim, with the same two
  calls to a minimal driver (a ``DRAPlugin`` server on the same grpc.aio stack answering from
  memory: no API read, no disk) and with the machine's durability cost (a bare write, fsync,
  rename and directory fsync of the same bytes in the same directories: the spec's and the
  checkpoint's). ``--profile`` adds a cProfile of the driver's side of the prepares;
* through the kubelet: the same prepare as ``kubelet.dra.prepare(pod)`` (FakeKubelet's claim
  read and bookkeeping added);
* repeat: the same prepare again after the kubelet forgot its answer (served from the
  checkpoint, no work);
* taint: a device's health event until the pool's new generation shows its taint (or no longer
  shows it, on recovery);
* health stream: the same event until the kubelet's DRAResourceHealth cache has the new status;
* republish: the kubelet's wipe of the node's slices until the pool is complete again (each
  wipe 50 ms after the last republish, once the driver has read its write back: a kubelet
  restarts seconds apart; a write undone again before it was read back is a fight, which the
  driver backs off from, docs/reliability.md).

    python benchmarks/bench_dra.py [--claims 200] [--flips 200] [--devices 64] [--profile]
"""

from __future__ import annotations

import cProfile
import os
import pstats
import secrets
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import _common
import anyio
import grpc

from devplugin_sdk import Device, DeviceNode, Health
from devplugin_sdk._wire.dra_model import ClaimRef, PreparedClaim, PreparedDevice
from devplugin_sdk._wire.dra_service import DraClient, handlers
from devplugin_sdk.testing import DraNode, FakeKubelet, MemoryApi, StaticPlugin

DRIVER = "bench.example.com"
RESOURCE = "bench.example.com/dev"
SERVICE = "v1.DRAPlugin"
TIMEOUT = 45.0  # the kubelet's per-call timeout


async def main(claims: int, flips: int, count: int, profile: bool) -> None:
    _common.print_header("DRA", claims=claims, flips=flips, devices=count)
    api = MemoryApi(nodes=["node-1"])
    devices = [
        Device(f"d{i}", device_nodes=(DeviceNode(f"/dev/d{i}"),), attributes={"index": i})
        for i in range(count)
    ]
    plugin = StaticPlugin(RESOURCE, devices)
    work = Path(tempfile.mkdtemp(prefix="dra-", dir="/tmp"))
    try:
        cdi_dir = work / "cdi"
        async with DraNode(plugin, driver=DRIVER, memory=api, cdi_dir=cdi_dir) as node:
            kubelet = node.kubelet
            # The DRA socket is inside the kubelet's root directory (newer kubelets check).
            plugin_dir = node.options.resolved_plugin_dir
            dirs = _Dirs(plugin_dir, cdi_dir, work)
            await _prepare_beside_baselines(api, dirs, claims, count, profile=profile)
            await _through_kubelet(kubelet, api, claims, count)

            await _health(kubelet, api, plugin, flips)

            republish: list[float] = []
            for _ in range(20):
                await anyio.sleep(0.05)  # the driver reads its write back (see the docstring)
                started = time.perf_counter()
                api.wipe_slices("node-1")
                while not api.pool_complete(DRIVER, "node-1"):
                    await api.wait_changed(api.generation)
                republish.append(time.perf_counter() - started)
            _common.report("kubelet wipe -> pool complete again", republish)
    finally:
        shutil.rmtree(work, ignore_errors=True)


class _MinimalDriver:
    """A DRAPlugin that answers from memory: what a prepare costs with no API read and no disk."""

    def __init__(self) -> None:
        self.prepared: dict[str, PreparedClaim] = {}

    async def prepare(self, refs: Sequence[ClaimRef]) -> dict[str, PreparedClaim]:
        out = {}
        for ref in refs:
            ids = (f"k8s.{DRIVER}/claim={ref.uid}-r",)
            out[ref.uid] = self.prepared.setdefault(
                ref.uid, PreparedClaim((PreparedDevice(("r",), "node-1", "d0", ids),))
            )
        return out

    async def unprepare(self, refs: Sequence[ClaimRef]) -> dict[str, str]:
        for ref in refs:
            self.prepared.pop(ref.uid, None)
        return {ref.uid: "" for ref in refs}


def _durable_write(directory: Path, name: str, data: bytes) -> None:
    """The machine's durability floor: write, fsync, rename, fsync the directory."""
    path = directory / name
    tmp = directory / f".{name}.{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


@dataclass(frozen=True)
class _Dirs:
    plugin: Path
    cdi: Path
    work: Path


def _written(dirs: _Dirs, uid: str) -> tuple[bytes, bytes]:
    """The bytes of the claim's spec and of the checkpoint, as the driver wrote them."""
    spec = next(dirs.cdi.glob(f"*{uid}.json")).read_bytes()
    return spec, (dirs.plugin / "checkpoint.json").read_bytes()


async def _one_claim(
    ours: DraClient, base: DraClient, api: MemoryApi, dirs: _Dirs, *, i: int, count: int
) -> dict[str, float]:
    """One claim prepared and unprepared by both drivers, and the bare durable writes."""
    claim = api.allocate("bench", f"b{i}", {"r": [f"d{i % count}"]}, driver=DRIVER, pool="node-1")
    ref = ClaimRef("bench", claim.uid, claim.name)
    out: dict[str, float] = {}
    started = time.perf_counter()
    await base.prepare([ref], TIMEOUT)
    out["mprepare"] = time.perf_counter() - started
    started = time.perf_counter()
    result = await ours.prepare([ref], TIMEOUT)
    out["prepare"] = time.perf_counter() - started
    if result[ref.uid].error:
        raise RuntimeError(result[ref.uid].error)
    spec, checkpoint = await anyio.to_thread.run_sync(_written, dirs, claim.uid)
    started = time.perf_counter()
    await anyio.to_thread.run_sync(_durable_write, dirs.cdi, "bench-floor.jsn", spec)
    await anyio.to_thread.run_sync(_durable_write, dirs.plugin, "floor.checkpoint", checkpoint)
    out["durable"] = time.perf_counter() - started
    started = time.perf_counter()
    await base.unprepare([ref], TIMEOUT)
    out["munprepare"] = time.perf_counter() - started
    started = time.perf_counter()
    await ours.unprepare([ref], TIMEOUT)
    out["unprepare"] = time.perf_counter() - started
    api.delete_claim("bench", claim.name)
    return out


async def _prepare_beside_baselines(
    api: MemoryApi, dirs: _Dirs, claims: int, count: int, *, profile: bool
) -> None:
    """Prepare and unprepare one claim at a time on our driver and on the minimal one, and the
    bare durable writes of the same bytes, interleaved."""
    minimal = _MinimalDriver()
    server = grpc.aio.server()
    server.add_generic_rpc_handlers(handlers(minimal.prepare, minimal.unprepare, [SERVICE]))
    minimal_sock = dirs.work / "minimal.sock"
    server.add_insecure_port(f"unix://{minimal_sock}")
    await server.start()
    profiler = cProfile.Profile() if profile else None
    series: dict[str, list[float]] = {}
    try:
        async with (
            grpc.aio.insecure_channel(f"unix://{dirs.plugin / 'dra.sock'}") as ours_channel,
            grpc.aio.insecure_channel(f"unix://{minimal_sock}") as minimal_channel,
        ):
            ours = DraClient(ours_channel, SERVICE)
            base = DraClient(minimal_channel, SERVICE)
            if profiler is not None:
                profiler.enable()
            for i in range(claims + 10):  # the first 10 warm up
                figures = await _one_claim(ours, base, api, dirs, i=i, count=count)
                if i >= 10:
                    for key, value in figures.items():
                        series.setdefault(key, []).append(value)
            if profiler is not None:
                profiler.disable()
    finally:
        await server.stop(None)
    ours_p = _common.report("prepare (1 device, spec + checkpoint durable)", series["prepare"])
    base_p = _common.report("prepare, minimal driver (memory only)", series["mprepare"])
    floor = _common.report("durable write x2 (spec + checkpoint bytes)", series["durable"])
    ours_u = _common.report("unprepare", series["unprepare"])
    base_u = _common.report("unprepare, minimal driver", series["munprepare"])
    print(
        f"ratio to the minimal driver, p50: prepare {ours_p.p50 / base_p.p50:.2f}x, "
        f"unprepare {ours_u.p50 / base_u.p50:.2f}x; minimal + durable writes "
        f"{(base_p.p50 + floor.p50) * 1e3:.3f} ms"
    )
    _common.target("prepare p50 / (minimal driver p50)", ours_p.p50 / base_p.p50, 2.0, unit="x")
    if profiler is not None:
        stats = pstats.Stats(profiler)
        stats.sort_stats("tottime").print_stats(30)


async def _through_kubelet(kubelet: FakeKubelet, api: MemoryApi, claims: int, count: int) -> None:
    prepare: list[float] = []
    repeat: list[float] = []
    unprepare: list[float] = []
    for i in range(claims):
        pod = kubelet.dra.pod("bench", f"p{i}", [f"c{i}"])
        api.allocate(
            "bench", f"c{i}", {"r": [f"d{i % count}"]}, driver=DRIVER, pool="node-1", pods=[pod.uid]
        )
        started = time.perf_counter()
        await kubelet.dra.prepare(pod)
        prepare.append(time.perf_counter() - started)
        kubelet.dra.forget_prepared()  # the kubelet asks again: the checkpoint answers
        started = time.perf_counter()
        await kubelet.dra.prepare(pod)
        repeat.append(time.perf_counter() - started)
        started = time.perf_counter()
        await kubelet.dra.unprepare(pod)
        unprepare.append(time.perf_counter() - started)
        api.delete_claim("bench", f"c{i}")
    _common.report("prepare through FakeKubelet", prepare)
    _common.report("prepare again (from the checkpoint)", repeat)
    _common.report("unprepare through FakeKubelet", unprepare)


async def _health(kubelet: FakeKubelet, api: MemoryApi, plugin: StaticPlugin, flips: int) -> None:
    """A device's health flips: until the pool shows (or drops) its taint, and until the
    kubelet's health stream has it."""

    def tainted() -> bool:
        return any(d.taints for s in api.pool(DRIVER, "node-1") for d in s.devices)

    def streamed() -> str:
        return kubelet.dra.health.health(DRIVER, "node-1", "d0")[0]

    taint: list[float] = []
    stream: list[float] = []
    for i in range(flips):
        health = Health.UNHEALTHY if i % 2 == 0 else Health.HEALTHY
        started = time.perf_counter()
        plugin.set_health("d0", health, "bench")
        while tainted() is not (health is Health.UNHEALTHY):
            await api.wait_changed(api.generation)
        taint.append(time.perf_counter() - started)
        await kubelet.wait_for(lambda h=health: streamed() == h.value)  # type: ignore[misc]
        stream.append(time.perf_counter() - started)
    _common.report("health event -> pool generation (taint)", taint)
    _common.report("health event -> kubelet's health stream", stream)


if __name__ == "__main__":
    args = _common.parser(__doc__ or "")
    args.add_argument("--claims", type=int, default=200)
    args.add_argument("--flips", type=int, default=200)
    args.add_argument("--devices", type=int, default=64)
    args.add_argument("--profile", action="store_true", help="cProfile the driver's prepares")
    parsed = args.parse_args()
    anyio.run(main, parsed.claims, parsed.flips, parsed.devices, parsed.profile, backend="asyncio")
