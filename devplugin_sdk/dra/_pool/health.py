"""The driver's device health as the kubelet's ``DRAResourceHealth`` stream shows it.

``Plugins`` puts every published device's health here from the engine's one health model (the
same condition that makes its taint). The board encodes a device's entry when it changes and
builds the messages of the whole state once per change, for every stream of either version;
each stream sends them at once, then the newest after every change (changes made while it was
sending coalesce) and at least three times per ``timeout`` seconds, since the kubelet takes a
device it has heard nothing about for that long to be Unknown.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass

import anyio

from devplugin_sdk._engine.conditions import Condition
from devplugin_sdk._wire.dra_health import encode_device, pack
from devplugin_sdk._wire.dra_model import DeviceHealthStatus, HealthStatus, health_message
from devplugin_sdk.api import constants
from devplugin_sdk.types import Effect, Health

__all__ = ["GAP", "OPENS_PER_S", "Frame", "HealthBoard", "status_of"]

#: The least time between two states one stream sends, seconds.
GAP = 0.1
#: The most streams that get their first state per second, all together: the kubelet opens one
#: per 5 s; a client that opens them without end has the next wait its turn.
OPENS_PER_S = 20.0


def status_of(condition: Condition) -> tuple[HealthStatus, str]:
    """The stream's health and message for a device in ``condition``."""
    if condition.health is Health.UNHEALTHY:
        return "UNHEALTHY", condition.reason
    if condition.effect is Effect.ADVISORY:
        return "HEALTHY", f"advisory: {condition.reason}"
    return "HEALTHY", ""


@dataclass(frozen=True, slots=True)
class Frame:
    """The whole state as the streams send it.

    Attributes:
        generation: The state's number; a change makes the next.
        messages: Its encoded messages, each under the kubelet's size limit. The kubelet merges
            each message's devices into what it holds and keeps the others (updateHealthInfo,
            pkg/kubelet/cm/dra/healthinfo.go), so together they are the state.
        built: When its entries were encoded (monotonic).
    """

    generation: int
    messages: tuple[bytes, ...]
    built: float


class HealthBoard:
    """Every published device's health, and the streams that send it.

    Args:
        pool: The pool the devices are in.
        timeout: ``health_check_timeout_seconds`` of every device.

    Attributes:
        period: The longest a stream goes without a message (``timeout / 3``); a client that
            takes none for as long has its stream ended.
        streams: The streams open now.
    """

    def __init__(self, pool: str, timeout: int = constants.DRA_HEALTH_TIMEOUT_S) -> None:
        self.pool = pool
        self.timeout = timeout
        self.period = timeout / 3
        self.streams = 0
        self._health: dict[str, tuple[HealthStatus, str]] = {}
        self._entries: dict[str, bytes] = {}  # each device's, encoded when it last changed
        self._generation = 0
        self._frame: Frame | None = None
        self._changed = anyio.Event()
        self._next_open = 0.0  # when the next stream may have its first state (monotonic)

    def set(self, health: Mapping[str, tuple[HealthStatus, str]]) -> None:
        """Make ``health`` (device name -> status and message) the state; streams send it if
        it changed."""
        if health == self._health:
            return
        now = int(time.time())
        for name, value in health.items():
            if self._health.get(name) != value:
                self._entries[name] = self._encode(name, value, now)
        for gone in self._entries.keys() - health.keys():
            del self._entries[gone]
        self._health = dict(health)
        self._generation += 1
        self._changed.set()
        self._changed = anyio.Event()

    def frame(self) -> Frame:
        """The state's messages: built once per change and shared by every stream; encoded
        again, every device with the time now, when older than ``period`` (a heartbeat)."""
        frame = self._frame
        if frame is not None and frame.generation == self._generation:
            if time.monotonic() - frame.built < self.period:
                return frame
            now = int(time.time())
            self._entries = {n: self._encode(n, v, now) for n, v in self._health.items()}
        frame = Frame(
            self._generation,
            pack(self._entries[name] for name in sorted(self._entries)),
            time.monotonic(),
        )
        self._frame = frame
        return frame

    async def watch(self) -> AsyncIterator[tuple[bytes, ...]]:
        """The messages of one stream: the whole state now (after the streams opened before it,
        ``OPENS_PER_S``), then after each change (at most one state per ``GAP`` seconds: the
        changes meanwhile are in the next) and at least every ``period`` seconds, until the
        stream is closed."""
        self.streams += 1
        try:
            await self._turn()
            sent = -1
            while True:
                if self._generation == sent:
                    changed = self._changed
                    with anyio.move_on_after(self.period):
                        await changed.wait()
                frame = self.frame()
                sent = frame.generation
                yield frame.messages
                # A flapping device makes a change per event; the kubelet needs the newest
                # state, not each one, and every stream sending each would take the loop.
                await anyio.sleep(GAP)
        finally:
            self.streams -= 1

    async def _turn(self) -> None:
        """Wait for this stream's turn to open (``OPENS_PER_S``, first come first served)."""
        now = time.monotonic()
        turn = max(now, self._next_open)
        self._next_open = turn + 1 / OPENS_PER_S
        if turn > now:
            await anyio.sleep(turn - now)

    def _encode(self, name: str, value: tuple[HealthStatus, str], now: int) -> bytes:
        status, message = value
        return encode_device(
            DeviceHealthStatus(self.pool, name, status, health_message(message), self.timeout, now)
        )
