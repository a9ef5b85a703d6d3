"""Stale prepared claims unprepared at start and every cleanup period; an unreachable API
unprepares nothing; a corrupt checkpoint becomes a Node Event and a metric while the driver
serves (FakeKubelet's DRA side over real gRPC, MemoryApi, and the loopback API server)."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest
from dra_helpers import DRIVER, dra_options
from kube_apiserver import FakeApiServer
from prometheus_client import CollectorRegistry
from sdk_helpers import RESOURCE, widgets

from devplugin_sdk.dra import Dra
from devplugin_sdk.dra._kube import LightkubeApi
from devplugin_sdk.kubelet.fake_dra import DraPod
from devplugin_sdk.metrics import PrometheusObserver
from devplugin_sdk.testing import FakeKubelet, MemoryApi, StaticPlugin, serving

NODE = "node-1"


def spec_path(options: Dra, uid: str) -> Path:
    return options.cdi_dir / f"k8s.{DRIVER}-claim_{uid}.json"


async def prepare_one(kubelet: FakeKubelet, api: MemoryApi, claim: str, device: str) -> DraPod:
    await kubelet.wait_for(lambda: api.pool_complete(DRIVER, NODE), what="slices")
    await kubelet.wait_for(lambda: kubelet.dra.is_registered(DRIVER), what="registered")
    pod = kubelet.dra.pod("default", f"pod-{claim}", [claim])
    api.allocate("default", claim, {"widgets": [device]}, driver=DRIVER, pool=NODE, pods=[pod.uid])
    await kubelet.dra.prepare(pod)
    return pod


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, labels) or 0.0


async def test_a_claim_deleted_from_the_api_is_unprepared_within_one_period(
    caplog: pytest.LogCaptureFixture,
) -> None:
    api = MemoryApi(nodes=[NODE])
    registry = CollectorRegistry()
    async with FakeKubelet(dra_api=api) as kubelet:
        options = dataclasses.replace(dra_options(kubelet, api), cleanup_interval=0.2)
        async with serving(
            StaticPlugin(RESOURCE, widgets(3)),
            settings=kubelet.settings(),
            api="dra",
            dra=options,
            observer=PrometheusObserver(registry),
        ) as running:
            await prepare_one(kubelet, api, "kept", "w0")
            await prepare_one(kubelet, api, "doomed", "w1")
            kept = api.claims[("default", "kept")].uid
            doomed = api.claims[("default", "doomed")].uid
            assert spec_path(options, doomed).exists()
            with caplog.at_level(logging.WARNING, logger="devplugin_sdk"):
                api.delete_claim("default", "doomed")  # force-deleted: no unprepare comes
                await kubelet.wait_for(
                    lambda: not spec_path(options, doomed).exists(), what="doomed unprepared"
                )
            assert running.dra is not None
            assert running.dra.prepared_claims == 1
            assert running.dra.stale_claims_unprepared == 1
            assert spec_path(options, kept).exists()
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
            await prepare_one(kubelet, api, "next", "w1")


async def test_replaced_and_unreserved_claims_are_unprepared_with_their_reason() -> None:
    api = MemoryApi(nodes=[NODE])
    registry = CollectorRegistry()
    async with FakeKubelet(dra_api=api) as kubelet:
        options = dataclasses.replace(dra_options(kubelet, api), cleanup_interval=0.2)
        async with serving(
            StaticPlugin(RESOURCE, widgets(3)),
            settings=kubelet.settings(),
            api="dra",
            dra=options,
            observer=PrometheusObserver(registry),
        ) as running:
            await prepare_one(kubelet, api, "replaced", "w0")
            await prepare_one(kubelet, api, "finished", "w1")
            old = api.claims[("default", "replaced")].uid
            api.delete_claim("default", "replaced")
            api.add_claim("default", "replaced")  # a new object under the old name
            api.deallocate("default", "finished")  # its pod is gone: reserved for no pod
            await kubelet.wait_for(
                lambda: running.dra is not None and running.dra.prepared_claims == 0,
                what="both unprepared",
            )
            assert not spec_path(options, old).exists()
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


async def test_claims_deleted_while_the_driver_was_down_are_unprepared_at_start() -> None:
    api = MemoryApi(nodes=[NODE])
    async with FakeKubelet(dra_api=api) as kubelet:
        options = dataclasses.replace(dra_options(kubelet, api), cleanup_interval=3600)
        plugin = StaticPlugin(RESOURCE, widgets(2))
        async with serving(plugin, settings=kubelet.settings(), api="dra", dra=options):
            await prepare_one(kubelet, api, "gone", "w0")
        uid = api.claims[("default", "gone")].uid
        api.delete_claim("default", "gone")
        assert spec_path(options, uid).exists()
        async with serving(plugin, settings=kubelet.settings(), api="dra", dra=options) as running:
            await kubelet.wait_for(
                lambda: not spec_path(options, uid).exists(), what="unprepared at start"
            )
            assert running.dra is not None
            assert running.dra.prepared_claims == 0


@pytest.mark.parametrize(
    ("status", "why"), [(0, "unreachable"), (500, "etcd timeout"), (403, "forbidden")]
)
async def test_an_api_that_cannot_answer_unprepares_nothing(status: int, why: str) -> None:
    """Only a 404 (or another UID, or no reservation) proves a claim stale: while the API is
    unreachable or refusing, every sweep keeps every claim."""
    api = MemoryApi(nodes=[NODE])
    async with FakeKubelet(dra_api=api) as kubelet:
        options = dataclasses.replace(dra_options(kubelet, api), cleanup_interval=0.05)
        async with serving(
            StaticPlugin(RESOURCE, widgets(2)), settings=kubelet.settings(), api="dra", dra=options
        ) as running:
            await prepare_one(kubelet, api, "held", "w0")
            uid = api.claims[("default", "held")].uid
            api.delete_claim("default", "held")
            reads = api.calls.get("read_claim", 0)
            api.fail_next(status, why, times=1_000_000)
            await kubelet.wait_for(
                lambda: api.calls.get("read_claim", 0) >= reads + 5, what="five sweeps"
            )
            assert spec_path(options, uid).exists()
            assert running.dra is not None
            assert running.dra.prepared_claims == 1
            assert running.dra.stale_claims_unprepared == 0
            api.clear_failures()  # the API answers again: the claim is gone
            await kubelet.wait_for(
                lambda: not spec_path(options, uid).exists(), what="unprepared once it answers"
            )


async def test_a_corrupt_checkpoint_yields_a_node_event_and_a_metric_and_the_driver_serves(
    tmp_path: Path,
) -> None:
    api = MemoryApi(nodes=[NODE])
    registry = CollectorRegistry()
    async with FakeApiServer(api).serving() as server, FakeKubelet(dra_api=api) as kubelet:
        client = LightkubeApi.connect(server.kubeconfig(tmp_path / "kubeconfig"))
        options = dra_options(kubelet, api, api=client)
        checkpoint = options.resolved_plugin_dir / "checkpoint.json"
        checkpoint.parent.mkdir(parents=True, mode=0o700)
        checkpoint.write_bytes(b'{"format": 1, "claims": {"x": ')  # cut off mid-write
        checkpoint.chmod(0o600)
        try:
            async with serving(
                StaticPlugin(RESOURCE, widgets(2)),
                settings=kubelet.settings(),
                api="dra",
                dra=options,
                observer=PrometheusObserver(registry),
            ) as running:
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
                await kubelet.wait_for(lambda: kubelet.dra.is_registered(DRIVER), what="registered")
                await prepare_one(kubelet, api, "after", "w0")
                assert checkpoint.with_name("checkpoint.json.corrupt").exists()
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
