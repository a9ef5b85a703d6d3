"""Stale prepared claims unprepared at start and every cleanup period; an unreachable API
unprepares nothing; a corrupt checkpoint becomes a Node Event and a metric while the driver
serves (FakeKubelet's DRA side over real gRPC, MemoryApi, and the loopback API server)."""

from __future__ import annotations

import logging
from pathlib import Path

import anyio
import pytest
from dra_helpers import DRIVER
from kube_apiserver import FakeApiServer
from prometheus_client import CollectorRegistry
from sdk_helpers import RESOURCE, widgets

from devplugin_sdk.dra._kube import LightkubeApi
from devplugin_sdk.kubelet.fake_dra import DraPod
from devplugin_sdk.metrics import PrometheusObserver
from devplugin_sdk.testing import DaemonSetPod, DraNode, MemoryApi, StaticPlugin

NODE = "node-1"


async def prepare_one(node: DraNode, claim: str, device: str) -> DraPod:
    pod = node.pod(claim)
    node.claim(claim, {"widgets": [device]}, pods=[pod])
    await node.prepare(pod)
    return pod


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, labels) or 0.0


async def test_a_claim_deleted_from_the_api_is_unprepared_within_one_period(
    caplog: pytest.LogCaptureFixture,
) -> None:
    registry = CollectorRegistry()
    async with DraNode(
        StaticPlugin(RESOURCE, widgets(3)),
        driver=DRIVER,
        cleanup_interval=0.2,
        observer=PrometheusObserver(registry),
    ) as node:
        kubelet, api, running = node.kubelet, node.api, node.running
        await prepare_one(node, "kept", "w0")
        await prepare_one(node, "doomed", "w1")
        kept = api.claims[("default", "kept")].uid
        doomed = api.claims[("default", "doomed")].uid
        assert node.spec_path(doomed).exists()
        with caplog.at_level(logging.WARNING, logger="devplugin_sdk"):
            api.delete_claim("default", "doomed")  # force-deleted: no unprepare comes
            await kubelet.wait_for(
                lambda: not node.spec_path(doomed).exists(), what="doomed unprepared"
            )
        assert running.dra is not None
        assert running.dra.prepared_claims == 1
        assert running.dra.stale_claims_unprepared == 1
        assert node.spec_path(kept).exists()
        (line,) = [r.message for r in caplog.records if "stale claim" in r.message]
        assert "default/doomed" in line
        assert "no longer exists" in line
        assert (
            sample(
                registry,
                "devplugin_dra_stale_claims_unprepared_total",
                driver=DRIVER,
                reason="gone",
            )
            == 1.0
        )
        # The device is free again: the scheduler's next claim for it prepares.
        await prepare_one(node, "next", "w1")


async def test_replaced_and_unreserved_claims_are_unprepared_with_their_reason() -> None:
    registry = CollectorRegistry()
    async with DraNode(
        StaticPlugin(RESOURCE, widgets(3)),
        driver=DRIVER,
        cleanup_interval=0.2,
        observer=PrometheusObserver(registry),
    ) as node:
        kubelet, api, running = node.kubelet, node.api, node.running
        await prepare_one(node, "replaced", "w0")
        await prepare_one(node, "finished", "w1")
        old = api.claims[("default", "replaced")].uid
        api.delete_claim("default", "replaced")
        api.add_claim("default", "replaced")  # a new object under the old name
        api.deallocate("default", "finished")  # its pod is gone: reserved for no pod
        await kubelet.wait_for(
            # Counted once each unprepare has answered (its status cleared): wait for both.
            lambda: running.dra is not None and running.dra.stale_claims_unprepared == 2,
            what="both unprepared",
        )
        assert running.dra is not None
        assert running.dra.prepared_claims == 0
        assert not node.spec_path(old).exists()
        for reason in ("replaced", "unreserved"):
            assert (
                sample(
                    registry,
                    "devplugin_dra_stale_claims_unprepared_total",
                    driver=DRIVER,
                    reason=reason,
                )
                == 1.0
            )


async def test_claims_deleted_while_the_driver_was_down_are_unprepared_by_the_first_sweeps() -> (
    None
):
    # Issue 36 row 1: the sweep at start and the next one, a period later, must both find it
    # gone (it was unprepared by the start's sweep alone).
    plugin = StaticPlugin(RESOURCE, widgets(2))
    async with DraNode(plugin, driver=DRIVER, cleanup_interval=0.2, ready=False) as node:
        kubelet, api = node.kubelet, node.api
        await node.ready()
        await prepare_one(node, "gone", "w0")
        async with node.stopped():
            uid = api.claims[("default", "gone")].uid
            api.delete_claim("default", "gone")
            assert node.spec_path(uid).exists()
        running = node.running
        await kubelet.wait_for(
            lambda: not node.spec_path(uid).exists(), what="unprepared by the first two sweeps"
        )
        assert running.dra is not None
        assert running.dra.prepared_claims == 0


@pytest.mark.parametrize(
    ("status", "why"), [(0, "unreachable"), (500, "etcd timeout"), (403, "forbidden")]
)
async def test_an_api_that_cannot_answer_unprepares_nothing(status: int, why: str) -> None:
    """Only a 404 (or another UID, or no reservation) proves a claim stale: while the API is
    unreachable or refusing, every sweep keeps every claim."""
    plugin = StaticPlugin(RESOURCE, widgets(2))
    async with DraNode(plugin, driver=DRIVER, cleanup_interval=0.05) as node:
        kubelet, api, running = node.kubelet, node.api, node.running
        await prepare_one(node, "held", "w0")
        uid = api.claims[("default", "held")].uid
        api.delete_claim("default", "held")
        reads = api.calls.get("read_claim", 0)
        api.fail_next(status, why, times=1_000_000)
        await kubelet.wait_for(
            lambda: api.calls.get("read_claim", 0) >= reads + 5, what="five sweeps"
        )
        assert node.spec_path(uid).exists()
        assert running.dra is not None
        assert running.dra.prepared_claims == 1
        assert running.dra.stale_claims_unprepared == 0
        api.clear_failures()  # the API answers again: the claim is gone
        await kubelet.wait_for(
            lambda: not node.spec_path(uid).exists(), what="unprepared once it answers"
        )


async def test_a_corrupt_checkpoint_yields_a_node_event_and_a_metric_and_the_driver_serves(
    tmp_path: Path,
) -> None:
    api = MemoryApi(nodes=[NODE])
    registry = CollectorRegistry()
    async with FakeApiServer(api).serving() as server:
        client = LightkubeApi.connect(server.kubeconfig(tmp_path / "kubeconfig"))
        try:
            # The node first, the driver after the checkpoint is damaged.
            node = DraNode(driver=DRIVER, memory=api, api=client)
            async with node, anyio.create_task_group() as tg:
                kubelet, options = node.kubelet, node.options
                checkpoint = options.resolved_plugin_dir / "checkpoint.json"
                checkpoint.parent.mkdir(parents=True, mode=0o700)
                checkpoint.write_bytes(b'{"format": 1, "claims": {"x": ')  # cut off mid-write
                checkpoint.chmod(0o600)
                pod = DaemonSetPod(
                    StaticPlugin(RESOURCE, widgets(2)),
                    settings=kubelet.settings(pod_uid=""),
                    api="dra",
                    dra=options,
                    observer=PrometheusObserver(registry),
                )
                running = await pod.start(tg)
                await kubelet.wait_for(lambda: bool(api.events), what="the Node event")
                (event,) = api.events
                assert (event.node_name, event.node_uid) == (NODE, api.nodes[NODE])
                assert (event.reason, event.type, event.component) == (
                    "CheckpointCorrupted",
                    "Warning",
                    DRIVER,
                )
                assert str(checkpoint) in event.message
                assert "checkpoint.json.corrupt" in event.message
                assert "Expecting value" in event.message  # the cause
                (posted,) = server.events
                assert posted["metadata"]["namespace"] == "default"
                assert posted["involvedObject"]["kind"] == "Node"
                assert (
                    sample(registry, "devplugin_dra_checkpoint_corrupted_total", driver=DRIVER)
                    == 1.0
                )
                assert running.dra is not None
                assert running.dra.checkpoint_corrupted == 1
                # ... and serves: registered, and a claim prepares.
                await node.ready()
                await prepare_one(node, "after", "w0")
                assert checkpoint.with_name("checkpoint.json.corrupt").exists()
                await pod.stop()
        finally:
            await client.aclose()


def test_sweeps_of_a_fleet_are_spread_not_in_step(tmp_path: Path) -> None:
    # Issue 29: a thousand nodes started together read their claims at different times.
    from devplugin_sdk.dra._claims.checkpoint import Checkpoint
    from devplugin_sdk.dra._claims.cleanup import Cleanup
    from devplugin_sdk.dra._claims.store import Store

    async def unprepare(refs: object) -> dict[str, str]:
        return {}

    api = MemoryApi(nodes=["node-1"])
    store = Store(Checkpoint(tmp_path / "checkpoint.json"))
    cleanup = Cleanup(DRIVER, api, store, unprepare, interval=600.0)
    delays = [cleanup.next_delay() for _ in range(200)]
    assert all(480.0 <= d <= 720.0 for d in delays)
    assert max(delays) - min(delays) > 120.0, "the sweeps keep in step"
