"""Prometheus metrics for served plugins: ``PrometheusObserver`` turns lifecycle events into series.

Pass it as ``observer=`` to ``serve``/``run`` (with ``http=`` and no observer the runner makes
one); the runner's HTTP endpoints expose the registry on ``/metrics``. Every series is named
``devplugin_*`` and labelled with the ``resource``; the list, with what each one answers, is
docs/metrics.md. Needs the ``metrics`` extra (prometheus-client),
imported when an observer is made, so ``import devplugin_sdk.metrics`` itself never fails.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Iterator, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

from devplugin_sdk.errors import MissingDependencyError
from devplugin_sdk.observe import PluginStatus
from devplugin_sdk.types import Health

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

__all__ = [
    "ALLOCATION_BUCKETS",
    "MAX_HEALTH_REASONS",
    "MAX_UNHEALTHY_DEVICE_SERIES",
    "REGISTRATION_BUCKETS",
    "PrometheusObserver",
    "health_reason",
    "reregister_reason",
]

#: Allocate latency buckets, seconds: a merge of declared nodes takes well under a millisecond;
#: the SDK's hook timeout (Settings.hook_timeout) is 8 s, and the kubelet sets none.
ALLOCATION_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
)

#: Register latency buckets, seconds: the kubelet dials back inside Register (up to 10 s), and the
#: SDK's Register deadline is 20 s by default.
REGISTRATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20)

# Label values of devplugin_reregistrations_total{reason}: a fixed set, never the free text
# (which carries durations and would make a new series per message).
_REASONS = ("kubelet_restart", "stream_lost", "other")
_HEALTH_STATES = ("Healthy", "Unhealthy")

#: At most this many ``reason`` label values per resource for health changes; later causes are
#: counted as ``other``, so that a backend that puts values in its reasons cannot grow the
#: number of series without bound.
MAX_HEALTH_REASONS = 32
_HEALTH_REASON_CHARS = 48

#: At most this many ``devplugin_device_unhealthy`` series per resource; further Unhealthy
#: devices are counted in ``devplugin_devices_unhealthy_unlabelled`` (and get a series of their
#: own when one frees up), so that a node with tens of thousands of devices out (shared
#: replicas) renders a scrape of kilobytes, not megabytes, on the event loop.
MAX_UNHEALTHY_DEVICE_SERIES = 256


def reregister_reason(reason: str) -> str:
    """Map the lifecycle's free-text reason for a lost registration to a label value.

    Args:
        reason: The text ``Observer.reregistering`` received.

    Returns:
        ``kubelet_restart`` (our socket removed or ``kubelet.sock`` recreated), ``stream_lost``
        (the kubelet closed ListAndWatch and stayed up) or ``other``.
    """
    if "kubelet restart" in reason:
        return "kubelet_restart"
    if "ListAndWatch" in reason:
        return "stream_lost"
    return "other"


def health_reason(reason: str) -> str:
    """Map the free-text reason of a health change to a label value: its cause.

    The cause is the text before the first ``:`` or ``(``, lower case, with every run of other
    characters than letters and digits made one ``_`` (at most 48 characters):
    ``"Xid 79 (GPU has fallen off the bus)"`` gives ``xid_79``, ``"uncorrected ECC errors
    rising: 3 -> 7"`` gives ``uncorrected_ecc_errors_rising``. Backends put the stable cause
    first and the details after a colon; the details stay in the log line.

    Args:
        reason: The text ``Observer.health_changed`` received.

    Returns:
        The label value; ``unspecified`` for an empty cause.
    """
    cause = re.split(r"[:(]", reason, maxsplit=1)[0].lower()
    label = re.sub(r"[^a-z0-9]+", "_", cause).strip("_")[:_HEALTH_REASON_CHARS].rstrip("_")
    return label or "unspecified"


def _prometheus() -> ModuleType:
    try:
        return importlib.import_module("prometheus_client")
    except ImportError:
        raise MissingDependencyError(
            "metrics need prometheus-client: pip install 'devplugin-sdk[metrics]'"
        ) from None


class _StatusCollector:
    """Series read from the plugins' status at scrape time (state, not events)."""

    def __init__(self, prom: ModuleType) -> None:
        self._family = prom.core.GaugeMetricFamily
        # Nothing until a runner says where its plugins' status comes from (Observer.serving).
        self.statuses: Callable[[], Sequence[PluginStatus]] = tuple

    def _families(self, statuses: Sequence[PluginStatus]) -> list[Any]:
        registered = self._family(
            "devplugin_registered",
            "1 while the plugin is registered with the kubelet's ListAndWatch stream open.",
            labels=["resource"],
        )
        streams = self._family(
            "devplugin_list_and_watch_streams",
            "Open ListAndWatch streams, the kubelet's and other clients' (1 when all is well).",
            labels=["resource"],
        )
        pending = self._family(
            "devplugin_list_pending_seconds",
            "How long the newest device list has waited to be sent on the kubelet's stream.",
            labels=["resource"],
        )
        for status in statuses:
            registered.add_metric([status.resource], 1.0 if status.registered else 0.0)
            streams.add_metric([status.resource], float(status.streams))
            pending.add_metric([status.resource], status.pending_seconds)
        return [registered, streams, pending]

    def describe(self) -> Iterator[Any]:
        # Names only, so that the registry can refuse duplicates without a scrape.
        yield from self._families(())

    def collect(self) -> Iterator[Any]:
        yield from self._families(self.statuses())


class PrometheusObserver:
    """An ``Observer`` that counts registrations, restarts, ListAndWatch sends and allocations.

    Event series (all labelled ``resource``): ``devplugin_registrations_total``,
    ``devplugin_registration_seconds``, ``devplugin_reregistrations_total{reason}``,
    ``devplugin_kubelet_restarts_total``, ``devplugin_list_and_watch_sends_total``,
    ``devplugin_devices{health}``, ``devplugin_allocations_total``,
    ``devplugin_allocation_seconds``, ``devplugin_allocation_errors_total{code}``,
    ``devplugin_rpc_errors_total{rpc,code}``, ``devplugin_health_changes_total{health,reason}``,
    ``devplugin_device_unhealthy{device,reason}`` (1 per device out, and why; see
    ``health_reason``; at most ``MAX_UNHEALTHY_DEVICE_SERIES`` per resource) and
    ``devplugin_devices_unhealthy_unlabelled`` (the devices out beyond it). A resource's
    series appear, at zero, on its first event, so ``rate()`` works from the start. State
    series, read from each plugin's status when scraped: ``devplugin_registered``,
    ``devplugin_list_and_watch_streams`` and ``devplugin_list_pending_seconds``, for the
    plugins of the runner this observer serves
    (the runner calls ``serving`` when it starts).

    Args:
        registry: Where the metrics are registered; prometheus_client's default ``REGISTRY``
            (which the HTTP endpoints serve by default) when None. One observer per registry: a
            second one on the same registry fails on the duplicate names.

    Raises:
        MissingDependencyError: prometheus-client is not installed (the ``metrics`` extra).
        ValueError: ``registry`` already holds these metric names.
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        prom = _prometheus()
        importlib.import_module("prometheus_client.core")
        self.registry: CollectorRegistry = prom.REGISTRY if registry is None else registry
        reg = self.registry
        # Registered first: a duplicate observer fails before it leaves half its metrics behind.
        self._state = _StatusCollector(prom)
        reg.register(self._state)
        self._registrations = prom.Counter(
            "devplugin_registrations",
            "Successful Register calls with the kubelet, first ones and re-registrations.",
            ["resource"],
            registry=reg,
        )
        self._registration_seconds = prom.Histogram(
            "devplugin_registration_seconds",
            "Duration of successful Register calls (the kubelet dials back inside them).",
            ["resource"],
            buckets=REGISTRATION_BUCKETS,
            registry=reg,
        )
        self._reregistrations = prom.Counter(
            "devplugin_reregistrations",
            "Registrations lost and being redone, by reason (kubelet_restart, stream_lost, other).",
            ["resource", "reason"],
            registry=reg,
        )
        self._kubelet_restarts = prom.Counter(
            "devplugin_kubelet_restarts",
            "Kubelet restarts seen (our socket removed or kubelet.sock recreated).",
            ["resource"],
            registry=reg,
        )
        self._sends = prom.Counter(
            "devplugin_list_and_watch_sends",
            "Device lists sent on ListAndWatch streams.",
            ["resource"],
            registry=reg,
        )
        self._devices = prom.Gauge(
            "devplugin_devices",
            "Devices in the last list sent to the kubelet, by health.",
            ["resource", "health"],
            registry=reg,
        )
        self._allocations = prom.Counter(
            "devplugin_allocations",
            "Allocate calls answered, successful or not.",
            ["resource"],
            registry=reg,
        )
        self._allocation_seconds = prom.Histogram(
            "devplugin_allocation_seconds",
            "Duration of Allocate calls, successful or not.",
            ["resource"],
            buckets=ALLOCATION_BUCKETS,
            registry=reg,
        )
        self._allocation_errors = prom.Counter(
            "devplugin_allocation_errors",
            "Allocate calls that failed, by gRPC status code.",
            ["resource", "code"],
            registry=reg,
        )
        self._rpc_errors = prom.Counter(
            "devplugin_rpc_errors",
            "Failed RPCs other than Allocate, by RPC and gRPC status code.",
            ["resource", "rpc", "code"],
            registry=reg,
        )
        self._health_changes = prom.Counter(
            "devplugin_health_changes",
            "Device health changes, by the new health and their cause (the reason's text before"
            " any ':' or '(').",
            ["resource", "health", "reason"],
            registry=reg,
        )
        self._unhealthy = prom.Gauge(
            "devplugin_device_unhealthy",
            "1 for each listed device that is Unhealthy, labelled with the cause of its change;"
            " no series while it is Healthy.",
            ["resource", "device", "reason"],
            registry=reg,
        )
        self._unlabelled = prom.Gauge(
            "devplugin_devices_unhealthy_unlabelled",
            "Unhealthy listed devices without a devplugin_device_unhealthy series of their own"
            f" (that one is capped at {MAX_UNHEALTHY_DEVICE_SERIES} series per resource).",
            ["resource"],
            registry=reg,
        )
        self._stale_claims = prom.Counter(
            "devplugin_dra_stale_claims_unprepared",
            "Prepared DRA claims unprepared by the stale-claim cleanup, by reason (gone: deleted"
            " from the API, replaced: its UID changed, unreserved: reserved for no pod).",
            ["driver", "reason"],
            registry=reg,
        )
        self._checkpoint_corrupted = prom.Counter(
            "devplugin_dra_checkpoint_corrupted",
            "DRA checkpoints that could not be used at start and were moved aside.",
            ["driver"],
            registry=reg,
        )
        self._seen: set[str] = set()
        self._out: dict[tuple[str, str], str] = {}  # (resource, device) -> reason label
        self._labelled: dict[str, int] = {}  # resource -> devices in self._out
        # resource -> {device: reason label}, Unhealthy beyond the cap, oldest first
        self._beyond: dict[str, dict[str, str]] = {}
        self._reasons: dict[str, set[str]] = {}  # resource -> reason labels used

    def _touch(self, resource: str) -> None:
        """Create a resource's label-complete series at zero on its first event."""
        if resource in self._seen:
            return
        self._seen.add(resource)
        for metric in (
            self._registrations,
            self._registration_seconds,
            self._kubelet_restarts,
            self._sends,
            self._allocations,
            self._allocation_seconds,
        ):
            metric.labels(resource)
        for reason in _REASONS:
            self._reregistrations.labels(resource, reason)
        for health in _HEALTH_STATES:
            self._devices.labels(resource, health)
        self._unlabelled.labels(resource)

    def serving(self, statuses: Callable[[], Sequence[PluginStatus]]) -> None:
        """Read the state series from ``statuses`` (the runner's plugins) from now on."""
        self._state.statuses = statuses

    def registered(self, resource: str, seconds: float) -> None:
        """Count a successful Register call and its duration."""
        self._touch(resource)
        self._registrations.labels(resource).inc()
        self._registration_seconds.labels(resource).observe(seconds)

    def reregistering(self, resource: str, reason: str) -> None:
        """Count a lost registration; one caused by a kubelet restart also counts as a restart."""
        self._touch(resource)
        label = reregister_reason(reason)
        self._reregistrations.labels(resource, label).inc()
        if label == "kubelet_restart":
            self._kubelet_restarts.labels(resource).inc()

    def list_sent(self, resource: str, healthy: int, unhealthy: int) -> None:
        """Count a ListAndWatch send and refresh the devices-by-health gauge from it."""
        self._touch(resource)
        self._sends.labels(resource).inc()
        self._devices.labels(resource, "Healthy").set(healthy)
        self._devices.labels(resource, "Unhealthy").set(unhealthy)

    def allocation(self, resource: str, seconds: float, error: str | None) -> None:
        """Count an Allocate call, its duration and, when ``error`` is a code name, the error."""
        self._touch(resource)
        self._allocations.labels(resource).inc()
        self._allocation_seconds.labels(resource).observe(seconds)
        if error is not None:
            self._allocation_errors.labels(resource, error).inc()

    def rpc_error(self, resource: str, rpc: str, code: str) -> None:
        """Count a failed RPC other than Allocate."""
        self._touch(resource)
        self._rpc_errors.labels(resource, rpc, code).inc()

    def health_changed(
        self, resource: str, device: str, health: Health | None, reason: str
    ) -> None:
        """Count a device's health change by its cause, and keep the unhealthy-device gauge."""
        self._touch(resource)
        label = self._reason_label(resource, reason)
        beyond = self._beyond.setdefault(resource, {})
        previous = self._out.pop((resource, device), None)
        if previous is not None:
            self._unhealthy.remove(resource, device, previous)
            self._labelled[resource] -= 1
        else:
            beyond.pop(device, None)
        if health is not None:  # None: the device left the list
            self._health_changes.labels(resource, Health(health).value, label).inc()
            if health is Health.UNHEALTHY:
                beyond[device] = label
        # Series for the oldest Unhealthy devices without one, up to the cap.
        while beyond and self._labelled.get(resource, 0) < MAX_UNHEALTHY_DEVICE_SERIES:
            out = next(iter(beyond))
            self._unhealthy.labels(resource, out, beyond[out]).set(1)
            self._out[(resource, out)] = beyond.pop(out)
            self._labelled[resource] = self._labelled.get(resource, 0) + 1
        self._unlabelled.labels(resource).set(len(beyond))

    def dra_stale_claim(self, driver: str, reason: str) -> None:
        """Count a stale DRA claim unprepared, by why."""
        self._stale_claims.labels(driver, reason).inc()

    def dra_checkpoint_corrupted(self, driver: str) -> None:
        """Count a DRA checkpoint moved aside at start."""
        self._checkpoint_corrupted.labels(driver).inc()

    def _reason_label(self, resource: str, reason: str) -> str:
        label = health_reason(reason)
        used = self._reasons.setdefault(resource, set())
        if label not in used and len(used) >= MAX_HEALTH_REASONS:
            return "other"
        used.add(label)
        return label
