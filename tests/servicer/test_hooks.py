"""Hook driving (``_hooks.run_hook``) on its own: one step for a hook that finishes at once, a
bound for one that suspends, exceptions and outside cancellations passed on unchanged."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Generator
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from devplugin_sdk._engine.hooks import run_hook
from devplugin_sdk.errors import AllocationError

RESOURCE = "acme.com/widget"


class _Calls:
    def __init__(self) -> None:
        self.started = 0
        self.ended = 0

    def call_started(self) -> None:
        self.started += 1

    def call_ended(self) -> None:
        self.ended += 1


async def test_a_hook_that_finishes_without_suspending_costs_one_step() -> None:
    """No yield to the event loop, no timer, not counted as in flight."""
    calls = _Calls()
    stepped: list[str] = []

    async def merge() -> str:
        stepped.append("ran")
        return "merged"

    ran_meanwhile = False

    def meanwhile() -> None:
        nonlocal ran_meanwhile
        ran_meanwhile = True

    asyncio.get_running_loop().call_soon(meanwhile)
    assert await run_hook(merge(), 0.0, RESOURCE, "allocate", calls) == "merged"
    assert not ran_meanwhile  # the task never gave the loop a turn
    assert stepped == ["ran"]
    assert (calls.started, calls.ended) == (0, 0)
    await anyio.lowlevel.checkpoint()
    assert ran_meanwhile


async def test_a_hook_that_suspends_is_driven_to_its_answer_and_counted() -> None:
    calls = _Calls()
    seen: list[int] = []

    async def slow() -> int:
        seen.append(calls.started)
        await anyio.sleep(0.01)
        seen.append(calls.started - calls.ended)  # in flight while it suspends
        await anyio.to_thread.run_sync(lambda: None)
        return 7

    assert await run_hook(slow(), 5.0, RESOURCE, "allocate", calls) == 7
    assert seen == [0, 1]
    assert (calls.started, calls.ended) == (1, 1)


async def _hang(outcome: list[str]) -> None:
    """A hook that never finishes; records what ended it."""
    try:
        await anyio.sleep_forever()
    except BaseException as exc:
        outcome.append(type(exc).__name__)
        raise


async def test_a_suspended_hook_is_cancelled_at_its_bound() -> None:
    calls = _Calls()
    outcome: list[str] = []

    with pytest.raises(
        TimeoutError, match=r"^acme.com/widget: allocate did not finish within 0.05s$"
    ):
        await run_hook(_hang(outcome), 0.05, RESOURCE, "allocate", calls)
    assert outcome == ["CancelledError"]
    assert (calls.started, calls.ended) == (1, 1)
    await anyio.lowlevel.checkpoint()  # the task carries no cancellation of ours


async def test_a_hook_waiting_in_a_thread_is_cancelled_at_its_bound() -> None:
    release = threading.Event()
    outcome: list[str] = []

    async def stuck() -> None:
        try:
            await anyio.to_thread.run_sync(release.wait)
        except BaseException as exc:
            outcome.append(type(exc).__name__)
            raise

    try:
        with anyio.fail_after(5), pytest.raises(TimeoutError, match="pre_start_container"):
            await run_hook(stuck(), 0.05, RESOURCE, "pre_start_container", _Calls())
        assert outcome == ["CancelledError"]
    finally:
        release.set()


@pytest.mark.parametrize("suspend", [False, True])
async def test_a_hook_error_propagates_unchanged(suspend: bool) -> None:
    error = AllocationError("widget busy")
    calls = _Calls()

    async def refuse() -> None:
        if suspend:
            await anyio.lowlevel.checkpoint()
        raise error

    with pytest.raises(AllocationError) as info:
        await run_hook(refuse(), 5.0, RESOURCE, "allocate", calls)
    assert info.value is error
    assert (calls.started, calls.ended) == ((1, 1) if suspend else (0, 0))


async def test_a_cancellation_from_outside_is_not_a_timeout() -> None:
    """The kubelet cancelling the call reaches the hook as a cancellation."""
    outcome: list[str] = []

    with anyio.move_on_after(0.05) as scope:
        await run_hook(_hang(outcome), 10.0, RESOURCE, "allocate", _Calls())
    assert scope.cancelled_caught
    assert outcome == ["CancelledError"]


async def test_an_awaitable_that_is_not_a_coroutine_is_awaited() -> None:
    class Answer:
        def __await__(self) -> Generator[Any, None, str]:
            yield from asyncio.sleep(0).__await__()
            return "done"

    assert await run_hook(Answer(), 5.0, RESOURCE, "allocate", _Calls()) == "done"
