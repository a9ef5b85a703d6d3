"""Driving plugin hooks: awaiting one inside a gRPC call (one coroutine step when it finishes at
once, a bound once it suspends); saying which resource and hook an error or a long wait belongs
to; refusing hooks that are not ``async def``.

Most hooks finish without suspending (a merge, a lookup), and Allocate is the plugin's hot path
(every pod admission waits on it), so such a hook costs one ``send`` here: no cancel scope, timer
or event. Only a hook that really suspends is driven on under its bound, a native cancellation
of the call's task. The servicer awaits hooks here; ``served`` names failures and long waits.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import types
from collections.abc import Awaitable, Coroutine, Generator, Iterator
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

if TYPE_CHECKING:
    from devplugin_sdk.plugin import DevicePlugin

T = TypeVar("T")

log = logging.getLogger("devplugin_sdk")

#: Seconds a hook runs before the log says it is still running (then after twice as long, ...).
STILL_RUNNING_AFTER = 5.0
_STILL_RUNNING_MAX = 60.0

#: The hooks the engine awaits: each must be a coroutine function (``watch`` is an iterator).
COROUTINE_HOOKS = (
    "discover",
    "check_health",
    "allocate",
    "preferred_allocation",
    "pre_start_container",
    "on_stop",
)

_CONTEXT = "_devplugin_context"  # the attribute a failed hook's exception carries


def require_async(plugin: DevicePlugin) -> None:
    """Refuse a plugin whose hooks are not coroutine functions, before anything starts.

    Raises:
        TypeError: naming the hook and saying ``async def``.
    """
    for name in COROUTINE_HOOKS:
        hook = getattr(plugin, name, None)
        if hook is None or inspect.iscoroutinefunction(hook):
            continue
        owner = type(plugin)
        raise TypeError(
            f"{owner.__module__}.{owner.__qualname__}.{name} must be defined with async def "
            "(hooks are coroutines; run blocking work through anyio.to_thread.run_sync)"
        )


def note_failure(exc: BaseException, resource: str, hook: str) -> None:
    """Record on ``exc`` (unchanged in type, so callers still catch what the hook raised) that
    it came out of ``hook`` of ``resource``; ``failure_context`` reads it back, and the
    traceback shows it as a note (PEP 678)."""
    if getattr(exc, _CONTEXT, None) is not None:
        return
    context = f"{resource}: {hook}() failed"
    with contextlib.suppress(AttributeError, TypeError):  # an exception with __slots__
        setattr(exc, _CONTEXT, context)
        add_note = getattr(exc, "add_note", None)
        if add_note is not None:
            add_note(context)
        else:  # Python 3.10: what add_note does (the exceptiongroup backport prints it)
            notes = getattr(exc, "__notes__", None)
            if not isinstance(notes, list):
                notes = []
                setattr(exc, "__notes__", notes)  # noqa: B010 - a dunder mypy does not know
            notes.append(context)


def describe(exc: BaseException) -> str:
    """``RuntimeError: cannot open /dev/x``: an exception in one line, its type named (a bare
    ``KeyError`` says only ``'x'``)."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def failure_context(exc: BaseException) -> str | None:
    """``acme.com/widget: discover() failed`` for an exception ``note_failure`` marked."""
    context = getattr(exc, _CONTEXT, None)
    return context if isinstance(context, str) else None


@contextlib.contextmanager
def still_running(resource: str, hook: str, extra: dict[str, Any] | None = None) -> Iterator[None]:
    """Log that ``hook`` of ``resource`` is still running after ``STILL_RUNNING_AFTER``
    seconds, then after twice as long each time (up to a minute apart), until the block ends.

    A timer of the running asyncio loop, not a task: the block's exceptions pass through as
    they are.
    """
    loop = asyncio.get_running_loop()
    delay = elapsed = STILL_RUNNING_AFTER
    handle: asyncio.TimerHandle | None = None

    def report() -> None:
        nonlocal handle, delay, elapsed
        log.warning("%s: %s() still running after %gs", resource, hook, elapsed, extra=extra)
        delay = min(delay * 2, _STILL_RUNNING_MAX)
        elapsed += delay
        handle = loop.call_later(delay, report)

    handle = loop.call_later(delay, report)
    try:
        yield
    finally:
        handle.cancel()


class Calls(Protocol):
    """Counts the hooks suspended in calls (a server's stop waits for them)."""

    def call_started(self) -> None: ...

    def call_ended(self) -> None: ...


async def run_hook(
    awaitable: Awaitable[T], timeout: float, resource: str, hook: str, calls: Calls
) -> T:
    """Await a plugin hook, bounded by ``timeout`` once it suspends.

    The first step of the coroutine is run here and, if it finishes, its result returned with
    no timer armed. A hook that suspends is driven on under ``_bounded`` and counted in
    ``calls`` while it is.

    Raises:
        TimeoutError: the hook did not finish within ``timeout`` seconds.
    """
    if type(awaitable) is not types.CoroutineType:
        # Not a native coroutine (an ``async def`` hook always is): await it in one.
        return await run_hook(_awaited(awaitable), timeout, resource, hook, calls)
    try:
        pending = awaitable.send(None)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    return await _bounded(awaitable, pending, timeout, resource=resource, hook=hook, calls=calls)


async def _bounded(
    coro: Coroutine[Any, Any, T],
    pending: Any,
    timeout: float,
    *,
    resource: str,
    hook: str,
    calls: Calls,
) -> T:
    """Drive a suspended hook coroutine on until it ends or ``timeout`` passes.

    The bound is a native cancellation of this task, not an anyio cancel scope: the hook's
    first step ran outside any scope of ours, and may have entered scopes of its own
    (``anyio.to_thread.run_sync`` does) that a scope entered now would wrongly enclose. A
    cancellation that is not the bound's (the RPC cancelled by the kubelet, the server
    stopping) propagates unchanged. As with grpc.aio's own cancellations, a hook waiting
    in ``anyio.to_thread.run_sync`` gets the cancellation at the bound while its thread
    finishes on its own.
    """
    task = asyncio.current_task()
    assert task is not None  # grpc.aio runs every handler in a task
    cancelling = _cancelling(task)
    expired = False

    def expire() -> None:
        nonlocal expired
        expired = True
        task.cancel()

    timer = asyncio.get_running_loop().call_later(timeout, expire)
    calls.call_started()
    try:
        return await _resumed(coro, pending)
    except asyncio.CancelledError:
        if expired:
            expired = False
            if _uncancel(task) <= cancelling:
                message = f"{resource}: {hook} did not finish within {timeout:g}s"
                raise TimeoutError(message) from None
        raise
    finally:
        timer.cancel()
        if expired:
            _uncancel(task)  # the hook swallowed the bound's cancellation: take it back
        calls.call_ended()


@types.coroutine
def _resumed(coro: Coroutine[Any, Any, T], pending: Any) -> Generator[Any, Any, T]:
    """Go on with ``coro`` after its first suspension (which yielded ``pending``), exactly as
    ``await coro`` would have: every value the task sends and every exception it throws
    (a cancellation) reaches the coroutine."""
    value = pending
    while True:
        try:
            sent = yield value
        except GeneratorExit:
            coro.close()
            raise
        except BaseException as exc:  # handed to the coroutine, as await does
            try:
                value = coro.throw(exc)
            except StopIteration as done:
                return done.value  # type: ignore[no-any-return]
        else:
            try:
                value = coro.send(sent)
            except StopIteration as done:
                return done.value  # type: ignore[no-any-return]


async def _awaited(awaitable: Awaitable[T]) -> T:
    return await awaitable


def _cancelling(task: asyncio.Task[Any]) -> int:
    # Task.cancelling/uncancel exist from Python 3.11: they tell our cancellation from others.
    cancelling = getattr(task, "cancelling", None)
    return 0 if cancelling is None else int(cancelling())


def _uncancel(task: asyncio.Task[Any]) -> int:
    uncancel = getattr(task, "uncancel", None)
    return 0 if uncancel is None else int(uncancel())
