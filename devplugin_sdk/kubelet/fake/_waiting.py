"""What tests wait on: every part of FakeKubelet calls ``Changes.notify`` after each change of
what the kubelet sees, and ``FakeKubelet.wait_for`` re-checks its predicate on each (and now and
then: capacity also changes with time alone, when a grace period ends).
"""

from __future__ import annotations

from collections.abc import Callable

import anyio

__all__ = ["Changes"]


class Changes:
    """The kubelet's change signal and the waits on it."""

    def __init__(self) -> None:
        self._changed = anyio.Event()

    def notify(self) -> None:
        """Wake every wait: something the kubelet sees changed."""
        self._changed.set()
        self._changed = anyio.Event()

    async def until(
        self,
        predicate: Callable[[], bool],
        timeout: float,
        what: str,
        describe: Callable[[], str],
    ) -> None:
        """Return once ``predicate()`` holds.

        Raises:
            TimeoutError: naming ``what`` and ``describe()``, after ``timeout`` seconds.
        """
        try:
            with anyio.fail_after(timeout):
                while not predicate():
                    with anyio.move_on_after(0.05):
                        # Capacity can also change with time alone (the grace period).
                        await self._changed.wait()
        except TimeoutError:
            raise TimeoutError(
                f"timed out after {timeout:g}s waiting for {what}; {describe()}"
            ) from None
