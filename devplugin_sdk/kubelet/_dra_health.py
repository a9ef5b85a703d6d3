"""FakeKubelet's DRA health cache: the kubelet's side of the ``DRAResourceHealth`` stream.

As pkg/kubelet/cm/dra does (healthinfo.go, plugin/): follow the stream of a registered plugin (v1
over v1alpha1), merge each message's devices into what is held (a device left out keeps its
status: a state may span messages), reopen the stream 5 s after it ends, read a device unheard
of for its timeout (30 s by default) as Unknown, drop the driver's entries with its last plugin.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import anyio
import anyio.abc
import grpc

from devplugin_sdk._wire.dra_health import DraHealthClient
from devplugin_sdk._wire.dra_model import DeviceHealthStatus, health_message
from devplugin_sdk.api import constants

__all__ = ["HEALTH_SERVICES", "HealthCache", "pick_health_service"]

log = logging.getLogger("devplugin_sdk.fake_kubelet")

#: What a 1.37 kubelet speaks, preferred first (TestPickHealthService).
HEALTH_SERVICES = (constants.DRA_HEALTH_SERVICE_V1, constants.DRA_HEALTH_SERVICE_V1ALPHA1)
#: The kubelet opens a failed or ended health stream again after this long.
RETRY_S = 5.0


def pick_health_service(kubelet: Sequence[str], plugin: Sequence[str]) -> str | None:
    """The health service the kubelet uses: its most preferred one that the plugin lists."""
    return next((s for s in kubelet if s in HEALTH_SERVICES and s in plugin), None)


@dataclass(frozen=True, slots=True)
class DeviceHealth:
    """What the kubelet holds about one device (state.DeviceHealth)."""

    health: str  # "Healthy", "Unhealthy" or "Unknown"
    message: str
    heard: float  # monotonic
    timeout: float


_HEALTH = {"HEALTHY": "Healthy", "UNHEALTHY": "Unhealthy", "UNKNOWN": "Unknown"}


class HealthCache:
    """Device health by driver, pool and device, fed by each driver's stream.

    Args:
        notify: Called on every change.
        retry: Seconds before a failed or ended stream is opened again.
    """

    def __init__(self, notify: Callable[[], None], retry: float = RETRY_S) -> None:
        self.retry = retry
        self.streams: dict[str, str] = {}  # driver -> the service of its open stream
        self.messages = 0
        self._devices: dict[str, dict[tuple[str, str], DeviceHealth]] = {}
        self._notify = notify

    def health(self, driver: str, pool: str, device: str) -> tuple[str, str]:
        """The device's health and message as the kubelet reads them (getHealthInfo)."""
        known = self._devices.get(driver, {}).get((pool, device))
        if known is None or time.monotonic() - known.heard > known.timeout:
            return "Unknown", ""
        return known.health, known.message

    def clear(self, driver: str) -> None:
        """The driver's last plugin went away (clearDriver)."""
        self._devices.pop(driver, None)
        self.streams.pop(driver, None)
        self._notify()

    async def follow(self, driver: str, channel: grpc.aio.Channel, service: str) -> None:
        """Keep the driver's stream open on ``channel`` until cancelled."""
        client = DraHealthClient(channel, service)
        while True:
            try:
                async for statuses in client.watch():
                    self.streams[driver] = service
                    self._update(driver, statuses)
                why = "ended"
            except grpc.aio.AioRpcError as exc:
                why = f"failed: {exc.code().name} {exc.details()}"
            except grpc.aio.UsageError:
                return  # the channel closed: the plugin is gone
            self.streams.pop(driver, None)
            self._notify()
            log.info("DRA %s: health stream %s; opening it again in %gs", driver, why, self.retry)
            await anyio.sleep(self.retry)

    def _update(self, driver: str, statuses: Sequence[DeviceHealthStatus]) -> None:
        now = time.monotonic()
        devices = self._devices.setdefault(driver, {})
        for status in statuses:
            timeout = status.timeout_seconds
            devices[(status.pool, status.device)] = DeviceHealth(
                _HEALTH[status.health],
                health_message(status.message),
                now,
                float(timeout if timeout > 0 else constants.DRA_HEALTH_TIMEOUT_S),
            )
        self.messages += 1
        self._notify()
