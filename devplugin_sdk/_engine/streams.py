"""The ListAndWatch streams open on one plugin's server, which one is the kubelet's, and what each
has sent.

The servicer opens and ends streams and records what it sent; the registration strategy says when
a registration starts and asks whether the kubelet's stream is open (and since when it is not);
the status asks how far behind the kubelet's stream is. Other clients (``devplugin probe
--watch``, a monitoring agent) may hold streams too: they never count as the kubelet. Every open
and end wakes ``on_change`` (the process's directory watcher), so a registration loop waiting for
a stream wakes at once.

How the kubelet's stream is recognised: the kubelet calls GetDevicePluginOptions once on the
connection it dials while it handles our registration, then opens ListAndWatch on that same
connection (protocol reference 3.1, 5.2). gRPC does not tell us which connection a call came
on, so the first stream opened after a GetDevicePluginOptions call that follows the start of a
registration is taken as the kubelet's. A client would have to call GetDevicePluginOptions and
open ListAndWatch inside the few milliseconds of our own registration to be mistaken for it.
"""

from __future__ import annotations

import enum
import itertools
import logging
import time
from collections.abc import Callable

log = logging.getLogger("devplugin_sdk")

__all__ = ["Streams"]


class _Expect(enum.Enum):
    NOTHING = "nothing"  # no registration under way
    DIAL_BACK = "dial back"  # a registration started: the kubelet will ask for the options
    STREAM = "stream"  # the kubelet asked for the options: its stream comes next


class Streams:
    """Bookkeeping of one plugin's ListAndWatch streams (one event loop, no locking).

    Args:
        resource: The resource name, for logs.
        on_change: Called after a stream opens or ends.

    Attributes:
        kubelet: The ID of the kubelet's open stream, or None.
        lost_since: Monotonic time since which the kubelet's stream has been missing after a
            registration (its stream ended, or the registration succeeded without one yet);
            None while it is open and before the first registration.
        dropped: Whether the kubelet's stream ended (the kubelet stopping, restarting or
            dropping us), with no registration started since.
    """

    def __init__(self, resource: str, on_change: Callable[[], None]) -> None:
        self._resource = resource
        self._on_change = on_change
        self._ids = itertools.count(1)
        self._sent: dict[int, int] = {}  # stream ID -> version sent on it (-1: none yet)
        self._expect = _Expect.NOTHING
        self.kubelet: int | None = None
        self.lost_since: float | None = None
        self.dropped = False

    def __len__(self) -> int:
        return len(self._sent)

    # ------------------------------------------------------------------ registration

    def expect_kubelet(self) -> None:
        """A registration starts: the next dial-back and stream are the kubelet's."""
        self._expect = _Expect.DIAL_BACK
        self.dropped = False

    def expect_nothing(self) -> None:
        """The registration failed or serving stopped: no stream of the kubelet is coming."""
        self._expect = _Expect.NOTHING

    def options_requested(self) -> None:
        """GetDevicePluginOptions was called (inside a registration, by the kubelet)."""
        if self._expect is _Expect.DIAL_BACK:
            self._expect = _Expect.STREAM

    def registered(self) -> None:
        """The registration succeeded: from now on a missing kubelet stream is a loss."""
        if self.kubelet is None:
            self.lost_since = time.monotonic()

    # ------------------------------------------------------------------ streams

    def opened(self) -> int:
        """Record a new stream; return its ID."""
        stream_id = next(self._ids)
        self._sent[stream_id] = -1
        who = "a client's"
        if self._expect is _Expect.STREAM:
            self._expect = _Expect.NOTHING
            self.kubelet = stream_id
            self.lost_since = None
            self.dropped = False
            who = "the kubelet's"
        self._log(f"{who} ListAndWatch stream opened")
        self._on_change()
        return stream_id

    def ended(self, stream_id: int) -> None:
        """Record the end of a stream (cancelled by its client, or ended by us)."""
        if self._sent.pop(stream_id, None) is None:
            return
        who = "a client's"
        if stream_id == self.kubelet:
            self.kubelet = None
            self.lost_since = time.monotonic()
            self.dropped = True
            who = "the kubelet's"
        self._log(f"{who} ListAndWatch stream ended")
        self._on_change()

    def sent(self, stream_id: int, version: int) -> None:
        """Record that ``stream_id`` sent the device list of ``version``.

        The kubelet's stream sending its first list wakes ``on_change`` too (the registration
        loop stops a replaced server then).
        """
        first = self._sent.get(stream_id) == -1
        if stream_id in self._sent:
            self._sent[stream_id] = version
        if first and stream_id == self.kubelet:
            self._on_change()

    def missing_for(self) -> float | None:
        """Seconds the kubelet's stream has been missing since a registration; None while it is
        open or before the first registration."""
        if self.kubelet is not None or self.lost_since is None:
            return None
        return time.monotonic() - self.lost_since

    def kubelet_sent(self) -> int | None:
        """The version the kubelet's stream has sent (-1: nothing yet); None if it is not open."""
        return None if self.kubelet is None else self._sent[self.kubelet]

    def _log(self, what: str) -> None:
        log.info(
            "%s: %s (%d open)",
            self._resource,
            what,
            len(self._sent),
            extra={"resource": self._resource},
        )
