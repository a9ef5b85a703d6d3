"""The real Kubernetes client (lightkube) on the wire, against a loopback API server."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import anyio
import pytest
from dra_helpers import DRIVER, dra_options
from kube_apiserver import FakeApiServer
from sdk_helpers import RESOURCE, widgets

from devplugin_sdk.dra import ResourceSlice, SliceDevice, kube_api
from devplugin_sdk.errors import KubeApiError
from devplugin_sdk.testing import FakeKubelet, MemoryApi, StaticPlugin, serving
from devplugin_sdk.types import Quantity, Version


def _spawn(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "devplugin_sdk", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ),
    )


async def test_every_operation_round_trips(tmp_path: Path) -> None:
    memory = MemoryApi(nodes=["node-1"])
    async with FakeApiServer(memory).serving() as server:
        api = kube_api(server.kubeconfig(tmp_path / "kubeconfig"))
        try:
            device = SliceDevice(
                "gpu-0",
                {"index": 0, "mig": False, "model": "X", "v": Version("1.2.3")},
                {"memory": Quantity(80 * 2**30)},
            )
            made = await api.create_slice(
                ResourceSlice("", DRIVER, "node-1", "node-1", 1, 1, (device,), node_uid="u1")
            )
            assert made.name.startswith(f"node-1-{DRIVER}-")
            assert made.devices == (device,)  # typed values survive the trip
            assert made.node_uid == "u1"
            (listed,) = await api.list_slices(DRIVER, "node-1")
            assert listed == made
            assert await api.list_slices(DRIVER, "node-2") == []
            updated = await api.update_slice(
                ResourceSlice(
                    made.name, DRIVER, "node-1", "node-1", 2, 1, (), made.resource_version
                )
            )
            with pytest.raises(KubeApiError) as stale:
                await api.update_slice(made)  # an old resourceVersion
            assert stale.value.conflict
            await api.delete_slice(updated.name)
            with pytest.raises(KubeApiError) as gone:
                await api.delete_slice(updated.name)
            assert gone.value.not_found
            claim = memory.add_claim("ns", "c")
            read = await api.read_claim("ns", "c")
            assert (read.uid, read.allocated) == (claim.uid, False)
            assert await api.node_uid("node-1") == memory.nodes["node-1"]
            with pytest.raises(KubeApiError) as missing:
                await api.read_claim("ns", "nope")
            assert missing.value.not_found
        finally:
            await api.aclose()


async def test_the_watch_reports_changes(tmp_path: Path) -> None:
    memory = MemoryApi(nodes=["node-1"])
    async with FakeApiServer(memory).serving() as server:
        api = kube_api(server.kubeconfig(tmp_path / "kubeconfig"))
        seen = anyio.Event()
        try:
            async with anyio.create_task_group() as tg:

                async def watch() -> None:
                    async for _ in api.watch_slices(DRIVER, "node-1"):
                        seen.set()

                tg.start_soon(watch)
                await memory.create_slice(ResourceSlice("", DRIVER, "node-1", "node-1", 1, 1))
                with anyio.fail_after(5):
                    await seen.wait()
                tg.cancel_scope.cancel()
        finally:
            await api.aclose()


async def test_a_driver_through_the_real_client(tmp_path: Path) -> None:
    """The whole driver over lightkube: publish, survive the kubelet's wipe, prepare."""
    memory = MemoryApi(nodes=["node-1"])
    async with FakeApiServer(memory).serving() as server, FakeKubelet(dra_api=memory) as kubelet:
        options = dra_options(
            kubelet, memory, api=None, kubeconfig=server.kubeconfig(tmp_path / "k")
        )
        async with serving(
            StaticPlugin(RESOURCE, widgets(2)), settings=kubelet.settings(), api="dra", dra=options
        ):
            await kubelet.wait_for(lambda: kubelet.dra.is_registered(DRIVER))
            await kubelet.wait_for(lambda: memory.pool_complete(DRIVER, "node-1"))
            memory.wipe_slices("node-1")  # as a kubelet start does
            await kubelet.wait_for(lambda: memory.pool_complete(DRIVER, "node-1"))
            pod = kubelet.dra.pod("ns", "p", ["c"])
            memory.allocate("ns", "c", {"r": ["w1"]}, driver=DRIVER, pool="node-1", pods=[pod.uid])
            prepared = await kubelet.dra.prepare(pod)
            assert prepared.cdi_ids("c")
            await kubelet.dra.unprepare(pod)
        methods = {m for m, _ in server.requests}
        assert {"GET", "POST"} <= methods


@pytest.mark.timeout(40)  # a real `devplugin run` process: start-up, registration, SIGTERM
async def test_devplugin_run_with_api_dra(tmp_path: Path) -> None:
    """`devplugin run generic --config FILE` with `api: dra` and a kubeconfig, as a process."""
    import json
    import signal

    dev = tmp_path / "dev"
    dev.mkdir()
    for i in range(2):
        (dev / f"ttyUSB{i}").touch()
    memory = MemoryApi(nodes=["node-1"])
    async with FakeApiServer(memory).serving() as server, FakeKubelet(dra_api=memory) as kubelet:
        root = kubelet.directory.parent
        config = tmp_path / "config.yaml"
        config.write_text(
            json.dumps(
                {
                    "backend": "generic",
                    "pluginsRegistryDir": str(kubelet.registry_directory),
                    "api": "dra",
                    "dra": {
                        "driver": "serial.example.com",
                        "nodeName": "node-1",
                        "kubeconfig": str(server.kubeconfig(tmp_path / "kubeconfig")),
                        "pluginDir": str(root / "plugins" / "serial"),
                        "cdiDir": str(root / "cdi"),
                    },
                    "resources": [
                        {"resourceName": "example.com/serial", "paths": [f"{dev}/ttyUSB*"]}
                    ],
                }
            )
        )
        proc = _spawn("run", "--config", str(config))
        try:
            driver = "serial.example.com"
            await kubelet.wait_for(lambda: kubelet.dra.is_registered(driver), timeout=20)
            await kubelet.wait_for(lambda: memory.pool_complete(driver, "node-1"), timeout=10)
            pod = kubelet.dra.pod("ns", "p", ["c"])
            [first, _] = sorted(d.name for d in memory.pool(driver, "node-1")[0].devices)
            memory.allocate("ns", "c", {"r": [first]}, driver=driver, pool="node-1", pods=[pod.uid])
            assert (await kubelet.dra.prepare(pod)).cdi_ids("c")
            proc.send_signal(signal.SIGTERM)
            _, stderr = await anyio.to_thread.run_sync(lambda: proc.communicate(timeout=15))
        finally:
            proc.kill()
            proc.communicate()
        assert proc.returncode == 0, stderr
        assert "registered with the kubelet" in stderr
        # The slices stay for the next run (the kubelet removes them if it never comes).
        assert memory.pool_complete(driver, "node-1")
