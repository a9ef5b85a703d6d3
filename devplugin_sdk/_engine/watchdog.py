"""Reports an event loop that stops running: a hook calling blocking code (NVML, sysfs, a
``time.sleep``) on the loop stalls every plugin's gRPC calls, and nothing else would say so.

A task on the loop stamps a heartbeat; a thread reads it, and when it is older than
``BLOCKED_AFTER`` logs where the loop's thread is (the innermost frame), then, once the loop
runs again, for how long it was blocked. Logging is thread-safe; the thread only reads.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import traceback

import anyio

log = logging.getLogger("devplugin_sdk")

__all__ = ["BLOCKED_AFTER", "watch_loop"]

#: Seconds without a heartbeat before the loop counts as blocked.
BLOCKED_AFTER = 2.0
_TICK = 0.25  # seconds between heartbeats (and between the thread's looks)


async def watch_loop() -> None:
    """Watch the running event loop until cancelled."""
    beat = [time.monotonic()]
    loop_thread = threading.get_ident()
    stop = threading.Event()
    thread = threading.Thread(
        target=_monitor, args=(beat, loop_thread, stop), name="devplugin-loop-watchdog", daemon=True
    )
    thread.start()
    try:
        while True:
            beat[0] = time.monotonic()
            await anyio.sleep(_TICK)
    finally:
        stop.set()
        thread.join()  # at most one tick: it waits on ``stop``


def _monitor(beat: list[float], loop_thread: int, stop: threading.Event) -> None:
    blocked_since: float | None = None
    while not stop.wait(_TICK):
        last = beat[0]
        lag = time.monotonic() - last
        if blocked_since is None and lag > BLOCKED_AFTER:
            blocked_since = last
            log.warning(
                "the event loop has not run for %.1fs: blocking code%s stalls every plugin's "
                "calls; run it in a thread (anyio.to_thread.run_sync)",
                lag,
                _where(loop_thread),
            )
        elif blocked_since is not None and last > blocked_since:
            log.warning("the event loop runs again after %.1fs blocked", last - blocked_since)
            blocked_since = None


def _where(thread_id: int) -> str:
    """`` at FILE:LINE in FUNCTION``: the innermost Python frame of the loop's thread."""
    frame = sys._current_frames().get(thread_id)
    if frame is None:
        return ""
    stack = traceback.extract_stack(frame)
    if log.isEnabledFor(logging.DEBUG):
        log.debug("the event loop's thread:\n%s", "".join(traceback.format_list(stack)))
    last = stack[-1]
    return f" at {last.filename}:{last.lineno} in {last.name}"
