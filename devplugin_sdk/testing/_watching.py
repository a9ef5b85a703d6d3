"""``watching(plugin)``: a plugin's ``watch()`` run as the SDK runs it, its events for a test.

Authors who push health (``watch()``) test it without a kubelet: the generator runs in a task,
each ``RescanEvent`` is followed by ``discover()`` before the next event is asked for (what the
SDK's device feed does), and the test takes events one by one with a timeout that fails the test
with a message instead of hanging it.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

import anyio

from devplugin_sdk.types import HealthEvent, RescanEvent

if TYPE_CHECKING:
    from anyio.streams.memory import MemoryObjectReceiveStream

    from devplugin_sdk.plugin import DevicePlugin

Event = HealthEvent | RescanEvent


class WatchedEvents:
    """The events a running ``watch()`` yielded, in order; from ``watching(plugin)``.

    ``async for event in events`` takes them until ``watch()`` returns, each within the timeout.
    """

    def __init__(self, receive: MemoryObjectReceiveStream[Event], timeout: float) -> None:
        self._receive = receive
        self.timeout = timeout
        self.error: Exception | None = None  # what watch() raised, once it did
        self.error_taken = False  # next_event raised it

    async def next_event(self, timeout: float | None = None) -> Event:
        """The next event.

        Args:
            timeout: seconds to wait; ``watching``'s timeout when None.

        Raises:
            AssertionError: no event came within the timeout, or ``watch()`` returned.
            Exception: what ``watch()`` raised, once every event before it was taken.
        """
        event = await self._receive_one(timeout)
        if event is None:
            raise AssertionError("watch() returned; no further event")
        return event

    async def take(self, count: int, timeout: float | None = None) -> list[Event]:
        """The next ``count`` events, each within the timeout."""
        return [await self.next_event(timeout) for _ in range(count)]

    async def until(
        self, stop: Callable[[Event], bool], timeout: float | None = None
    ) -> list[Event]:
        """The events up to and including the first one ``stop`` accepts."""
        got = [await self.next_event(timeout)]
        while not stop(got[-1]):
            got.append(await self.next_event(timeout))
        return got

    def pending(self) -> list[Event]:
        """Take the events already yielded, without waiting (after
        ``anyio.wait_all_tasks_blocked()``, an empty list says that nothing else comes)."""
        taken: list[Event] = []
        with contextlib.suppress(anyio.WouldBlock, anyio.EndOfStream):
            while True:
                taken.append(self._receive.receive_nowait())
        return taken

    async def __aiter__(self) -> AsyncIterator[Event]:
        while (event := await self._receive_one(None)) is not None:
            yield event

    async def _receive_one(self, timeout: float | None) -> Event | None:
        """The next event; None once ``watch()`` returned and every event was taken."""
        limit = self.timeout if timeout is None else timeout
        with anyio.move_on_after(limit):
            try:
                return await self._receive.receive()
            except anyio.EndOfStream:
                if self.error is not None:
                    self.error_taken = True
                    raise self.error from None
                return None
        raise AssertionError(f"watch() yielded no event within {limit:g} s")


@contextlib.asynccontextmanager
async def watching(
    plugin: DevicePlugin, *, timeout: float = 5.0, rediscover: bool = True
) -> AsyncIterator[WatchedEvents]:
    """Run ``plugin.watch()`` in the background for the body of an ``async with``.

    Yields once the new task is waiting (in ``watch()`` or before it), so that a change the
    test makes next is one the watch can see. On exit the watch is cancelled and closed::

        async with watching(plugin) as events:
            break_the_device()
            assert await events.next_event() == HealthEvent("dev0", Health.UNHEALTHY, "gone")

    Args:
        plugin: the plugin whose ``watch()`` to run (``discover()`` need not have run).
        timeout: seconds ``next_event`` (and iteration) waits for an event before failing.
        rediscover: call ``plugin.discover()`` after each ``RescanEvent`` before asking for the
            next event, as the SDK does.

    Raises:
        Exception: what ``watch()`` raised, if the test has not taken it from ``next_event``.
    """
    send, receive = anyio.create_memory_object_stream[Event](100)
    events = WatchedEvents(receive, timeout)

    async def pump() -> None:
        with send:
            try:
                async with contextlib.aclosing(plugin.watch()) as watched:  # type: ignore[type-var]
                    async for event in watched:
                        if rediscover and isinstance(event, RescanEvent):
                            await plugin.discover()
                        await send.send(event)
            except Exception as exc:  # handed to the test, in order after the events before it
                events.error = exc

    with receive:
        async with anyio.create_task_group() as tg:
            tg.start_soon(pump)
            await anyio.wait_all_tasks_blocked()
            try:
                yield events
            finally:
                tg.cancel_scope.cancel()
    if events.error is not None and not events.error_taken:
        raise events.error
