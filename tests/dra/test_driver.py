"""A DRA driver from the runner's plugins against FakeKubelet's DRA side and the in-memory API."""

from __future__ import annotations

import logging

import pytest
from dra_helpers import DRIVER
from sdk_helpers import RESOURCE, widgets

from devplugin_sdk import Device, DeviceNode, Health
from devplugin_sdk.dra.resources import DeviceTaint
from devplugin_sdk.testing import DraNode, FakeKubelet, MemoryApi, StaticPlugin
from devplugin_sdk.types import Effect, Quantity


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
    plugin = StaticPlugin(RESOURCE, typed_widgets(3))
    async with DraNode(plugin, driver=DRIVER) as node:
        kubelet, api, running = node.kubelet, node.api, node.running
        (pool,) = api.pool(DRIVER, "node-1")
        assert [d.name for d in pool.devices] == ["w0", "w1", "w2"]
        assert pool.devices[1].attributes == {"index": 1, "model": "Widget 9000"}
        assert str(pool.devices[1].capacity["memory"]) == "1Gi"
        (registration,) = kubelet.dra.successful_registrations(DRIVER)
        assert registration.service == "v1.DRAPlugin"
        await kubelet.wait_for(
            lambda: running.dra is not None and running.dra.registered, what="status"
        )

        pod = node.pod("gpus", name="pod-a")
        node.claim("gpus", {"widgets": ["w0", "w2"]}, pods=[pod])
        prepared = await node.prepare(pod)
        ids = prepared.cdi_ids("gpus")
        claim = api.claims[("default", "gpus")]
        assert ids == [f"k8s.{DRIVER}/claim={claim.uid}-widgets"]
        spec = node.spec(claim)
        spec_path = spec.path
        (edits,) = spec.devices
        assert [n["path"] for n in edits["containerEdits"]["deviceNodes"]] == [
            "/dev/widget0",
            "/dev/widget2",
        ]
        await node.unprepare(pod)
        assert not spec_path.exists()
        assert kubelet.dra.prepared_claims() == []


async def test_an_unhealthy_device_stays_in_the_pool_tainted_until_it_recovers() -> None:
    """Taints, not withdrawal: the device stays listed with a NoSchedule taint in the driver's
    domain, the reason's cause as value and a timeAdded that stays while the taint does; an
    escalation the operator did not opt into stays NoSchedule; recovery removes the taint."""
    plugin = StaticPlugin(RESOURCE, widgets(3))
    async with DraNode(plugin, driver=DRIVER) as node:
        kubelet, api = node.kubelet, node.api
        plugin.set_health("w1", Health.UNHEALTHY, "ECC error: 3 pages retired")

        def taints() -> dict[str, tuple[DeviceTaint, ...]]:
            return {d.name: d.taints for s in api.pool(DRIVER, "node-1") for d in s.devices}

        await kubelet.wait_for(lambda: bool(taints()["w1"]), what="w1 tainted")
        assert sorted(taints()) == ["w0", "w1", "w2"]
        (taint,) = taints()["w1"]
        assert (taint.key, taint.value, taint.effect) == (
            f"{DRIVER}/health",
            "ECC-error",
            "NoSchedule",
        )
        assert taint.time_added is not None
        assert not taints()["w0"]
        assert not taints()["w2"]
        # Another device's change rewrites the pool's slice: w1's taint keeps its time. The
        # devices stay in their slice, so the generation stays (as upstream's controller keeps
        # it for a one-slice update): no reader finds the pool short while it is written.
        (before,) = api.pool(DRIVER, "node-1")
        plugin.set_health("w2", Health.UNHEALTHY, "gone", Effect.NO_EXECUTE)
        await kubelet.wait_for(lambda: bool(taints()["w2"]), what="w2 tainted")
        (after,) = api.pool(DRIVER, "node-1")
        assert after.resource_version != before.resource_version
        assert after.generation == before.generation
        assert taints()["w1"] == (taint,)
        assert taints()["w2"][0].effect == "NoSchedule"  # NoExecute needs the operator
        plugin.set_health("w1", Health.HEALTHY)
        await kubelet.wait_for(lambda: not taints()["w1"], what="w1's taint removed")
        assert sorted(taints()) == ["w0", "w1", "w2"]


async def test_no_execute_when_the_operator_opts_in_and_advisories_as_none() -> None:
    plugin = StaticPlugin(RESOURCE, widgets(2))
    async with DraNode(plugin, driver=DRIVER, no_execute=True) as node:
        kubelet, api = node.kubelet, node.api
        plugin.set_health("w0", Health.UNHEALTHY, "fell off the bus", Effect.NO_EXECUTE)
        plugin.set_health("w1", Health.HEALTHY, "Xid 43 (GPU stopped processing)", Effect.ADVISORY)

        def effects() -> dict[str, list[tuple[str, str]]]:
            return {
                d.name: [(t.value, t.effect) for t in d.taints]
                for s in api.pool(DRIVER, "node-1")
                for d in s.devices
            }

        await kubelet.wait_for(
            lambda: (
                effects()
                == {
                    "w0": [("fell-off-the-bus", "NoExecute")],
                    "w1": [("Xid-43-GPU-stopped-processing", "None")],
                }
            ),
            what="NoExecute on w0, an advisory on w1",
        )
        assert kubelet.dra.is_registered(DRIVER)


async def test_an_api_server_that_drops_taints_gets_withdrawal_and_one_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """DRADeviceTaints off: the server stores the slice without the taints and says nothing;
    the driver notices on that write, withdraws the tainted device instead, warns once."""
    api = MemoryApi(nodes=["node-1"], device_taints=False)
    plugin = StaticPlugin(RESOURCE, widgets(3))
    async with DraNode(plugin, driver=DRIVER, memory=api) as node:
        kubelet, running = node.kubelet, node.running

        def names() -> list[str]:
            return [d.name for s in api.pool(DRIVER, "node-1") for d in s.devices]

        with caplog.at_level(logging.WARNING, logger="devplugin_sdk"):
            plugin.set_health("w1", Health.UNHEALTHY, "Xid 79")
            await kubelet.wait_for(lambda: names() == ["w0", "w2"], what="w1 withdrawn")
            plugin.set_health("w2", Health.UNHEALTHY, "Xid 79")
            await kubelet.wait_for(lambda: names() == ["w0"], what="w2 withdrawn")
            plugin.set_health("w1", Health.HEALTHY)
            plugin.set_health("w2", Health.HEALTHY)
            await kubelet.wait_for(lambda: names() == ["w0", "w1", "w2"], what="back")
        dropped = [r for r in caplog.records if "dropped the devices' taints" in r.message]
        assert len(dropped) == 1
        assert running.dra is not None
        assert running.dra.taints_dropped


async def _registered(node: DraNode, count: int) -> None:
    """The kubelet has registered the driver ``count`` times, and the pool is complete."""
    kubelet = node.kubelet
    await kubelet.wait_for(
        lambda: len(kubelet.dra.successful_registrations(DRIVER)) >= count,
        what=f"{count} DRA registrations",
    )
    await node.ready()


class CountingPlugin(StaticPlugin):
    """Counts allocate() calls: a repeated prepare must not call it again."""

    allocations = 0

    async def allocate(self, devices):  # type: ignore[no-untyped-def]
        type(self).allocations += 1
        return await super().allocate(devices)


async def test_a_plugin_restart_keeps_prepared_claims_and_the_pool() -> None:
    """Prepared claims come back from the checkpoint: the same answer, no work repeated; the
    restarted driver takes over its slices without withdrawing a device."""
    CountingPlugin.allocations = 0
    async with DraNode(CountingPlugin(RESOURCE, typed_widgets(3)), driver=DRIVER) as node:
        kubelet, api = node.kubelet, node.api
        pod = node.pod("c1", name="pod-a", namespace="ns")
        node.claim("c1", {"r": ["w1"]}, pods=[pod], namespace="ns")
        first = await node.prepare(pod)
        async with node.stopped():
            assert CountingPlugin.allocations == 1
            generation = api.pool(DRIVER, "node-1")[0].generation
            writes = api.calls.get("update_slice", 0) + api.calls.get("create_slice", 0)
        await _registered(node, 2)
        # The kubelet asks again (say it restarted before recording the answer).
        kubelet.dra.forget_prepared()
        again = await kubelet.dra.prepare(pod)
        assert again.claims == first.claims
        assert CountingPlugin.allocations == 1
        assert api.pool(DRIVER, "node-1")[0].generation == generation
        assert api.calls.get("update_slice", 0) + api.calls.get("create_slice", 0) == writes
        await node.unprepare(pod)
        claim = api.claims[("ns", "c1")]
        assert not node.spec_path(claim).exists()


async def test_a_kubelet_restart_re_registers_and_republishes_wiped_slices() -> None:
    """The kubelet deletes its node's slices when it starts and finds the registration socket
    again; the driver answers and writes its slices back."""
    async with DraNode(StaticPlugin(RESOURCE, widgets(2)), driver=DRIVER) as node:
        kubelet, api = node.kubelet, node.api
        pod = node.pod("c1", name="pod-a", namespace="ns")
        node.claim("c1", {"r": ["w0"]}, pods=[pod], namespace="ns")
        await node.prepare(pod)
        await kubelet.restart()
        await _registered(node, 2)
        assert [d.name for d in api.pool(DRIVER, "node-1")[0].devices] == ["w0", "w1"]
        await kubelet.dra.unprepare(pod)  # the claim survived in the kubelet's checkpoint


async def test_each_claim_fails_alone() -> None:
    """A claim that cannot be prepared gets its error; the call and the other claims succeed."""
    import grpc

    from devplugin_sdk._wire.dra_model import ClaimRef
    from devplugin_sdk._wire.dra_service import DraClient

    async with DraNode(StaticPlugin(RESOURCE, widgets(3)), driver=DRIVER) as node:
        api, options = node.api, node.options
        good = api.allocate("ns", "good", {"r": ["w0"]}, driver=DRIVER, pool="node-1")
        other_pool = api.allocate("ns", "far", {"r": ["w1"]}, driver=DRIVER, pool="node-1")
        api.claims[("ns", "far")] = type(other_pool)(
            "ns",
            "far",
            other_pool.uid,
            True,
            (type(other_pool.results[0])("r", DRIVER, "node-2", "w1"),),
        )
        unallocated = api.add_claim("ns", "later")
        refs = [
            ClaimRef("ns", good.uid, "good"),
            ClaimRef("ns", "0000-gone", "gone"),
            ClaimRef("ns", "not-the-uid", "good"),
            ClaimRef("ns", other_pool.uid, "far"),
            ClaimRef("ns", unallocated.uid, "later"),
        ]
        async with grpc.aio.insecure_channel(f"unix:{options.plugin_dir}/dra.sock") as ch:
            for service in ("v1.DRAPlugin", "v1beta1.DRAPlugin"):
                results = await DraClient(ch, service).prepare(refs, timeout=5)
                assert set(results) == {r.uid for r in refs}
                assert not results[good.uid].error
                assert results[good.uid].devices[0].device == "w0"
                # Ours and the status; the API server's reason is in its own words.
                gone = "cannot read ResourceClaim ns/gone: Kubernetes API: 404: "
                assert results["0000-gone"].error.startswith(gone)
                assert "was replaced" in results["not-the-uid"].error
                assert "pool node-2" in results[other_pool.uid].error
                assert "not allocated" in results[unallocated.uid].error
            unknown = await DraClient(ch, "v1.DRAPlugin").unprepare(
                [ClaimRef("ns", "never-prepared", "x")], timeout=5
            )
            assert unknown == {"never-prepared": ""}


async def test_a_device_is_never_prepared_for_two_claims() -> None:
    async with DraNode(StaticPlugin(RESOURCE, widgets(2)), driver=DRIVER) as node:
        a = node.pod("ca", name="a", namespace="ns")
        b = node.pod("cb", name="b", namespace="ns")
        node.claim("ca", {"r": ["w0"]}, pods=[a], namespace="ns")
        await node.prepare(a)
        # A broken scheduler hands w0 out again: the driver is the last line of defence.
        node.api.deallocate("ns", "ca")
        node.claim("cb", {"r": ["w0"]}, pods=[b], namespace="ns")
        from devplugin_sdk.testing import PodPreparationError

        with pytest.raises(PodPreparationError, match="already prepared for claim ns/ca"):
            await node.prepare(b)


async def test_a_kubelet_of_1_32_gets_v1beta1() -> None:
    kubelet_1_32 = {"dra_services": ("v1beta1.DRAPlugin",)}
    plugin = StaticPlugin(RESOURCE, widgets(1))
    async with DraNode(plugin, driver=DRIVER, kubelet_options=kubelet_1_32) as node:
        (registration,) = node.kubelet.dra.successful_registrations(DRIVER)
        assert registration.service == "v1beta1.DRAPlugin"
        pod = node.pod("c", name="p", namespace="ns")
        node.claim("c", {"r": ["w0"]}, pods=[pod], namespace="ns")
        prepared = await node.prepare(pod)
        assert prepared.cdi_ids("c", "r")


async def test_a_removed_registration_socket_is_served_again() -> None:
    async with DraNode(StaticPlugin(RESOURCE, widgets(1)), driver=DRIVER) as node:
        (node.kubelet.registry_directory / f"{DRIVER}-reg.sock").unlink()
        await _registered(node, 2)
        assert node.kubelet.dra.is_registered(DRIVER)


async def test_a_removed_dra_socket_is_served_again_and_registered_again() -> None:
    """Losing dra.sock loses the registration too: both sockets are served anew, the kubelet
    registers the driver again and its calls reach the new socket."""
    async with DraNode(StaticPlugin(RESOURCE, widgets(2)), driver=DRIVER) as node:
        (node.options.resolved_plugin_dir / "dra.sock").unlink()
        await _registered(node, 2)
        pod = node.pod("gpus", name="pod-a")
        node.claim("gpus", {"widgets": ["w0"]}, pods=[pod])
        prepared = await node.prepare(pod)
        assert len(prepared.cdi_ids("gpus")) == 1


async def test_stale_slices_are_replaced_and_big_pools_take_several_slices() -> None:
    """A previous run's extra slices go; 130 devices take three slices of one generation (64
    a slice, whatever their health: a cut that changed with the first taint would move every
    device to another slice)."""
    from devplugin_sdk.dra import ResourceSlice, SliceDevice

    api = MemoryApi(nodes=["node-1"])
    async with FakeKubelet(dra_api=api) as kubelet:
        # A previous run of the driver left three slices (the kubelet did not restart since).
        for i in range(3):
            await api.create_slice(
                ResourceSlice("", DRIVER, "node-1", "node-1", 7, 3, (SliceDevice(f"old{i}"),))
            )
        async with DraNode(StaticPlugin(RESOURCE, widgets(130)), driver=DRIVER, kubelet=kubelet):
            pool = api.pool(DRIVER, "node-1")
            assert len(api.slices) == 3
            assert sorted(len(s.devices) for s in pool) == [2, 64, 64]
            assert {s.generation for s in pool} == {8}
            assert {s.slice_count for s in pool} == {3}


async def test_the_api_refusing_is_retried_and_reported() -> None:
    api = MemoryApi(nodes=["node-1"])
    async with FakeKubelet(dra_api=api) as kubelet:
        api.fail_next(0, "connection refused", times=2)
        plugin = StaticPlugin(RESOURCE, widgets(2))
        async with DraNode(plugin, driver=DRIVER, kubelet=kubelet) as node:
            running = node.running
            assert running.dra is not None
            assert running.dra.last_error is None
            assert running.dra.published == 2


async def test_both_apis_never_hand_out_one_device_twice() -> None:
    """api both: each device goes one way (Dra.devices); the device plugin neither lists nor
    allocates a DRA device, and a DRA device's health reaches DRA only."""
    import grpc

    plugin = StaticPlugin(RESOURCE, widgets(4))
    async with DraNode(
        plugin,
        driver=DRIVER,
        device_plugin_api=True,
        devices=lambda resource, d: d.id in ("w2", "w3"),
    ) as node:
        kubelet, api, running = node.kubelet, node.api, node.running
        await kubelet.wait_for_allocatable(RESOURCE, 2)
        assert sorted(kubelet.devices(RESOURCE)) == ["w0", "w1"]
        assert [d.name for d in api.pool(DRIVER, "node-1")[0].devices] == ["w2", "w3"]
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await kubelet.call_allocate(RESOURCE, ["w2"])
        assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "w2" in (refused.value.details() or "")
        got = await kubelet.allocate(RESOURCE, 2)
        assert sorted(got.device_ids) == ["w0", "w1"]
        plugin.set_health("w3", Health.UNHEALTHY)
        await kubelet.wait_for(
            lambda: (
                [(d.name, bool(d.taints)) for d in api.pool(DRIVER, "node-1")[0].devices]
                == [("w2", False), ("w3", True)]
            ),
            what="w3 tainted in DRA",
        )
        assert kubelet.allocatable(RESOURCE) == 2
        (status,) = running.statuses()
        assert status.registered  # the device-plugin registration, with its stream


async def test_healthz_follows_the_dra_registration() -> None:
    """/healthz judges a DRA-only plugin by the driver's registration (it has no stream)."""
    import http.client

    import anyio
    from prometheus_client import CollectorRegistry

    from devplugin_sdk.runner import Http

    def get(port: int) -> int:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        try:
            conn.request("GET", "/healthz")
            return conn.getresponse().status
        finally:
            conn.close()

    endpoints = Http(port=0, host="127.0.0.1", registry=CollectorRegistry())
    plugin = StaticPlugin(RESOURCE, widgets(1))
    async with DraNode(plugin, driver=DRIVER, http=endpoints) as node:
        kubelet, running = node.kubelet, node.running
        assert running.http_port is not None
        await kubelet.wait_for(lambda: running.statuses()[0].registered, what="registered")
        assert await anyio.to_thread.run_sync(get, running.http_port) == 200


async def test_api_and_dra_must_agree() -> None:
    from devplugin_sdk.dra import Dra
    from devplugin_sdk.runner import serve

    plugin = StaticPlugin(RESOURCE, widgets(1))
    with pytest.raises(ValueError, match="needs dra="):
        await serve(plugin, api="dra")
    with pytest.raises(ValueError, match="api is devicePlugin"):
        await serve(plugin, dra=Dra(driver=DRIVER, node_name="n"))
    with pytest.raises(ValueError, match="node's name"):
        await serve(plugin, api="dra", dra=Dra(driver=DRIVER, api=MemoryApi()))
    with pytest.raises(ValueError, match="invalid DRA driver name"):
        Dra(driver="Not_A_Domain")


def test_device_names_are_dns_labels_stable_across_runs() -> None:
    from devplugin_sdk import _names
    from devplugin_sdk.dra import device_name

    ids = ["GPU-8ca8c6b5-7df1", "ttyUSB0", "GPU-1::2", "MIG-GPU-1/1/0", "x" * 80, "::", "w0"]
    names = [device_name(i) for i in ids]
    assert names[0] == "gpu-8ca8c6b5-7df1"
    assert names[1] == "ttyusb0"
    assert names[6] == "w0"
    assert names[2].startswith("gpu-1-2-")
    assert len(names[2]) == len("gpu-1-2-") + 8
    assert all(_names.device_name_problem(n) is None for n in names)
    assert len(set(names)) == len(names)
    assert [device_name(i) for i in ids] == names


async def test_a_reload_withdraws_no_device_the_new_plugin_still_has(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A changed plugin is stopped before its replacement discovers: the pool keeps its devices
    meanwhile (DETACH_GRACE) instead of dropping and publishing them again."""
    import anyio

    from devplugin_sdk.runner import Reload

    api = MemoryApi(nodes=["node-1"])
    first = StaticPlugin(RESOURCE, widgets(2))
    second = StaticPlugin(RESOURCE, widgets(3))
    second.revision = 2  # type: ignore[attr-defined]  # a different fingerprint
    current = [first]
    config = tmp_path / "config.yaml"
    config.write_text("1")
    sizes: list[int] = []

    async def record() -> None:
        seen = api.generation
        while True:
            seen = await api.wait_changed(seen)
            sizes.append(sum(len(s.devices) for s in api.pool(DRIVER, "node-1")))

    reload = Reload(lambda: list(current), config, sighup=False)
    async with DraNode(first, driver=DRIVER, memory=api, reload=reload) as node:
        kubelet = node.kubelet
        async with anyio.create_task_group() as tg:
            tg.start_soon(record)
            current[0] = second
            # Write then rename, as a ConfigMap update does (the directory is watched).
            (tmp_path / "next.yaml").write_text("2")
            (tmp_path / "next.yaml").replace(config)
            await kubelet.wait_for(
                lambda: sum(len(s.devices) for s in api.pool(DRIVER, "node-1")) == 3,
                timeout=10,
                what="the new plugin's devices",
            )
            tg.cancel_scope.cancel()
    assert sizes
    assert min(sizes) >= 2, sizes
