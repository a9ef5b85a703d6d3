"""Delivery of lifecycle and RPC events to the runner's ``Observer``.

Every engine piece reports through one ``Events`` object; a missing observer method is skipped
and an observer that raises is logged, never allowed to break serving (``observe.Observer``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from devplugin_sdk.observe import Observer, PluginStatus
from devplugin_sdk.types import Health

log = logging.getLogger("devplugin_sdk")

__all__ = ["Events"]


class Events:
    """Calls the observer's methods safely; a no-op without an observer."""

    def __init__(self, observer: Observer | None) -> None:
        self._observer = observer

    def serving(self, statuses: Callable[[], Sequence[PluginStatus]]) -> None:
        self._call("serving", statuses)

    def registered(self, resource: str, seconds: float) -> None:
        self._call("registered", resource, seconds)

    def reregistering(self, resource: str, reason: str) -> None:
        self._call("reregistering", resource, reason)

    def list_sent(self, resource: str, healthy: int, unhealthy: int) -> None:
        self._call("list_sent", resource, healthy, unhealthy)

    def allocation(self, resource: str, seconds: float, error: str | None) -> None:
        self._call("allocation", resource, seconds, error)

    def rpc_error(self, resource: str, rpc: str, code: str) -> None:
        self._call("rpc_error", resource, rpc, code)

    def health_changed(
        self, resource: str, device: str, health: Health | None, reason: str
    ) -> None:
        self._call("health_changed", resource, device, health, reason)

    def dra_stale_claim(self, driver: str, reason: str) -> None:
        self._call("dra_stale_claim", driver, reason)

    def dra_checkpoint_corrupted(self, driver: str) -> None:
        self._call("dra_checkpoint_corrupted", driver)

    def _call(self, event: str, *args: object) -> None:
        method = getattr(self._observer, event, None)
        if method is None:
            return
        try:
            method(*args)
        except Exception:
            log.exception("observer %s.%s failed", type(self._observer).__name__, event)
