"""A DRA driver from the runner's plugins against FakeKubelet's DRA side and the in-memory API."""

from __future__ import annotations

import json

from dra_helpers import DRIVER, dra_options
from sdk_helpers import RESOURCE, widgets

from devplugin_sdk import Device, DeviceNode, Health
from devplugin_sdk.testing import FakeKubelet, MemoryApi, StaticPlugin, serving
from devplugin_sdk.types import Quantity


def typed_widgets(count: int = 3) -> list[Device]:
    return [
        Device(
            f"w{i}",
            device_nodes=(DeviceNode(f"/dev/widget{i}"),),
            env={"WIDGET": f"w{i}"},
            attributes={"index": i, "model": "Widget 9000"},
            capacity={"memory": Quantity(2**30)},
        )
        for i in range(count)
    ]


async def test_publishes_registers_prepares_and_unprepares() -> None:
    api = MemoryApi(nodes=["node-1"])
    async with FakeKubelet(dra_api=api) as kubelet:
        plugin = StaticPlugin(RESOURCE, typed_widgets(3))
        options = dra_options(kubelet, api)
        async with serving(plugin, settings=kubelet.settings(), api="dra", dra=options) as running:
            await kubelet.wait_for(
                lambda: kubelet.dra.is_registered(DRIVER), what="DRA registration"
            )
            await kubelet.wait_for(lambda: api.pool_complete(DRIVER, "node-1"), what="slices")
            (pool,) = api.pool(DRIVER, "node-1")
            assert [d.name for d in pool.devices] == ["w0", "w1", "w2"]
            assert pool.devices[1].attributes == {"index": 1, "model": "Widget 9000"}
            assert str(pool.devices[1].capacity["memory"]) == "1Gi"
            (registration,) = kubelet.dra.successful_registrations(DRIVER)
            assert registration.service == "v1.DRAPlugin"
            await kubelet.wait_for(
                lambda: running.dra is not None and running.dra.registered, what="status"
            )

            pod = kubelet.dra.pod("default", "pod-a", ["gpus"])
            api.allocate(
                "default",
                "gpus",
                {"widgets": ["w0", "w2"]},
                driver=DRIVER,
                pool="node-1",
                pods=[pod.uid],
            )
            prepared = await kubelet.dra.prepare(pod)
            ids = prepared.cdi_ids("gpus")
            claim = api.claims[("default", "gpus")]
            assert ids == [f"k8s.{DRIVER}/claim={claim.uid}-widgets"]
            spec_path = options.cdi_dir / f"k8s.{DRIVER}-claim_{claim.uid}.json"
            spec = json.loads(spec_path.read_text())
            (edits,) = spec["devices"]
            assert [n["path"] for n in edits["containerEdits"]["deviceNodes"]] == [
                "/dev/widget0",
                "/dev/widget2",
            ]
            await kubelet.dra.unprepare(pod)
            assert not spec_path.exists()
            assert kubelet.dra.prepared_claims() == []


async def test_unhealthy_devices_are_withdrawn_and_come_back() -> None:
    api = MemoryApi(nodes=["node-1"])
    async with FakeKubelet(dra_api=api) as kubelet:
        plugin = StaticPlugin(RESOURCE, widgets(3))
        async with serving(
            plugin, settings=kubelet.settings(), api="dra", dra=dra_options(kubelet, api)
        ):
            await kubelet.wait_for(lambda: api.pool_complete(DRIVER, "node-1"), what="slices")
            first = api.pool(DRIVER, "node-1")[0].generation
            plugin.set_health("w1", Health.UNHEALTHY)

            def names() -> list[str]:
                return [d.name for s in api.pool(DRIVER, "node-1") for d in s.devices]

            await kubelet.wait_for(lambda: names() == ["w0", "w2"], what="w1 withdrawn")
            assert api.pool(DRIVER, "node-1")[0].generation > first
            plugin.set_health("w1", Health.HEALTHY)
            await kubelet.wait_for(lambda: names() == ["w0", "w1", "w2"], what="w1 back")
