"""How the ResourceSlice publisher retries a write that failed: a jittered backoff from the one
helper, one log line per new reason (again after a minute if it stays), and giving up, loudly,
after a bounded number of attempts (the sync loop then waits for new devices or the resync).
"""

from __future__ import annotations

import logging
import time

from devplugin_sdk._backoff import Backoff

__all__ = ["Attempts"]

log = logging.getLogger("devplugin_sdk")

_LOG_AGAIN_AFTER = 60.0


class Attempts:
    """The failed attempts at publishing one driver's pool.

    Args:
        driver: The driver name, for the log lines.
        backoff: The delays between attempts.
        give_up_after: How many attempts in a row before giving up.
        resync_seconds: When the sync loop tries again after giving up (for the log line).

    Attributes:
        last_error: Why the last attempt failed; None once one works again.
    """

    def __init__(
        self, driver: str, backoff: Backoff, give_up_after: int, resync_seconds: float
    ) -> None:
        self.driver = driver
        self.backoff = backoff
        self.give_up_after = give_up_after
        self.resync_seconds = resync_seconds
        self.last_error: str | None = None
        self._logged: tuple[str, float] = ("", 0.0)

    def failed(self, why: str, *, conflict: bool) -> float | None:
        """An attempt failed for ``why``: the seconds to wait before the next, or None when
        this was the last (said in one ERROR line)."""
        self.last_error = why
        delay = self.backoff.next()
        if self.backoff.attempts >= self.give_up_after:
            self._logged = (why, time.monotonic())
            log.error(
                "DRA %s: giving up publishing ResourceSlices after %d attempts: %s; trying again "
                "when the devices change or in %gs",
                self.driver,
                self.backoff.attempts,
                why,
                self.resync_seconds,
            )
            return None
        message, at = self._logged
        now = time.monotonic()
        level = logging.DEBUG
        if why != message or now - at >= _LOG_AGAIN_AFTER:
            level = logging.WARNING if conflict else logging.ERROR
            self._logged = (why, now)
        log.log(
            level,
            "DRA %s: cannot publish ResourceSlices: %s; retrying in %.2gs",
            self.driver,
            why,
            delay,
        )
        return delay

    def stuck(self) -> None:
        """The last write stuck (read back, or nothing to do): the next failure starts afresh."""
        self.backoff.reset()

    def worked(self) -> None:
        """A sync worked: say so once, if one had failed."""
        if self.last_error is not None:
            log.info("DRA %s: publishing ResourceSlices works again", self.driver)
            self.last_error = None
