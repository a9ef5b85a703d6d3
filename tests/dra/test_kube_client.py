"""The real Kubernetes client (lightkube) on the wire, against a loopback API server."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import anyio
import pytest
from dra_helpers import DRIVER
from kube_apiserver import FakeApiServer
from sdk_helpers import RESOURCE, widgets

from devplugin_sdk.dra import ResourceSlice, SliceDevice, kube_api
from devplugin_sdk.errors import KubeApiError
from devplugin_sdk.testing import DraNode, MemoryApi, StaticPlugin
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
    async with FakeApiServer(memory).serving() as server:
        kubeconfig = server.kubeconfig(tmp_path / "k")
        plugin = StaticPlugin(RESOURCE, widgets(2))
        async with DraNode(
            plugin, driver=DRIVER, memory=memory, api=None, kubeconfig=kubeconfig
        ) as node:
            memory.wipe_slices("node-1")  # as a kubelet start does
            await node.ready()
            pod = node.pod("c", name="p", namespace="ns")
            node.claim("c", {"r": ["w1"]}, pods=[pod], namespace="ns")
            prepared = await node.prepare(pod)
            assert prepared.cdi_ids("c")
            await node.unprepare(pod)
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
    driver = "serial.example.com"
    node = DraNode(driver=driver, memory=memory, timeout=20)  # the driver: a process of its own
    async with FakeApiServer(memory).serving() as server, node:
        kubelet, options = node.kubelet, node.options
        config = tmp_path / "config.yaml"
        config.write_text(
            json.dumps(
                {
                    "backend": "generic",
                    "pluginsRegistryDir": str(kubelet.registry_directory),
                    "api": "dra",
                    "dra": {
                        "driver": driver,
                        "nodeName": "node-1",
                        "kubeconfig": str(server.kubeconfig(tmp_path / "kubeconfig")),
                        "pluginDir": str(options.plugin_dir),
                        "cdiDir": str(options.cdi_dir),
                    },
                    "resources": [
                        {"resourceName": "example.com/serial", "paths": [f"{dev}/ttyUSB*"]}
                    ],
                }
            )
        )
        proc = _spawn("run", "--config", str(config))
        try:
            await node.ready()
            pod = node.pod("c", name="p", namespace="ns")
            [first, _] = sorted(node.published())
            node.claim("c", {"r": [first]}, pods=[pod], namespace="ns")
            assert (await node.prepare(pod)).cdi_ids("c")
            proc.send_signal(signal.SIGTERM)
            _, stderr = await anyio.to_thread.run_sync(lambda: proc.communicate(timeout=15))
        finally:
            proc.kill()
            proc.communicate()
        assert proc.returncode == 0, stderr
        assert "registered with the kubelet" in stderr
        # The slices stay for the next run (the kubelet removes them if it never comes).
        assert memory.pool_complete(driver, "node-1")
