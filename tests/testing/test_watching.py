"""``devplugin_sdk.testing.watching``: a plugin's ``watch()`` run alone, its events for a test."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence

import anyio
import pytest

from devplugin_sdk import Device, Health, HealthEvent, RescanEvent
from devplugin_sdk.testing import StaticPlugin, watching


class Pushing(StaticPlugin):
    """Yields the events put on ``feed``; raises what is put there as an exception; returns
    when the feed closes. Counts ``discover()`` calls."""

    def __init__(self) -> None:
        super().__init__("acme.com/widget", [Device("w0"), Device("w1")])
        self.send, self.feed = anyio.create_memory_object_stream[object](10)
        self.discovered = 0

    async def discover(self) -> Sequence[Device]:
        self.discovered += 1
        return await super().discover()

    async def watch(self) -> AsyncIterator[HealthEvent | RescanEvent]:
        async for item in self.feed:
            if isinstance(item, Exception):
                raise item
            assert isinstance(item, (HealthEvent, RescanEvent))
            yield item


DOWN = HealthEvent("w0", Health.UNHEALTHY, "gone")


@pytest.fixture
def plugin() -> Iterator[Pushing]:
    made = Pushing()
    with made.send, made.feed:
        yield made


async def test_events_come_in_order_and_a_rescan_is_followed_by_discover(plugin: Pushing) -> None:
    async with watching(plugin) as events:
        await plugin.send.send(DOWN)
        await plugin.send.send(RescanEvent("plugged"))
        assert await events.take(2) == [DOWN, RescanEvent("plugged")]
        assert plugin.discovered == 1
        await anyio.wait_all_tasks_blocked()
        assert events.pending() == []


async def test_rediscover_false_leaves_discover_to_the_test(plugin: Pushing) -> None:
    async with watching(plugin, rediscover=False) as events:
        await plugin.send.send(RescanEvent("plugged"))
        assert await events.next_event() == RescanEvent("plugged")
    assert plugin.discovered == 0


async def test_no_event_within_the_timeout_fails_with_a_message(plugin: Pushing) -> None:
    async with watching(plugin, timeout=0.05) as events:
        with pytest.raises(AssertionError, match=r"watch\(\) yielded no event within 0\.05 s"):
            await events.next_event()
        with pytest.raises(AssertionError, match=r"within 0\.01 s"):
            await events.until(lambda event: False, timeout=0.01)


async def test_iteration_ends_when_watch_returns_and_next_event_then_fails(plugin: Pushing) -> None:
    async with watching(plugin) as events:
        await plugin.send.send(DOWN)
        plugin.send.close()
        assert [event async for event in events] == [DOWN]
        with pytest.raises(AssertionError, match=r"watch\(\) returned"):
            await events.next_event()


async def test_what_watch_raises_comes_after_the_events_before_it(plugin: Pushing) -> None:
    async with watching(plugin) as events:
        await plugin.send.send(DOWN)
        await plugin.send.send(OSError("NVML went away"))
        assert await events.next_event() == DOWN
        with pytest.raises(OSError, match="NVML went away"):
            await events.next_event()


async def test_an_error_the_test_never_took_is_raised_from_the_block(plugin: Pushing) -> None:

    async def fail_and_leave() -> None:
        async with watching(plugin):
            await plugin.send.send(OSError("NVML went away"))
            await anyio.wait_all_tasks_blocked()

    with pytest.raises(OSError, match="NVML went away"):
        await fail_and_leave()


async def test_until_takes_events_up_to_the_one_it_waits_for(plugin: Pushing) -> None:
    up = HealthEvent("w0", Health.HEALTHY, "back")
    async with watching(plugin) as events:
        for event in (DOWN, up, DOWN):
            await plugin.send.send(event)
        assert await events.until(lambda event: event == up) == [DOWN, up]
        assert await events.next_event() == DOWN
