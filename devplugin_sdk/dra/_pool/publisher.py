"""Keeps a driver's ResourceSlices on one node equal to the devices it offers: the sync loop.

One pool per node, named after the node, as Kubernetes' resourceslice controller does: every
slice of the pool at the same generation, the generation bumped when devices come, go or move
between slices (consumers only trust the slices of the highest generation, and a pool whose
slice count is not complete). The
pool is cut into slices by ``slices.py``; what the server holds is ``view.py``'s watch-fed view,
and a sync writes what differs from it: stale slices (more than needed, or from a previous run)
are updated in place or deleted, and slices someone else changes or deletes (the kubelet deletes
every slice of its node when it starts) are written again, on the watch's word or the periodic
resync. Changes of the devices within ``coalesce`` seconds (a flapping device) make one write,
and new content is written at most every ``min_interval`` seconds (a storm of changes is one new
state a write, at a bounded rate); a write that keeps every device in its slice keeps the
generation, so that a reader between two writes never finds the pool short.
Every retry (a refused write, a conflict, a second writer undoing ours) waits a jittered
backoff, and a write that never sticks is given up, loudly, until the devices change or the next
resync. A field the server drops from a write is reported to ``dropped.py``'s policy, which
shapes what is written from then on.
Slices stay when the plugin stops: the kubelet removes them 30 s after the driver is gone for
good, and a restarted plugin takes them over; nothing is written before the first ``want``, so a
restart never publishes the pool short of the devices its plugins have yet to report.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import anyio

from devplugin_sdk._backoff import Backoff
from devplugin_sdk.dra._pool import slices as _slices
from devplugin_sdk.dra._pool.attempts import Attempts
from devplugin_sdk.dra._pool.dropped import Dropped
from devplugin_sdk.dra._pool.view import View
from devplugin_sdk.dra.resources import CounterSet, ResourceApi, ResourceSlice, SliceDevice
from devplugin_sdk.errors import KubeApiError

__all__ = ["Publisher"]

log = logging.getLogger("devplugin_sdk")

_RETRY_FIRST = 0.5
_RETRY_MAX = 30.0
# About 2.5 minutes of retries (0.5 s doubling to 30 s, jittered) before giving up on a content.
_GIVE_UP_AFTER = 10
# Compare this often even if the watch says nothing; list when the watch has shown no sign of
# life (an event, a bookmark, a normal end) for as long (a silent watch costs this much).
_RESYNC = 300.0
# Device changes this close together are published as one write (a flapping device's health):
# a single change waits this long more before it is written.
_COALESCE = 0.01
# New content is written at most this often (each write of a pool of N slices is N writes that
# every consumer's watch receives: the scheduler's, an autoscaler's). 200 devices flapping made
# 100 slice writes a second, and nothing acts on a device's health faster than a scheduling
# cycle: a storm is written twice a second, its newest state each time, while a change after a
# quiet half second still goes out ``coalesce`` after it.
_MIN_INTERVAL = 0.5
_FOUGHT = (
    "someone else keeps changing them back (another writer, or an admission webhook that "
    "changes what it is given)"
)


class Publisher:
    """Publishes one driver's pool on one node.

    Args:
        api: The Kubernetes API.
        driver: The driver name.
        node_name: The node; also the pool's name.
        dropped: The policy for fields the server drops (by default, ``Dropped(driver)``).
    """

    def __init__(
        self,
        api: ResourceApi,
        driver: str,
        node_name: str,
        *,
        retry_first: float = _RETRY_FIRST,
        retry_max: float = _RETRY_MAX,
        give_up_after: int = _GIVE_UP_AFTER,
        resync_seconds: float = _RESYNC,
        coalesce: float = _COALESCE,
        min_interval: float = _MIN_INTERVAL,
        dropped: Dropped | None = None,
    ) -> None:
        self.api = api
        self.driver = driver
        self.node_name = node_name
        self.resync_seconds = resync_seconds
        self.coalesce = coalesce
        self.min_interval = min_interval
        self.dropped = dropped if dropped is not None else Dropped(driver)
        self.view = View(
            api, driver, node_name, changed=self._wake, backoff=Backoff(retry_first, retry_max)
        )
        self.generation = 0
        self.published: tuple[SliceDevice, ...] | None = None
        self.published_counters: tuple[CounterSet, ...] = ()
        self.syncs = 0
        self.attempts = Attempts(
            driver, Backoff(retry_first, retry_max), give_up_after, resync_seconds
        )
        self._wanted: tuple[SliceDevice, ...] = ()
        self._wanted_counters: tuple[CounterSet, ...] = ()
        self._wanted_at = time.monotonic()
        self._dirty = anyio.Event()
        # Set by the first ``want``: before it, the content is unknown, not empty (a restarted
        # driver whose plugins are still discovering must not withdraw its pool).
        self._given = anyio.Event()
        self._done = anyio.Event()
        self._new_content = anyio.Event()
        self._node_uid: str | None = None
        self._gave_up: tuple[SliceDevice, ...] | None = None  # the content given up on
        # The content the last sync wrote (None: it wrote nothing): the next sync of the same
        # content sees whether it stuck.
        self._wrote: tuple[SliceDevice, ...] | None = None
        self._undone = 0  # syncs in a row that found our last write undone
        self._wrote_at: float | None = None  # when the last sync that wrote began

    @property
    def taints_dropped(self) -> bool:
        """The API server dropped the taints of a write (its DRADeviceTaints feature is off):
        tainted devices are withdrawn instead, for the rest of this process."""
        return self.dropped.taints

    def want(self, devices: Sequence[SliceDevice], counter_sets: Sequence[CounterSet] = ()) -> None:
        """Make ``devices`` and ``counter_sets`` (each sorted by name) the pool's content;
        published soon after."""
        wanted = tuple(sorted(devices, key=lambda d: d.name))
        counters = tuple(sorted(counter_sets, key=lambda c: c.name))
        if wanted != self._wanted or counters != self._wanted_counters:
            self._wanted = wanted
            self._wanted_counters = counters
            self._wanted_at = time.monotonic()
            self._new_content.set()
            self._new_content = anyio.Event()
        if not self._given.is_set():
            self._wanted_at = time.monotonic()
            self._given.set()
        self._dirty.set()

    @property
    def pending_seconds(self) -> float:
        """How long the wanted content has waited unpublished (0 when published, or before the
        first ``want``)."""
        if self.published == self._wanted or not self._given.is_set():
            return 0.0
        return time.monotonic() - self._wanted_at

    async def wait_published(self) -> None:
        """Wait until the wanted content is published (for tests and start-up)."""
        while self.published != self._wanted or self.published_counters != self._wanted_counters:
            await self._done.wait()

    async def run(self) -> None:
        """Publish until cancelled: on every ``want``, whenever the slices change, and every
        ``resync_seconds``; nothing before the first ``want``."""
        async with anyio.create_task_group() as tg:
            tg.start_soon(self.view.watch)
            # The watch starts with an event for every slice that exists (a restarted driver's
            # pool): those wait for the content instead of syncing an empty one.
            await self._given.wait()
            while True:
                await self._wait_for_work()
                if self.published is not None and self._wanted != self.published:
                    await self._pace()
                content = self._wanted
                stood = self.view.stood()  # before this sync writes (and reads back anew)
                started = time.monotonic()
                try:
                    wrote = await self._sync()
                except KubeApiError as exc:
                    if exc.status != 0:
                        self.view.forget()  # a conflict, a refusal: list before writing again
                    self._wrote, self._undone = None, 0
                    await self._retry_after(str(exc), conflict=exc.conflict)
                    continue
                if wrote:
                    self._wrote_at = started
                # Undone: written again though the devices did not change, and the last write
                # was not read back (its echo) well before someone changed it.
                undone = wrote and self._wrote == content and not stood
                self._wrote = content if wrote else None
                self._undone = self._undone + 1 if undone else 0
                if self._undone > 1:
                    # Our write of this content was undone twice in a row: once is the kubelet
                    # deleting the node's slices as it starts; writing again at once is a fight.
                    await self._retry_after(_FOUGHT, conflict=True)
                    continue
                if not wrote or stood:
                    self.attempts.stuck()
                self.attempts.worked()

    async def _pace(self) -> None:
        """New content: wait ``coalesce`` (a flap's next change joins this write) and until
        ``min_interval`` has passed since the last write began (a storm is written at a bounded
        rate, the newest content each time)."""
        due = self.coalesce
        if self._wrote_at is not None:
            due = max(due, self._wrote_at + self.min_interval - time.monotonic())
        if due > 0:
            await anyio.sleep(due)

    def _wake(self) -> None:
        """The pool may need a sync (the view saw a change, or must be listed)."""
        self._dirty.set()

    async def _wait_for_work(self) -> None:
        """Until something may need publishing: a change (the watch, ``want``) or the resync;
        after giving up, only new content or the resync."""
        with anyio.move_on_after(self.resync_seconds) as resync:
            if self._gave_up is None:
                await self._dirty.wait()
            while self._gave_up == self._wanted:
                await self._new_content.wait()
        if resync.cancelled_caught and self.view.quiet_for(self.resync_seconds):
            self.view.forget()  # the watch may have gone deaf: list
        if self._gave_up is not None:
            self._gave_up = None
            self._wrote, self._undone = None, 0
            self.attempts.stuck()
        self._dirty = anyio.Event()

    @property
    def last_error(self) -> str | None:
        """Why the last attempt to publish failed; None once one works again."""
        return self.attempts.last_error

    async def _retry_after(self, why: str, *, conflict: bool) -> None:
        """A failed attempt: wait the backoff and try again, or give up after the bound."""
        delay = self.attempts.failed(why, conflict=conflict)
        if delay is None:
            self._gave_up = self._wanted
            return
        await anyio.sleep(delay)
        self._dirty.set()

    async def _sync(self) -> bool:
        """Write what differs between the wanted pool and the server's; whether anything was
        written."""
        asked = self._wanted
        asked_counters = self._wanted_counters
        current = _slices.in_order(await self.view.current())
        self.syncs += 1
        devices, counters = self.dropped.shape(asked, asked_counters)
        devices = _slices.keep_time_added(devices, current)
        chunks = _slices.split(devices, counters)
        if self.view.holds(current, chunks):
            self.generation = current[0].generation
            self._published(asked, asked_counters)
            return False
        # Upstream's resourceslice controller (syncPool) keeps the generation when at most one
        # slice is updated and none created (one write: no reader sees the pool half written),
        # else bumps it and writes in this order: obsolete slices deleted, the others updated,
        # new ones created; between those writes the newest generation is short. Ours keeps it
        # whenever the devices stay in their slices (a flap, a storm of taints: only their
        # descriptions change, so each write leaves a complete pool) and bumps it, in upstream's
        # order, only when devices come, go or move (``slices.same_layout``).
        in_place = _slices.same_layout(current, chunks)
        top = max([s.generation for s in current] + [self.generation])
        generation = current[0].generation if in_place else top + 1
        if not await self._write(current, chunks, generation, in_place=in_place):
            return True  # a field was dropped: the next sync writes the content reshaped
        self.generation = generation
        log.log(
            # In a fight, _retry_after says it.
            logging.DEBUG if self._undone else logging.INFO,
            "DRA %s: published %d devices in %d ResourceSlices (pool %s, generation %d)",
            self.driver,
            len(devices),
            len(chunks),
            self.node_name,
            generation,
            extra={"driver": self.driver},
        )
        self._published(asked, asked_counters)
        return True

    async def _write(
        self,
        current: Sequence[ResourceSlice],
        chunks: Sequence[_slices.Chunk],
        generation: int,
        *,
        in_place: bool,
    ) -> bool:
        """Write ``chunks`` at ``generation`` over the ``current`` slices: the stale ones (a
        slice fewer) deleted first, then each slice updated in order, a slice more created;
        ``in_place`` (the generation kept), only the slices whose content changed. False when
        the server dropped a field the policy reshapes the pool for (the rest of the write is
        moot)."""
        owner = await self._owner()
        self.view.writing()
        count = len(chunks)
        for stale in current[count:]:
            self.view.deleting(stale.name)
            try:
                await self.api.delete_slice(stale.name)
            except KubeApiError as exc:
                if not exc.not_found:
                    raise
            self.view.deleted(stale.name)
        for i, chunk in enumerate(chunks):
            old = current[i] if i < len(current) else None
            if in_place and old is not None and self.view.holds([old], [chunk], count=count):
                continue
            new = _slices.slice_for(
                old,
                chunk,
                driver=self.driver,
                node_name=self.node_name,
                owner=owner,
                generation=generation,
                count=count,
            )
            if old is not None:
                stored = await self.api.update_slice(new)
            else:
                stored = await self.api.create_slice(new)
            if self.dropped.report(_slices.dropped_fields(chunk, stored)):
                self._wrote = None
                self.view.forget_echoes()
                self._dirty.set()
                return False
            self.view.wrote(stored, chunk.devices)
        return True

    async def _owner(self) -> str:
        """The UID of the Node (the slices' owner); "" when there is no such Node."""
        if self._node_uid is None:
            try:
                self._node_uid = await self.api.node_uid(self.node_name)
            except KubeApiError as exc:
                if not exc.not_found:
                    raise
                log.warning(
                    "DRA %s: node %s not found; its ResourceSlices get no owner",
                    self.driver,
                    self.node_name,
                )
                self._node_uid = ""
        return self._node_uid

    def _published(
        self, wanted: tuple[SliceDevice, ...], counters: tuple[CounterSet, ...] = ()
    ) -> None:
        self.published = wanted
        self.published_counters = counters
        self._done.set()
        self._done = anyio.Event()
