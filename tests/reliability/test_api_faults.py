"""The Kubernetes API under faults, through the real client (lightkube) on a loopback API server.

A watch the server ends at once, a watch that goes silent, 409 conflicts, a mutating webhook and
a second writer: the ResourceSlice publisher backs off with jitter, notices what it missed within
a bounded time, and gives up loudly after a bound instead of spinning. The figures (requests in a
window) are generous bounds that the spinning code broke by two orders of magnitude.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import replace
from pathlib import Path

import anyio
import pytest
from dra_helpers import DRIVER
from kube_apiserver import FakeApiServer

from devplugin_sdk.dra import ResourceSlice, SliceDevice
from devplugin_sdk.dra._kube import LightkubeApi
from devplugin_sdk.dra._pool.publisher import Publisher
from devplugin_sdk.dra.resources import DeviceTaint, SliceEvent
from devplugin_sdk.errors import KubeApiError
from devplugin_sdk.testing import MemoryApi

NODE = "node-1"
# How long each measurement watches the requests (a window, not a wait for an event).
WINDOW = 2.0


def _devices(*names: str) -> list[SliceDevice]:
    return [SliceDevice(name, {"index": i}) for i, name in enumerate(names)]


class _Records(logging.Handler):
    """The SDK's log records, with an event per record (waited on, never polled)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []
        self.changed = anyio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)
        self.changed.set()
        self.changed = anyio.Event()

    def at_least(self, level: int) -> list[str]:
        return [r.getMessage() for r in self.records if r.levelno >= level]

    async def wait_for(self, text: str, timeout: float) -> str:
        with anyio.fail_after(timeout):
            while True:
                for record in self.records:
                    if text in record.getMessage():
                        return record.getMessage()
                await self.changed.wait()


@contextmanager
def _sdk_log() -> Iterator[_Records]:
    handler = _Records()
    logger = logging.getLogger("devplugin_sdk")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


@asynccontextmanager
async def _publishing(
    tmp_path: Path, server: FakeApiServer, **publisher: float
) -> AsyncIterator[Publisher]:
    """A publisher on the real client to ``server``, running until the block ends."""
    api = LightkubeApi.connect(
        server.kubeconfig(tmp_path / "kubeconfig"),
        **{k: publisher.pop(k) for k in ("watch_timeout", "read_timeout") if k in publisher},
    )
    pub = Publisher(api, DRIVER, NODE, **publisher)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(pub.run)
            yield pub
            tg.cancel_scope.cancel()
    finally:
        await api.aclose()


async def _published(pub: Publisher, names: tuple[str, ...], timeout: float = 10) -> None:
    pub.want(_devices(*names))
    with anyio.fail_after(timeout):
        await pub.wait_published()


# ---------------------------------------------------------------- row 2: a watch ended at once


async def test_a_watch_the_server_ends_at_once_is_reopened_with_backoff(tmp_path: Path) -> None:
    memory = MemoryApi(nodes=[NODE])
    async with FakeApiServer(memory).serving() as server:
        server.watch_fault = "end"
        with _sdk_log() as log:
            async with _publishing(tmp_path, server) as pub:
                await _published(pub, ("w0", "w1"))
                before, gets = len(server.watch_queries), server.count("GET")
                await anyio.sleep(WINDOW)  # the measuring window
                watches = len(server.watch_queries) - before
                lists = server.count("GET") - gets - watches
    # Reopened at once, it made 621-785 watch requests a second; backing off from 0.5 s to 30 s,
    # a handful in the window.
    assert watches <= 8, f"{watches} watch requests in {WINDOW}s"
    assert lists <= 10, f"{lists} lists in {WINDOW}s"
    said = [m for m in log.at_least(logging.INFO) if "watch" in m]
    assert len(said) == 1, said  # once per state change, not once per reopening
    assert "the ResourceSlice watch keeps ending" in said[0]


async def test_a_watch_that_ran_its_course_resets_the_backoff(tmp_path: Path) -> None:
    """timeoutSeconds ends every watch: that is no fault, and the publisher says nothing."""
    memory = MemoryApi(nodes=[NODE])
    async with FakeApiServer(memory).serving() as server:
        with _sdk_log() as log:
            async with _publishing(
                tmp_path, server, watch_timeout=0.3, retry_first=0.05, retry_max=0.2
            ) as pub:
                await _published(pub, ("w0",))
                with anyio.fail_after(10):
                    await server.wait_for_watches(4)
        assert not [m for m in log.at_least(logging.INFO) if "watch" in m]
    assert all("timeoutSeconds" in q for q in server.watch_queries)


# ---------------------------------------------------------------- row 3: a watch gone silent


async def test_a_silent_watch_is_noticed_and_the_pool_republished(tmp_path: Path) -> None:
    memory = MemoryApi(nodes=[NODE])
    async with FakeApiServer(memory).serving() as server:
        server.watch_fault = "silent"
        # The periodic resync is out of reach: only the watch's own bounds can notice.
        async with _publishing(
            tmp_path, server, watch_timeout=1, read_timeout=2, resync_seconds=3600
        ) as pub:
            await _published(pub, ("w0", "w1"))
            memory.wipe_slices(NODE)  # as a starting kubelet does; the watch never says
            started = anyio.current_time()
            with anyio.fail_after(15):
                await memory.wait_pool_complete(DRIVER, NODE)
            took = anyio.current_time() - started
    # The server is asked to end each watch, and the client gives up on a silent one.
    assert server.watch_queries
    assert all("timeoutSeconds" in q for q in server.watch_queries)
    assert took < 10, f"republished after {took:.1f}s"


async def test_the_periodic_resync_republishes_without_any_watch_event(tmp_path: Path) -> None:
    """A watch that never says anything (and never fails) still costs at most a resync period."""

    class DeafApi(MemoryApi):
        async def watch_slices(self, driver: str, node_name: str) -> AsyncIterator[None]:
            await anyio.sleep_forever()
            yield None

    memory = DeafApi(nodes=[NODE])
    pub = Publisher(memory, DRIVER, NODE, resync_seconds=0.5)
    async with anyio.create_task_group() as tg:
        tg.start_soon(pub.run)
        await _published(pub, ("w0",))
        memory.wipe_slices(NODE)
        with anyio.fail_after(10):
            await memory.wait_pool_complete(DRIVER, NODE)
        tg.cancel_scope.cancel()


# ---------------------------------------------------------------- row 4: conflicts and fights


async def test_conflicts_are_retried_with_backoff(tmp_path: Path) -> None:
    memory = MemoryApi(nodes=[NODE])
    async with FakeApiServer(memory).serving() as server:
        with _sdk_log() as log:
            async with _publishing(tmp_path, server) as pub:
                await _published(pub, ("w0",))
                server.conflicts = True
                pub.want(_devices("w0", "w1"))  # an update: every PUT is a 409
                before = server.count("PUT")
                await anyio.sleep(WINDOW)  # the measuring window
                puts = server.count("PUT") - before
                assert pub.last_error is not None
                assert "has been modified" in pub.last_error
    # Retried at once, a 409 made 1,285-1,303 requests a second.
    assert puts <= 8, f"{puts} PUTs in {WINDOW}s"
    loud = log.at_least(logging.WARNING)
    assert 1 <= len(loud) <= 2, loud  # the message once, not once per retry


async def test_conflicts_without_end_give_up_loudly_after_a_bound(tmp_path: Path) -> None:
    memory = MemoryApi(nodes=[NODE])
    async with FakeApiServer(memory).serving() as server:
        with _sdk_log() as log:
            async with _publishing(
                tmp_path, server, retry_first=0.01, retry_max=0.05, give_up_after=5
            ) as pub:
                await _published(pub, ("w0",))
                server.conflicts = True
                pub.want(_devices("w0", "w1"))
                said = await log.wait_for("giving up", timeout=10)
                puts = server.count("PUT")
                await anyio.sleep(WINDOW)  # the measuring window: nothing more is written
                assert server.count("PUT") == puts
                # New content is a new attempt: it is tried again, and it works.
                server.conflicts = False
                await _published(pub, ("w0", "w1", "w2"))
                assert pub.last_error is None
    assert "after 5 attempts" in said
    assert next(r for r in log.records if "giving up" in r.getMessage()).levelno == logging.ERROR
    assert puts <= 5 + 1


async def test_a_mutating_webhook_is_no_reason_to_write_again(tmp_path: Path) -> None:
    def webhook(s: ResourceSlice) -> ResourceSlice:
        # Adds an attribute of its own to every device, as an admission webhook may.
        devices = tuple(
            replace(d, attributes={**d.attributes, "zone.example.com/rack": "r1"})
            for d in s.devices
        )
        return replace(s, devices=devices)

    memory = MemoryApi(nodes=[NODE])
    async with FakeApiServer(memory).serving() as server:
        server.mutate = webhook
        with _sdk_log() as log:
            async with _publishing(tmp_path, server) as pub:
                await _published(pub, ("w0", "w1"))
                # New content at once, before the first write was read back: a new write, no
                # fight.
                await _published(pub, ("w0",))
                await anyio.sleep(WINDOW)  # the measuring window
                writes = server.count("POST") + server.count("PUT")
    # Comparing the server's version with ours, it wrote 466-521 times a second.
    assert writes == 2, writes
    assert not log.at_least(logging.WARNING)
    (stored,) = memory.pool(DRIVER, NODE)
    assert stored.generation == 2
    assert [d.name for d in stored.devices] == ["w0"]
    assert stored.devices[0].attributes["zone.example.com/rack"] == "r1"


async def test_the_kubelets_wipe_right_after_a_write_is_no_fight(tmp_path: Path) -> None:
    """A starting kubelet deletes the node's slices, maybe just after the driver wrote them:
    written again at once, and no warning."""
    memory = MemoryApi(nodes=[NODE])
    async with FakeApiServer(memory).serving() as server:
        with _sdk_log() as log:
            async with _publishing(tmp_path, server) as pub:
                await _published(pub, ("w0",))
                memory.wipe_slices(NODE)  # before the publisher read its write back
                with anyio.fail_after(5):
                    await memory.wait_pool_complete(DRIVER, NODE)
                await anyio.sleep(WINDOW)  # the window in which a warning would come
    assert not log.at_least(logging.WARNING)
    assert server.count("POST") == 2


async def test_kubelet_restarts_seconds_apart_are_each_republished_at_once(tmp_path: Path) -> None:
    """Each wipe of a write that stood (a kubelet restarting, however often it flaps) is written
    again at once: only a write undone again before the driver read it back is a fight."""
    memory = MemoryApi(nodes=[NODE])
    async with FakeApiServer(memory).serving() as server:
        with _sdk_log() as log:
            async with _publishing(tmp_path, server) as pub:
                await _published(pub, ("w0",))
                for _ in range(3):
                    await anyio.sleep(0.3)  # the scenario: the write stands, read back
                    memory.wipe_slices(NODE)
                    with anyio.fail_after(5):
                        await memory.wait_pool_complete(DRIVER, NODE)
                assert pub.last_error is None
    assert not log.at_least(logging.WARNING)
    assert server.count("POST") == 4


async def test_a_second_writer_is_not_fought_at_full_speed(tmp_path: Path) -> None:
    memory = MemoryApi(nodes=[NODE])

    async def other_writer() -> None:
        # Another process that wants the slices to hold its own device, and says so at once.
        theirs = (SliceDevice("x9"),)
        seen = memory.generation
        while True:
            seen = await memory.wait_changed(seen)
            for s in await memory.list_slices(DRIVER, NODE):
                if s.devices != theirs:
                    await memory.update_slice(replace(s, devices=theirs))

    async with FakeApiServer(memory).serving() as server:
        with _sdk_log() as log:
            async with _publishing(tmp_path, server) as pub, anyio.create_task_group() as tg:
                await _published(pub, ("w0",))
                before = server.count("PUT") + server.count("POST")
                tg.start_soon(other_writer)
                pub.want(_devices("w0", "w1"))
                await anyio.sleep(WINDOW)  # the measuring window
                writes = server.count("PUT") + server.count("POST") - before
                tg.cancel_scope.cancel()
    # Rewriting at once, the two wrote ~1,100 times a second.
    assert writes <= 8, f"{writes} writes in {WINDOW}s"
    assert any("someone else keeps changing" in m for m in log.at_least(logging.WARNING))


@pytest.mark.parametrize("first", [0.2, 1.0])
def test_the_backoff_grows_to_its_cap_with_jitter_below_each_step(first: float) -> None:
    from devplugin_sdk._backoff import Backoff

    backoff = Backoff(first, 8 * first)
    delays = [backoff.next() for _ in range(6)]
    steps = [first, 2 * first, 4 * first, 8 * first, 8 * first, 8 * first]
    assert all(s / 2 <= d <= s for d, s in zip(delays, steps, strict=True)), delays
    assert len({round(d, 9) for d in delays}) > 1  # jittered
    backoff.reset()
    assert backoff.attempts == 0
    assert first / 2 <= backoff.next() <= first


async def test_the_loopback_watch_reports_every_change_in_order(tmp_path: Path) -> None:
    """As the API server's: a slice created and deleted between two reads is two events (a
    watch that compared snapshots lost them, and with them a republish after a wipe)."""
    memory = MemoryApi(nodes=[NODE])
    first = await memory.create_slice(ResourceSlice("", DRIVER, NODE, NODE, 1, 1))
    async with FakeApiServer(memory).serving() as server:
        api = LightkubeApi.connect(server.kubeconfig(tmp_path / "kubeconfig"))
        events = 0
        changed = anyio.Event()
        try:
            async with anyio.create_task_group() as tg:

                async def watch() -> None:
                    nonlocal events, changed
                    async for _ in api.watch_slices(DRIVER, NODE):
                        events += 1
                        changed.set()
                        changed = anyio.Event()

                tg.start_soon(watch)
                with anyio.fail_after(5):
                    while events < 1:  # the existing slice, ADDED: the watch has started
                        await changed.wait()
                    made = await memory.create_slice(ResourceSlice("", DRIVER, NODE, NODE, 1, 1))
                    await memory.delete_slice(made.name)  # before the watch could read
                    while events < 3:
                        await changed.wait()
                tg.cancel_scope.cancel()
        finally:
            await api.aclose()
    assert memory.changes_since(0) == (
        3,
        [("ADDED", first), ("ADDED", made), ("DELETED", made)],
    )


# ---------------------------------------------------------------- issue 29: a fleet's load


class _CutApi(MemoryApi):
    """A MemoryApi whose open watch can be cut as an API server going away cuts it: the watch
    raises an unreachable error, losing what it had not sent yet."""

    def __init__(self) -> None:
        super().__init__(nodes=[NODE])
        self.versions: list[str] = []
        self._cutting = False

    def cut_and_wipe(self) -> None:
        """Cut the watch, and delete the node's slices while it is down (a kubelet starting)."""
        self._cutting = True
        self.wipe_slices(NODE)

    async def watch_slices(
        self, driver: str, node_name: str, resource_version: str = ""
    ) -> AsyncIterator[SliceEvent | None]:
        self.versions.append(resource_version)
        async for event in super().watch_slices(driver, node_name, resource_version):
            if self._cutting:
                self._cutting = False
                raise KubeApiError(0, "connection reset")
            yield event


def _count(api: MemoryApi) -> dict[str, int]:
    return dict(api.calls)


def _delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


async def test_a_change_is_one_write_and_its_echo_costs_no_request() -> None:
    memory = MemoryApi(nodes=[NODE])
    pub = Publisher(memory, DRIVER, NODE)
    async with anyio.create_task_group() as tg:
        tg.start_soon(pub.run)
        await _published(pub, ("w0", "w1"))
        await anyio.sleep(0.1)  # the first write's echo
        before = _count(memory)
        tainted = [replace(_devices("w0")[0], taints=(DeviceTaint("k", "", "NoSchedule"),))]
        await _published(pub, ("w0", "w1"))  # no change: nothing
        pub.want([*tainted, *_devices("w0", "w1")[1:]])
        with anyio.fail_after(5):
            await pub.wait_published()
        await anyio.sleep(0.2)  # the write's echo arrives, and costs nothing
        assert _delta(_count(memory), before) == {"update_slice": 1}
        tg.cancel_scope.cancel()


async def test_flaps_within_the_window_are_one_write() -> None:
    memory = MemoryApi(nodes=[NODE])
    pub = Publisher(memory, DRIVER, NODE, coalesce=0.05)
    async with anyio.create_task_group() as tg:
        tg.start_soon(pub.run)
        await _published(pub, ("w0", "w1"))
        await anyio.sleep(0.1)
        before = _count(memory)
        taint = (DeviceTaint("k", "", "NoSchedule"),)
        for tainted in (True, False, True):
            pub.want([replace(d, taints=taint if tainted else ()) for d in _devices("w0", "w1")])
            await anyio.sleep(0.005)
        with anyio.fail_after(5):
            await pub.wait_published()
        await anyio.sleep(0.2)
        assert _delta(_count(memory), before) == {"update_slice": 1}
        assert all(d.taints for s in memory.pool(DRIVER, NODE) for d in s.devices)
        tg.cancel_scope.cancel()


async def test_a_cut_watch_resumes_from_its_version_and_replays_what_happened_meanwhile() -> None:
    memory = _CutApi()
    pub = Publisher(memory, DRIVER, NODE, retry_first=0.05, retry_max=0.2)
    async with anyio.create_task_group() as tg:
        tg.start_soon(pub.run)
        await _published(pub, ("w0", "w1"))
        await anyio.sleep(0.1)
        before = _count(memory)
        memory.cut_and_wipe()
        memory.fail_next(0, "connection refused")  # the first reopening, too
        with anyio.fail_after(10):
            await memory.wait_pool_complete(DRIVER, NODE)
        calls = _delta(_count(memory), before)
        # Replayed from the version, not listed: the wipe's DELETED events came with the watch.
        assert calls == {"watch_slices": 2, "create_slice": 1}, calls
        assert memory.versions[0] == ""
        assert all(memory.versions[1:]), memory.versions
        tg.cancel_scope.cancel()


async def test_a_version_too_old_to_resume_lists_again() -> None:
    class GoneApi(MemoryApi):
        """Every watch ends after the slices that exist; resuming one is refused (410)."""

        gone = 0
        relisted = anyio.Event()

        async def list_slices(self, driver: str, node_name: str) -> list[ResourceSlice]:
            if self.gone:
                self.relisted.set()
            return await super().list_slices(driver, node_name)

        async def watch_slices(
            self, driver: str, node_name: str, resource_version: str = ""
        ) -> AsyncIterator[SliceEvent | None]:
            if resource_version:
                self.gone += 1
                raise KubeApiError(410, "too old resource version")
            for s in await self.list_slices(driver, node_name):
                yield SliceEvent("ADDED", s, s.resource_version)

    memory = GoneApi(nodes=[NODE])
    pub = Publisher(memory, DRIVER, NODE, retry_first=0.05, retry_max=0.2)
    async with anyio.create_task_group() as tg:
        tg.start_soon(pub.run)
        await _published(pub, ("w0", "w1"))
        with anyio.fail_after(10):
            await memory.relisted.wait()  # refused to resume: the pool is listed again
        tg.cancel_scope.cancel()


async def test_a_watch_through_the_real_client_resumes_from_its_version(tmp_path: Path) -> None:
    memory = MemoryApi(nodes=[NODE])
    async with FakeApiServer(memory).serving() as server:
        async with _publishing(
            tmp_path, server, watch_timeout=0.3, retry_first=0.05, retry_max=0.2
        ) as pub:
            await _published(pub, ("w0",))
            with anyio.fail_after(10):
                await server.wait_for_watches(4)
            lists = memory.calls.get("list_slices", 0)
            with anyio.fail_after(10):
                await server.wait_for_watches(len(server.watch_queries) + 3)
            memory.wipe_slices(NODE)
            with anyio.fail_after(10):
                await memory.wait_pool_complete(DRIVER, NODE)
    assert server.watch_queries[0].get("resourceVersion", "") == ""
    assert all(q.get("resourceVersion") for q in server.watch_queries[2:]), server.watch_queries
    assert all(q.get("allowWatchBookmarks") == "true" for q in server.watch_queries)
    # A watch that ran its course is resumed, not followed by a list.
    assert memory.calls.get("list_slices", 0) == lists


async def test_wipes_after_the_write_was_read_back_are_no_fight() -> None:
    # The echo of our write is read back without a list; a kubelet deleting the slices after
    # that (it restarts seconds apart) is answered every time, never taken for a fight.
    memory = MemoryApi(nodes=[NODE])
    pub = Publisher(memory, DRIVER, NODE)
    async with anyio.create_task_group() as tg:
        tg.start_soon(pub.run)
        await _published(pub, ("w0", "w1"))
        for _ in range(6):
            await anyio.sleep(0.05)
            memory.wipe_slices(NODE)
            with anyio.fail_after(5):
                await memory.wait_pool_complete(DRIVER, NODE)
        assert pub.last_error is None
        tg.cancel_scope.cancel()
