"""DRA: what a DRA driver built from a plugin costs, against FakeKubelet's DRA side and MemoryApi.

* prepare: ``kubelet.dra.prepare(pod)`` of a one-device claim (NodePrepareResources over gRPC,
  the claim read, the plugin's ``allocate()``, one CDI spec and the checkpoint written, both
  fsynced), then ``unprepare`` (spec and entry removed);
* repeat: the same prepare again after the kubelet forgot its answer (served from the
  checkpoint, no work);
* taint: a device's health event until the pool's new generation shows its taint (or no longer
  shows it, on recovery);
* health stream: the same event until the kubelet's DRAResourceHealth cache has the new status;
* republish: the kubelet's wipe of the node's slices until the pool is complete again (each
  wipe 50 ms after the last republish, once the driver has read its write back: a kubelet
  restarts seconds apart; a write undone again before it was read back is a fight, which the
  driver backs off from, docs/reliability.md).

    python benchmarks/bench_dra.py [--claims 200] [--flips 200] [--devices 64]
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import _common
import anyio

from devplugin_sdk import Device, DeviceNode, Health
from devplugin_sdk.dra import Dra
from devplugin_sdk.testing import FakeKubelet, MemoryApi, StaticPlugin, serving

DRIVER = "bench.example.com"
RESOURCE = "bench.example.com/dev"


async def main(claims: int, flips: int, count: int) -> None:
    _common.print_header("DRA", claims=claims, flips=flips, devices=count)
    api = MemoryApi(nodes=["node-1"])
    devices = [
        Device(f"d{i}", device_nodes=(DeviceNode(f"/dev/d{i}"),), attributes={"index": i})
        for i in range(count)
    ]
    plugin = StaticPlugin(RESOURCE, devices)
    work = Path(tempfile.mkdtemp(prefix="dra-", dir="/tmp"))
    try:
        async with FakeKubelet(dra_api=api) as kubelet:
            dra = Dra(
                driver=DRIVER,
                node_name="node-1",
                api=api,
                plugin_dir=work / "plugins",
                cdi_dir=work / "cdi",
            )
            async with serving(plugin, settings=kubelet.settings(), api="dra", dra=dra):
                await kubelet.wait_for(lambda: kubelet.dra.is_registered(DRIVER), timeout=10)
                await kubelet.wait_for(lambda: api.pool_complete(DRIVER, "node-1"), timeout=10)
                prepare: list[float] = []
                repeat: list[float] = []
                unprepare: list[float] = []
                for i in range(claims):
                    pod = kubelet.dra.pod("bench", f"p{i}", [f"c{i}"])
                    api.allocate(
                        "bench",
                        f"c{i}",
                        {"r": [f"d{i % count}"]},
                        driver=DRIVER,
                        pool="node-1",
                        pods=[pod.uid],
                    )
                    started = time.perf_counter()
                    await kubelet.dra.prepare(pod)
                    prepare.append(time.perf_counter() - started)
                    kubelet.dra._claims.clear()  # the kubelet asks again: the checkpoint answers
                    started = time.perf_counter()
                    await kubelet.dra.prepare(pod)
                    repeat.append(time.perf_counter() - started)
                    started = time.perf_counter()
                    await kubelet.dra.unprepare(pod)
                    unprepare.append(time.perf_counter() - started)
                    api.delete_claim("bench", f"c{i}")
                _common.report("prepare (1 device, CDI spec + checkpoint)", prepare)
                _common.report("prepare again (from the checkpoint)", repeat)
                _common.report("unprepare", unprepare)

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
    parsed = args.parse_args()
    anyio.run(main, parsed.claims, parsed.flips, parsed.devices, backend="asyncio")
