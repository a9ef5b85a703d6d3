"""What the SDK reports about itself while serving: the ``Observer`` protocol and plugin status.

Pass an object with these methods as ``observer=`` to ``serve``/``run`` (metrics exporters do);
every method is optional at run time (missing ones are skipped) and must not block. The runner
hands its status source to ``Observer.serving`` and to its HTTP endpoints: each reads the plugins
of the runner it belongs to.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from devplugin_sdk.types import Health

__all__ = ["DraStatus", "Observer", "PluginStatus"]


class Observer(Protocol):
    """Receives lifecycle and RPC events; implement the methods you need."""

    def serving(self, statuses: Callable[[], Sequence[PluginStatus]]) -> None:
        """The runner started; ``statuses()`` reads the state of the plugins it serves."""

    def registered(self, resource: str, seconds: float) -> None:
        """A Register call succeeded after ``seconds``."""

    def reregistering(self, resource: str, reason: str) -> None:
        """The registration was lost (kubelet restart, stream lost); serving again."""

    def list_sent(self, resource: str, healthy: int, unhealthy: int) -> None:
        """A ListAndWatch message went out with these counts."""

    def allocation(self, resource: str, seconds: float, error: str | None) -> None:
        """An Allocate call finished (``error`` is the gRPC code name when it failed)."""

    def rpc_error(self, resource: str, rpc: str, code: str) -> None:
        """An RPC other than Allocate failed with ``code``."""

    def health_changed(
        self, resource: str, device: str, health: Health | None, reason: str
    ) -> None:
        """A listed device's health changed, for ``reason`` (free text from the backend, such
        as ``"Xid 79 (GPU has fallen off the bus)"``, or ``"discovered"``, ``"polled"``);
        ``health`` is None when the device left the list (reason ``"removed"``)."""

    def dra_stale_claim(self, driver: str, reason: str) -> None:
        """The DRA driver unprepared a stale claim: ``gone`` from the API, ``replaced`` (its
        UID changed) or ``unreserved`` (reserved for no pod)."""

    def dra_checkpoint_corrupted(self, driver: str) -> None:
        """The DRA driver's checkpoint could not be used at start and was moved aside."""


@dataclass(frozen=True, slots=True)
class PluginStatus:
    """A served plugin's state, for liveness checks.

    Attributes:
        resource: The resource name.
        registered: Registered with the kubelet, with the kubelet's own ListAndWatch stream
            open (the one it opened in answer to the registration; other clients' streams,
            such as ``devplugin probe --watch``, do not count).
        streams: Open ListAndWatch streams, the kubelet's and other clients'.
        pending_seconds: How long the newest device list has waited to be sent on the
            kubelet's stream (0 when it is up to date or not open). A large value means a
            stuck loop.
        devices: Devices by health ("Healthy"/"Unhealthy") as the plugin sees them.
    """

    resource: str
    registered: bool
    streams: int
    pending_seconds: float
    devices: dict[str, int]


@dataclass(frozen=True, slots=True)
class DraStatus:
    """What the runner's DRA driver is doing (``Running.dra``).

    Attributes:
        driver: The driver name.
        node_name: The node (and pool) name.
        registered: The kubelet's plugin watcher reported the driver registered.
        registrations: How many times it did (again after each kubelet restart).
        generation: The pool generation last published.
        published: Devices in the pool as last published.
        pending_seconds: How long the newest device set has waited to be published.
        prepared_claims: Claims prepared on this node (the checkpoint's entries).
        last_error: The Kubernetes API's latest refusal while publishing, until one works.
        recovered_claims: Prepared claims known only by the CDI spec kept for them, because the
            checkpoint could not be read at start; each is recorded in full when the kubelet
            prepares it again, and leaves when it unprepares it.
        taints_dropped: The API server dropped the devices' taints (``DRADeviceTaints`` off):
            unhealthy devices are withdrawn instead.
        health_streams: The kubelet's ``DRAResourceHealth`` streams open now.
        stale_claims_unprepared: Prepared claims the stale-claim cleanup unprepared.
        checkpoint_corrupted: 1 when the checkpoint could not be used at start.
        status_write_failures: Claim device-status writes the API server refused.
    """

    driver: str
    node_name: str
    registered: bool
    registrations: int
    generation: int
    published: int
    pending_seconds: float
    prepared_claims: int
    last_error: str | None
    recovered_claims: int = 0
    taints_dropped: bool = False
    health_streams: int = 0
    stale_claims_unprepared: int = 0
    checkpoint_corrupted: int = 0
    status_write_failures: int = 0
