"""The one retry delay of the package: exponential, capped, with jitter.

Every loop that retries something outside the process (a Register call, a plugin-watcher
socket, a ResourceSlice write, the API watch) waits ``Backoff.next()`` between attempts, so that
none can spin, and the jitter keeps the plugins of many nodes from retrying in step against one
API server or kubelet. The delay is drawn from the upper half of the current step (never above
the cap): a configured maximum stays a maximum, and a first retry stays prompt.
"""

from __future__ import annotations

import random

import anyio

__all__ = ["Backoff"]


class Backoff:
    """Delays ``first``, ``first * factor``, ... up to ``cap``, each scaled by a random factor in
    ``[1 - jitter, 1]``.

    Args:
        first: The first delay, in seconds.
        cap: The largest delay.
        factor: How much each step grows.
        jitter: The fraction of a step that is random (0: none).

    Raises:
        ValueError: a negative delay, a factor below 1 or a jitter outside ``[0, 1]``.
    """

    def __init__(
        self, first: float, cap: float, *, factor: float = 2.0, jitter: float = 0.5
    ) -> None:
        if first < 0 or cap < first:
            raise ValueError(f"backoff needs 0 <= first <= cap, got first={first} cap={cap}")
        if factor < 1 or not 0 <= jitter <= 1:
            raise ValueError(f"backoff needs factor >= 1 and 0 <= jitter <= 1: {factor}, {jitter}")
        self.first = first
        self.cap = cap
        self.factor = factor
        self.jitter = jitter
        #: Delays handed out since the last ``reset`` (the retries of the current failure).
        self.attempts = 0
        self._step = first

    @property
    def step(self) -> float:
        """The delay the next ``next()`` is drawn from (before jitter)."""
        return self._step

    def next(self) -> float:
        """The delay before the next attempt; each call grows the following one."""
        step = self._step
        self._step = min(step * self.factor, self.cap)
        self.attempts += 1
        return step * (1 - self.jitter * random.random())

    def reset(self) -> None:
        """The operation worked: the next failure starts from ``first`` again."""
        self._step = self.first
        self.attempts = 0

    async def sleep(self) -> float:
        """Sleep ``next()`` seconds; return how long."""
        delay = self.next()
        await anyio.sleep(delay)
        return delay
