"""The work of one kubelet run: Register's dial-back, each ListAndWatch follower, the plugin
watcher's registrations. It lives and dies with the kubelet process, so ``FakeKubelet.stop``
ends all of it (``end``) before it closes the connections that work uses, as a real restart
ends it with the process; a connection closed under a call in flight is a race of the fake's
own making, which this rules out.

A task that ends in a bare ``asyncio.CancelledError`` nobody asked for (a gRPC call cancelled
under it) raises ``RuntimeError`` instead: in the task group it would cancel the test's body and
the group would then swallow the cut, so that a test passed having run half its body.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import anyio
import anyio.abc

__all__ = ["RunTasks"]


class _Run:
    """The cancel scopes of one run's live tasks; ``idle`` is set as each one finishes."""

    def __init__(self) -> None:
        self.scopes: set[anyio.CancelScope] = set()
        self.idle = anyio.Event()


class RunTasks:
    """Starts each task of the current kubelet run in FakeKubelet's task group; ``end`` ends
    them all.

    Args:
        task_group: FakeKubelet's task group (there once it is entered).
    """

    def __init__(self, task_group: Callable[[], anyio.abc.TaskGroup | None]) -> None:
        self._task_group = task_group
        self._run = _Run()

    def spawn(self, func: Callable[..., Any], *args: Any) -> None:
        """Start ``func(*args)`` as a task of this run."""
        tg = self._task_group()
        assert tg is not None
        run, scope = self._run, anyio.CancelScope()
        run.scopes.add(scope)
        tg.start_soon(self._guarded, run, scope, func, args, name=_name(func))

    async def end(self) -> None:
        """Cancel every task of this run and wait until each has finished; later tasks belong
        to the next run."""
        run, self._run = self._run, _Run()
        for scope in run.scopes:
            scope.cancel()
        while run.scopes:
            run.idle = anyio.Event()
            await run.idle.wait()

    @staticmethod
    async def _guarded(
        run: _Run, scope: anyio.CancelScope, func: Callable[..., Any], args: tuple[Any, ...]
    ) -> None:
        try:
            with scope:
                try:
                    await func(*args)
                except anyio.get_cancelled_exc_class():
                    # Cancelled by us (``end``, FakeKubelet leaving): a scope around is. The
                    # task ends here, as the scope would end it had the error kept anyio's
                    # mark (a grpc.aio unary call re-raises a bare one).
                    if anyio.current_effective_deadline() == -math.inf:
                        return
                    raise RuntimeError(
                        f"FakeKubelet's task {_name(func)} was cancelled by something other "
                        "than the kubelet (a gRPC call cancelled under it): a bug of the fake"
                    ) from None
        finally:
            run.scopes.discard(scope)
            run.idle.set()


def _name(func: Callable[..., Any]) -> str:
    return getattr(func, "__qualname__", repr(func))
