"""The ListAndWatch streams open on one plugin's server, and which device list each has sent.

The servicer opens and ends streams and records what it sent; the registration strategy asks
whether the kubelet is connected (and since when it is not); the status asks how far behind the
slowest stream is. Every open and end wakes ``on_change`` (the process's directory watcher), so a
registration loop waiting for a stream wakes at once.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable

log = logging.getLogger("devplugin_sdk")

__all__ = ["Streams"]


class Streams:
    """Bookkeeping of one plugin's ListAndWatch streams (one event loop, no locking).

    Args:
        resource: The resource name, for logs.
        on_change: Called after a stream opens or ends.

    Attributes:
        idle_since: Monotonic time since which no stream has been open, or None while one is.
            The registration loop sets it when it registers and no stream is open yet.
    """

    def __init__(self, resource: str, on_change: Callable[[], None]) -> None:
        self._resource = resource
        self._on_change = on_change
        self._ids = itertools.count(1)
        self._sent: dict[int, int] = {}  # stream ID -> version sent on it (-1: none yet)
        self.idle_since: float | None = None

    def __len__(self) -> int:
        return len(self._sent)

    def opened(self) -> int:
        """Record a new stream; return its ID."""
        stream_id = next(self._ids)
        self._sent[stream_id] = -1
        self.idle_since = None
        self._log("opened")
        self._on_change()
        return stream_id

    def ended(self, stream_id: int) -> None:
        """Record the end of a stream (cancelled by the kubelet, or ended by us)."""
        if self._sent.pop(stream_id, None) is None:
            return
        if not self._sent:
            self.idle_since = time.monotonic()
        self._log("ended")
        self._on_change()

    def sent(self, stream_id: int, version: int) -> None:
        """Record that ``stream_id`` sent the device list of ``version``."""
        if stream_id in self._sent:
            self._sent[stream_id] = version

    def oldest_sent(self) -> int | None:
        """The oldest version any open stream has sent (-1: one has sent nothing); None if none."""
        return min(self._sent.values(), default=None)

    def _log(self, what: str) -> None:
        log.info(
            "%s: ListAndWatch stream %s (%d open)",
            self._resource,
            what,
            len(self._sent),
            extra={"resource": self._resource},
        )
