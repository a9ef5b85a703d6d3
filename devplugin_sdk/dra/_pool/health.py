"""The driver's device health as the kubelet's ``DRAResourceHealth`` stream shows it.

``Plugins`` puts every published device's health here from the engine's one health model (the
same condition that makes its taint); each stream the kubelet opens gets the full state at once,
then the full state again after every change (changes made while a message was being sent
coalesce into one) and at least three times per ``timeout`` seconds, since the kubelet takes a
device it has heard nothing about for that long to be Unknown.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Mapping

import anyio

from devplugin_sdk._engine.conditions import Condition
from devplugin_sdk._wire.dra_model import DeviceHealthStatus, HealthStatus, health_message
from devplugin_sdk.api import constants
from devplugin_sdk.types import Effect, Health

__all__ = ["HealthBoard", "status_of"]


def status_of(condition: Condition) -> tuple[HealthStatus, str]:
    """The stream's health and message for a device in ``condition``."""
    if condition.health is Health.UNHEALTHY:
        return "UNHEALTHY", condition.reason
    if condition.effect is Effect.ADVISORY:
        return "HEALTHY", f"advisory: {condition.reason}"
    return "HEALTHY", ""


class HealthBoard:
    """Every published device's health, and the streams that send it.

    Args:
        pool: The pool the devices are in.
        timeout: ``health_check_timeout_seconds`` of every device.
    """

    def __init__(self, pool: str, timeout: int = constants.DRA_HEALTH_TIMEOUT_S) -> None:
        self.pool = pool
        self.timeout = timeout
        self.streams = 0
        self._health: dict[str, tuple[HealthStatus, str]] = {}
        self._changed = anyio.Event()

    def set(self, health: Mapping[str, tuple[HealthStatus, str]]) -> None:
        """Make ``health`` (device name -> status and message) the state; streams send it if
        it changed."""
        if health != self._health:
            self._health = dict(health)
            self._changed.set()
            self._changed = anyio.Event()

    async def watch(self) -> AsyncIterator[list[DeviceHealthStatus]]:
        """The messages of one stream: the full state now, then after each change and at
        least every ``timeout / 3`` seconds, until the stream is closed."""
        self.streams += 1
        try:
            while True:
                changed = self._changed
                yield self._message()
                with anyio.move_on_after(self.timeout / 3):
                    await changed.wait()
        finally:
            self.streams -= 1

    def _message(self) -> list[DeviceHealthStatus]:
        now = int(time.time())
        return [
            DeviceHealthStatus(
                self.pool,
                name,
                status,
                health_message(message),
                self.timeout,
                now,
            )
            for name, (status, message) in sorted(self._health.items())
        ]
