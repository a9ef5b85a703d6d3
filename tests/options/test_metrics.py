"""PrometheusObserver: the series a served plugin produces, read from a real registry and /metrics."""

from __future__ import annotations

import http.client
import sys
from collections.abc import Sequence

import anyio
import anyio.to_thread
import pytest
from prometheus_client import CollectorRegistry
from sdk_helpers import RESOURCE, widgets

from devplugin_sdk import Allocation, Device, Health, MissingDependencyError
from devplugin_sdk.metrics import (
    MAX_HEALTH_REASONS,
    PrometheusObserver,
    health_reason,
    reregister_reason,
)
from devplugin_sdk.runner import Http
from devplugin_sdk.testing import AdmissionError, FakeKubelet, StaticPlugin, serving


class _Refusing(StaticPlugin):
    refuse = False

    async def allocate(self, devices: Sequence[Device]) -> Allocation:
        if self.refuse:
            raise RuntimeError("boom")
        return await super().allocate(devices)


def value(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, {"resource": RESOURCE, **labels})


async def scrape(port: int) -> str:
    def call() -> str:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        try:
            conn.request("GET", "/metrics")
            response = conn.getresponse()
            assert response.status == 200
            return response.read().decode()
        finally:
            conn.close()

    return await anyio.to_thread.run_sync(call)


async def test_counts_registrations_restarts_sends_and_allocations(kubelet: FakeKubelet) -> None:
    registry = CollectorRegistry()
    observer = PrometheusObserver(registry)
    plugin = _Refusing(RESOURCE, widgets(2))
    http = Http(port=0, host="127.0.0.1", registry=registry)
    async with serving(
        plugin, settings=kubelet.settings(), observer=observer, http=http
    ) as running:
        port = running.http_port
        assert port is not None
        await kubelet.wait_for_allocatable(RESOURCE, 2)
        kubelet.release(await kubelet.allocate(RESOURCE, 1))
        plugin.refuse = True
        with pytest.raises(AdmissionError, match="boom"):
            await kubelet.allocate(RESOURCE, 1, pod="p2")
        await kubelet.restart()
        await kubelet.wait_for(
            lambda: value(registry, "devplugin_registrations_total") == 2,
            what="a second registration counted",
        )
        await kubelet.wait_for_allocatable(RESOURCE, 2)
        text = await scrape(port)

    assert value(registry, "devplugin_kubelet_restarts_total") == 1
    assert value(registry, "devplugin_reregistrations_total", reason="kubelet_restart") == 1
    assert value(registry, "devplugin_reregistrations_total", reason="stream_lost") == 0
    assert value(registry, "devplugin_registration_seconds_count") == 2
    sends = value(registry, "devplugin_list_and_watch_sends_total")
    assert sends is not None
    assert sends >= 2  # one per registration at least
    assert value(registry, "devplugin_allocations_total") == 2
    assert value(registry, "devplugin_allocation_seconds_count") == 2
    assert value(registry, "devplugin_allocation_errors_total", code="INTERNAL") == 1
    assert value(registry, "devplugin_devices", health="Healthy") == 2
    for line in (
        f'devplugin_registrations_total{{resource="{RESOURCE}"}} 2.0',
        f'devplugin_kubelet_restarts_total{{resource="{RESOURCE}"}} 1.0',
        f'devplugin_allocations_total{{resource="{RESOURCE}"}} 2.0',
        f'devplugin_allocation_errors_total{{code="INTERNAL",resource="{RESOURCE}"}} 1.0',
        f'devplugin_allocation_seconds_bucket{{le="10.0",resource="{RESOURCE}"}} 2.0',
        f'devplugin_list_and_watch_sends_total{{resource="{RESOURCE}"}}',
        f'devplugin_registered{{resource="{RESOURCE}"}} 1.0',
    ):
        assert line in text


async def test_devices_gauge_follows_health_changes(kubelet: FakeKubelet) -> None:
    registry = CollectorRegistry()
    plugin = StaticPlugin(RESOURCE, widgets(3))
    async with serving(plugin, settings=kubelet.settings(), observer=PrometheusObserver(registry)):
        await kubelet.wait_for_allocatable(RESOURCE, 3)
        plugin.set_health("w0", Health.UNHEALTHY)
        plugin.set_health("w2", Health.UNHEALTHY)
        await kubelet.wait_for(
            lambda: value(registry, "devplugin_devices", health="Unhealthy") == 2,
            what="two unhealthy devices counted",
        )
        assert value(registry, "devplugin_devices", health="Healthy") == 1
        plugin.set_health("w0", Health.HEALTHY)
        await kubelet.wait_for(
            lambda: value(registry, "devplugin_devices", health="Unhealthy") == 1,
            what="one unhealthy device counted",
        )
        assert value(registry, "devplugin_devices", health="Healthy") == 2


async def test_an_unhealthy_device_is_labelled_with_why_until_it_is_back(
    kubelet: FakeKubelet,
) -> None:
    registry = CollectorRegistry()
    plugin = StaticPlugin(RESOURCE, widgets(2))
    async with serving(plugin, settings=kubelet.settings(), observer=PrometheusObserver(registry)):
        await kubelet.wait_for_allocatable(RESOURCE, 2)
        plugin.set_health("w1", Health.UNHEALTHY, "Xid 79 (GPU has fallen off the bus)")
        await kubelet.wait_for_allocatable(RESOURCE, 1)
        out = value(registry, "devplugin_device_unhealthy", device="w1", reason="xid_79")
        changes = value(
            registry, "devplugin_health_changes_total", health="Unhealthy", reason="xid_79"
        )
        plugin.set_health("w1", Health.HEALTHY, "recovered: clean for 60 s")
        await kubelet.wait_for_allocatable(RESOURCE, 2)
    assert (out, changes) == (1, 1)
    assert value(registry, "devplugin_device_unhealthy", device="w1", reason="xid_79") is None
    assert (
        value(registry, "devplugin_health_changes_total", health="Healthy", reason="recovered") == 1
    )


def test_a_device_that_leaves_the_list_leaves_the_unhealthy_gauge() -> None:
    registry = CollectorRegistry()
    observer = PrometheusObserver(registry)
    observer.health_changed(RESOURCE, "w0", Health.UNHEALTHY, "discovered")
    observer.health_changed(RESOURCE, "w0", None, "removed")
    assert value(registry, "devplugin_device_unhealthy", device="w0", reason="discovered") is None
    assert (
        value(registry, "devplugin_health_changes_total", health="Unhealthy", reason="discovered")
        == 1
    )


def test_health_reasons_beyond_the_cap_are_counted_as_other() -> None:
    registry = CollectorRegistry()
    observer = PrometheusObserver(registry)
    for n in range(MAX_HEALTH_REASONS + 2):
        observer.health_changed(RESOURCE, f"w{n}", Health.UNHEALTHY, f"cause {n}: details")
    last = MAX_HEALTH_REASONS + 1
    assert value(registry, "devplugin_device_unhealthy", device="w0", reason="cause_0") == 1
    assert value(registry, "devplugin_device_unhealthy", device=f"w{last}", reason="other") == 1
    assert (
        value(registry, "devplugin_health_changes_total", health="Unhealthy", reason="other") == 2
    )


@pytest.mark.parametrize(
    ("reason", "label"),
    [
        ("Xid 79 (GPU has fallen off the bus)", "xid_79"),
        ("uncorrected ECC errors rising: 3 -> 7 (volatile)", "uncorrected_ecc_errors_rising"),
        ("double-bit ECC error", "double_bit_ecc_error"),
        ("polled", "polled"),
        ("", "unspecified"),
        (": no cause", "unspecified"),
        ("x" * 60, "x" * 48),
    ],
)
def test_health_reasons_map_to_their_cause(reason: str, label: str) -> None:
    assert health_reason(reason) == label


async def test_registered_gauge_follows_the_kubelet_going_and_coming_back(
    kubelet: FakeKubelet,
) -> None:
    registry = CollectorRegistry()
    plugin = StaticPlugin(RESOURCE, widgets(1))
    async with serving(plugin, settings=kubelet.settings(), observer=PrometheusObserver(registry)):
        await kubelet.wait_for_allocatable(RESOURCE, 1)
        assert value(registry, "devplugin_registered") == 1
        assert value(registry, "devplugin_list_and_watch_streams") == 1
        assert value(registry, "devplugin_list_pending_seconds") == 0
        await kubelet.stop()
        await kubelet.wait_for(
            lambda: value(registry, "devplugin_registered") == 0, what="registered gauge at 0"
        )
        assert value(registry, "devplugin_list_and_watch_streams") == 0
        await kubelet.start()
        await kubelet.wait_for(
            lambda: value(registry, "devplugin_registered") == 1, what="registered gauge at 1"
        )
    assert value(registry, "devplugin_kubelet_restarts_total") == 1
    assert value(registry, "devplugin_registered") is None  # no longer served


def test_series_appear_at_zero_on_a_resources_first_event() -> None:
    registry = CollectorRegistry()
    observer = PrometheusObserver(registry)
    assert value(registry, "devplugin_allocations_total") is None
    observer.list_sent(RESOURCE, 4, 0)
    assert value(registry, "devplugin_list_and_watch_sends_total") == 1
    assert value(registry, "devplugin_devices", health="Healthy") == 4
    assert value(registry, "devplugin_devices", health="Unhealthy") == 0
    assert value(registry, "devplugin_allocations_total") == 0
    assert value(registry, "devplugin_registrations_total") == 0
    assert value(registry, "devplugin_kubelet_restarts_total") == 0
    for reason in ("kubelet_restart", "stream_lost", "other"):
        assert value(registry, "devplugin_reregistrations_total", reason=reason) == 0


def test_rpc_errors_are_counted_by_rpc_and_code() -> None:
    registry = CollectorRegistry()
    observer = PrometheusObserver(registry)
    observer.rpc_error(RESOURCE, "GetPreferredAllocation", "DEADLINE_EXCEEDED")
    observer.rpc_error(RESOURCE, "GetPreferredAllocation", "DEADLINE_EXCEEDED")
    observer.rpc_error(RESOURCE, "PreStartContainer", "INTERNAL")
    get = registry.get_sample_value
    labels = {"resource": RESOURCE, "rpc": "GetPreferredAllocation", "code": "DEADLINE_EXCEEDED"}
    assert get("devplugin_rpc_errors_total", labels) == 2
    labels = {"resource": RESOURCE, "rpc": "PreStartContainer", "code": "INTERNAL"}
    assert get("devplugin_rpc_errors_total", labels) == 1


def test_only_kubelet_restarts_count_as_restarts() -> None:
    registry = CollectorRegistry()
    observer = PrometheusObserver(registry)
    observer.reregistering(RESOURCE, "no ListAndWatch stream for 5.2s while the kubelet is up")
    observer.reregistering(RESOURCE, "our socket was removed (kubelet restart)")
    assert value(registry, "devplugin_reregistrations_total", reason="stream_lost") == 1
    assert value(registry, "devplugin_reregistrations_total", reason="kubelet_restart") == 1
    assert value(registry, "devplugin_kubelet_restarts_total") == 1


@pytest.mark.parametrize(
    ("reason", "label"),
    [
        ("our socket was removed (kubelet restart)", "kubelet_restart"),
        ("kubelet.sock was recreated (kubelet restart)", "kubelet_restart"),
        ("no ListAndWatch stream for 5.0s while the kubelet is up", "stream_lost"),
        ("something new", "other"),
    ],
)
def test_reregister_reasons_map_to_a_fixed_label_set(reason: str, label: str) -> None:
    assert reregister_reason(reason) == label


def test_two_observers_on_one_registry_are_refused() -> None:
    registry = CollectorRegistry()
    PrometheusObserver(registry)
    before = sorted(metric.name for metric in registry.collect())
    # prometheus_client's ValueError, in its own words: what is ours is when it comes.
    with pytest.raises(ValueError):  # noqa: PT011 - the cause is shown below, not its wording
        PrometheusObserver(registry)
    assert sorted(metric.name for metric in registry.collect()) == before
    PrometheusObserver(CollectorRegistry())  # the shared registry was the cause


def test_missing_prometheus_client_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    with pytest.raises(MissingDependencyError, match=r"devplugin-sdk\[metrics\]"):
        PrometheusObserver()
