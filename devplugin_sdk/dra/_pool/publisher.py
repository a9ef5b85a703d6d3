"""Keeps a driver's ResourceSlices on one node equal to the devices it offers.

One pool per node, named after the node, as Kubernetes' resourceslice controller does: at most
128 devices per slice, every slice of the pool at the same generation, the generation bumped on
every change (consumers only trust the slices of the highest generation, and a pool whose
slice count is not complete). Slices are owned by the Node, so they go with it. Stale slices
(more than needed, or from a previous run) are updated in place or deleted; slices someone else
changes or deletes (the kubelet deletes every slice of its node when it starts) are noticed
through a watch, and a periodic resync, and written again. The watch's events keep a view of the
pool, so that a change is one write (no list before it, and its own echo costs nothing) and a
quiet pool costs the watch alone: each watch resumes from the last version it saw, and a list is
made only when that view cannot be trusted (at start, after a 410 Gone, a conflict, a watch that
broke once open, or a resync period without a sign of life from the watch). An API server that
cannot be reached is watched again from the same version, with no list after it comes back.
Changes of the devices within ``coalesce`` seconds (a flapping device) make one write. Every
retry (a refused write, a conflict, a watch that ends at once, a second writer undoing ours)
waits a jittered backoff, and a write that never sticks is given up, loudly, until the devices
change or the next resync.
Slices stay when the plugin stops: the kubelet removes them 30 s after the driver is gone for
good, and a restarted plugin takes them over; nothing is written before the first ``want``, so a
restart never publishes the pool short of the devices its plugins have yet to report. Devices
carry their taints (64 devices per slice when any has one); a taint that a stored slice already
has keeps its ``timeAdded``. An API server that silently drops taints (``DRADeviceTaints`` off)
is noticed on the first write that carried one: from then on a device with a ``NoSchedule`` or
``NoExecute`` taint is withdrawn instead, and advisories are not published, with one warning.
The pool's counter sets (partitionable devices) go in slices of their own, first, as Kubernetes
1.35 requires ("only one of Devices and SharedCounters can be set"), 8 sets per slice; a slice
with a device that consumes counters holds 64 devices, as with taints. An API server that drops
counters (``DRAPartitionableDevices`` off, before 1.36) is noticed as taints are: from then on the
whole devices of partitions are withdrawn (the scheduler could otherwise give a GPU and its MIG
devices at once) and the partitions published without counters; one that drops
``allowMultipleAllocations`` (``DRAConsumableCapacity`` off) is said once: its shared devices are
allocated whole, which the preparer handles.
"""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace

import anyio

from devplugin_sdk._backoff import Backoff
from devplugin_sdk.dra.resources import (
    MAX_COUNTER_SETS_PER_SLICE,
    MAX_DEVICES_PER_SLICE,
    MAX_DEVICES_PER_SLICE_WITH_TAINTS,
    CounterSet,
    DeviceTaint,
    ResourceApi,
    ResourceSlice,
    SliceDevice,
    SliceEvent,
)
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
# A write read back (its echo came) this long before someone undid it was not fought over: the
# kubelet deleting the node's slices as it restarts, not a second writer answering ours.
_SETTLE = 0.01
_LOG_AGAIN_AFTER = 60.0
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
    ) -> None:
        self.api = api
        self.driver = driver
        self.node_name = node_name
        self.give_up_after = give_up_after
        self.resync_seconds = resync_seconds
        self.coalesce = coalesce
        self.generation = 0
        self.published: tuple[SliceDevice, ...] | None = None
        self.syncs = 0
        # The API server dropped the taints of a write (its DRADeviceTaints feature is off):
        # tainted devices are withdrawn instead, for the rest of this process.
        self.taints_dropped = False
        # The same for counters (DRAPartitionableDevices off): whole devices are withdrawn.
        self.counters_dropped = False
        self._said_shares_dropped = False
        self.last_error: str | None = None
        self._retry = Backoff(retry_first, retry_max)
        self._watch_retry = Backoff(retry_first, retry_max)
        self._wanted: tuple[SliceDevice, ...] = ()
        self._wanted_counters: tuple[CounterSet, ...] = ()
        self.published_counters: tuple[CounterSet, ...] = ()
        self._wanted_at = time.monotonic()
        self._dirty = anyio.Event()
        # Set by the first ``want``: before it, the content is unknown, not empty (a restarted
        # driver whose plugins are still discovering must not withdraw its pool).
        self._given = anyio.Event()
        self._done = anyio.Event()
        self._new_content = anyio.Event()
        self._node_uid: str | None = None
        self._logged: tuple[str, float] = ("", 0.0)
        self._gave_up: tuple[SliceDevice, ...] | None = None  # the content given up on
        # The content the last sync wrote (None: it wrote nothing): the next sync of the same
        # content sees whether it stuck.
        self._wrote: tuple[SliceDevice, ...] | None = None
        self._undone = 0  # syncs in a row that found our last write undone
        # Slice name -> (its devices as the server stored our write, the devices we sent): a
        # server that defaults or a webhook that adds fields is no reason to write again.
        self._echo: dict[str, tuple[tuple[SliceDevice, ...], tuple[SliceDevice, ...]]] = {}
        # The pool as the watch's events (and our writes) show it, by slice name; None when it
        # cannot be trusted, and the next sync lists.
        self._known: dict[str, ResourceSlice] | None = None
        # Whether the watch says what changed (an implementation may yield None instead).
        self._content = False
        # The version the next watch resumes from ("" starts over, with ADDED events).
        self._version = ""
        self._alive_at = time.monotonic()  # the watch's last sign of life
        self._events = 0  # events seen so far (a list is a view only if none came during it)
        # The slices of our last write whose echo has not come yet, and when the last echo came
        # (our write read back): a write undone well after it was read back is no fight.
        self._unread: set[str] = set()
        self._read_back_at: float | None = None
        self._changed_at: float | None = None  # someone else's first change since that write

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
            tg.start_soon(self._watch)
            # The watch starts with an event for every slice that exists (a restarted driver's
            # pool): those wait for the content instead of syncing an empty one.
            await self._given.wait()
            while True:
                await self._wait_for_work()
                if self.coalesce and self.published is not None and self._wanted != self.published:
                    await anyio.sleep(self.coalesce)  # a flap's next change joins this write
                content = self._wanted
                stood = self._stood()  # before this sync writes (and starts reading back anew)
                try:
                    wrote = await self._sync()
                except KubeApiError as exc:
                    if exc.status != 0:
                        self._known = None  # a conflict, a refusal: list before writing again
                    self._wrote, self._undone = None, 0
                    await self._retry_after(str(exc), conflict=exc.conflict)
                    continue
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
                    self._retry.reset()  # the last write stuck (read back, or nothing to do)
                if self.last_error is not None:
                    log.info("DRA %s: publishing ResourceSlices works again", self.driver)
                    self.last_error = None

    async def _wait_for_work(self) -> None:
        """Until something may need publishing: a change (the watch, ``want``) or the resync;
        after giving up, only new content or the resync."""
        with anyio.move_on_after(self.resync_seconds) as resync:
            if self._gave_up is None:
                await self._dirty.wait()
            while self._gave_up == self._wanted:
                await self._new_content.wait()
        if resync.cancelled_caught and time.monotonic() - self._alive_at >= self.resync_seconds:
            self._known = None  # the watch may have gone deaf: list
        if self._gave_up is not None:
            self._gave_up = None
            self._wrote, self._undone = None, 0
            self._retry.reset()
        self._dirty = anyio.Event()

    async def _retry_after(self, why: str, *, conflict: bool) -> None:
        """A failed attempt: wait the backoff and try again, or give up after the bound."""
        self.last_error = why
        delay = self._retry.next()
        if self._retry.attempts >= self.give_up_after:
            self._gave_up = self._wanted
            self._logged = (why, time.monotonic())
            log.error(
                "DRA %s: giving up publishing ResourceSlices after %d attempts: %s; trying again "
                "when the devices change or in %gs",
                self.driver,
                self._retry.attempts,
                why,
                self.resync_seconds,
            )
            return
        self._failed(why, delay, conflict=conflict)
        await anyio.sleep(delay)
        self._dirty.set()

    async def _watch(self) -> None:
        backoff = self._watch_retry
        broken = False
        early = 0  # watches in a row that failed or ended before they had run their course
        while True:
            started = time.monotonic()
            why: str | None = None
            try:
                async for event in self._watch_slices():
                    self._seen(event)
            except KubeApiError as exc:
                why = str(exc)
                self._watch_failed(exc)
            lasted = time.monotonic() - started
            if why is None:
                self._alive_at = time.monotonic()
            if not self._version:
                # Nothing to resume from (the watch carried no versions): changes may have
                # been missed while it was closed, so list again.
                self._forget()
            if why is None and lasted >= backoff.cap:
                # It ran its course: one that outlasts the longest delay is a working watch.
                if broken:
                    log.info("DRA %s: the ResourceSlice watch works again", self.driver)
                broken = False
                early = 0
                backoff.reset()
            else:
                early += 1
                # One early end is ordinary (an API server restarting); an error or a second
                # one in a row is a state, said once.
                if not broken and (why is not None or early > 1):
                    log.warning(
                        "DRA %s: the ResourceSlice watch keeps ending (%s); reopening it with "
                        "backoff up to %gs",
                        self.driver,
                        why or f"ended by the server after {lasted:.1f}s",
                        backoff.cap,
                    )
                    broken = True
                else:
                    log.debug("DRA %s: the ResourceSlice watch ended: %s", self.driver, why)
            await backoff.sleep()

    def _watch_slices(self) -> AsyncIterator[SliceEvent | None]:
        # An implementation that predates resuming takes no version: only one that has sent
        # versions is given one.
        if self._version:
            return self.api.watch_slices(self.driver, self.node_name, self._version)
        return self.api.watch_slices(self.driver, self.node_name)

    def _seen(self, event: SliceEvent | None) -> None:
        """One event of the watch: the view follows it, and a change someone else made (not
        the echo of our own write, not what we already knew) calls for a sync."""
        self._alive_at = time.monotonic()
        self._events += 1
        if event is None:
            self._content = False  # it cannot say what changed: list
            self._forget()
            return
        self._content = True
        if _newer(event.resource_version, self._version):
            self._version = event.resource_version
        if event.slice is None or event.kind == "BOOKMARK":
            return
        if self._known is None:
            self._dirty.set()
            return
        name = event.slice.name
        held = self._known.get(name)
        if event.kind == "DELETED":
            if held is None:
                return  # deleted by us, or never ours to know
            del self._known[name]
        elif held is not None and not _newer(event.slice.resource_version, held.resource_version):
            # The echo of our own write, or a version we already have.
            if name in self._unread:
                self._unread.discard(name)
                if not self._unread:
                    self._read_back_at = time.monotonic()
            return
        else:
            self._known[name] = event.slice
        if self._changed_at is None:
            self._changed_at = time.monotonic()
        self._dirty.set()

    def _stood(self) -> bool:
        """Whether our last write was read back (every slice's echo) and stood at least
        ``_SETTLE`` seconds before someone else changed the pool: undoing it that late is a
        restart of the kubelet, not a fight."""
        at = self._read_back_at
        changed = self._changed_at if self._changed_at is not None else time.monotonic()
        return at is not None and changed - at >= _SETTLE

    def _watch_failed(self, exc: KubeApiError) -> None:
        """A watch that raised: resumable when the API server could not be reached (nothing
        changed that the next watch will not replay); otherwise (410 Gone, a watch that broke
        once open, a refusal) the view is forgotten and the pool listed."""
        if exc.status == 0:
            return
        if exc.status == 410:
            self._version = ""
        self._forget()

    def _forget(self) -> None:
        self._known = None
        self._dirty.set()

    def _failed(self, why: str, delay: float, *, conflict: bool) -> None:
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

    async def _owner(self) -> str:
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

    async def _sync(self) -> bool:
        """List the pool and write what differs; whether anything was written."""
        asked = self._wanted
        asked_counters = self._wanted_counters
        current = await self._current()
        self.syncs += 1
        wanted = _keep_time_added(self._shaped(asked), current)
        chunks = _chunks(wanted, () if self.counters_dropped else asked_counters)
        if self._matches(current, chunks):
            self.generation = current[0].generation
            self._published(asked, asked_counters)
            return False
        owner = await self._owner()
        self._unread, self._read_back_at, self._changed_at = set(), None, None
        generation = max([s.generation for s in current] + [self.generation]) + 1
        count = len(chunks)
        for i, (devices, counters) in enumerate(chunks):
            stored = await self._write(
                current[i] if i < len(current) else None,
                owner,
                generation,
                count,
                devices,
                counters=counters,
            )
            if any(d.taints for d in devices) and not any(d.taints for d in stored.devices):
                self._taints_dropped()
                return True
            if _lost_counters(devices, counters, stored):
                self._counters_dropped()
                return True
            if any(d.allow_multiple_allocations for d in devices) and not any(
                d.allow_multiple_allocations for d in stored.devices
            ):
                self._shares_dropped()
            self._echo[stored.name] = (tuple(stored.devices), tuple(devices))
            self._unread.add(stored.name)
            if self._known is not None:
                self._known[stored.name] = stored
        for stale in current[count:]:
            self._echo.pop(stale.name, None)
            try:
                await self.api.delete_slice(stale.name)
            except KubeApiError as exc:
                if not exc.not_found:
                    raise
            if self._known is not None:
                self._known.pop(stale.name, None)
        self.generation = generation
        log.log(
            # In a fight, _retry_after says it.
            logging.DEBUG if self._undone else logging.INFO,
            "DRA %s: published %d devices in %d ResourceSlices (pool %s, generation %d)",
            self.driver,
            len(wanted),
            count,
            self.node_name,
            generation,
            extra={"driver": self.driver},
        )
        self._published(asked, asked_counters)
        return True

    async def _current(self) -> list[ResourceSlice]:
        """The pool's slices: from the watch's view when it can be trusted, else listed (and
        the view started from the list, when the watch says what changes)."""
        if self._known is not None:
            return sorted(self._known.values(), key=lambda s: s.name)
        events = self._events
        current = await self.api.list_slices(self.driver, self.node_name)
        if self._content and self._events == events:
            # An event during the list may be newer than what it returned: list again then.
            self._known = {s.name: s for s in current}
        return current

    def _shaped(self, wanted: tuple[SliceDevice, ...]) -> tuple[SliceDevice, ...]:
        """``wanted`` as this API server can hold it: without taints when it drops them, a
        device tainted ``NoSchedule`` or ``NoExecute`` withdrawn; without counters when it
        drops them, a device that consumes a whole counter set (a GPU beside its MIG devices)
        withdrawn."""
        if self.counters_dropped:
            totals = {c.name: c.counters for c in self._wanted_counters}
            wanted = tuple(
                replace(d, consumes_counters=())
                for d in wanted
                if not any(totals.get(c.counter_set) == c.counters for c in d.consumes_counters)
            )
        if not self.taints_dropped:
            return wanted
        return tuple(
            replace(d, taints=()) for d in wanted if all(t.effect == "None" for t in d.taints)
        )

    def _counters_dropped(self) -> None:
        """The server stored a write without its counters: withdraw whole devices instead."""
        self.counters_dropped = True
        self._wrote = None
        self._echo.clear()
        self._dirty.set()
        log.warning(
            "DRA %s: the API server dropped the devices' counters (its DRAPartitionableDevices "
            "feature is off; on by default from Kubernetes 1.36): whole devices that have "
            "partitions (a GPU beside its MIG devices) are withdrawn, until this driver restarts",
            self.driver,
        )

    def _shares_dropped(self) -> None:
        if not self._said_shares_dropped:
            self._said_shares_dropped = True
            log.warning(
                "DRA %s: the API server dropped allowMultipleAllocations (its "
                "DRAConsumableCapacity feature is off; on by default from Kubernetes 1.36): each "
                "shared device is allocated to one claim at a time, which gets all its shares",
                self.driver,
            )

    def _taints_dropped(self) -> None:
        """The server stored a write without the taints it carried: withdraw instead."""
        self.taints_dropped = True
        self._wrote = None
        self._echo.clear()
        self._dirty.set()
        log.warning(
            "DRA %s: the API server dropped the devices' taints (its DRADeviceTaints feature is "
            "off; on by default from Kubernetes 1.36): unhealthy devices are withdrawn from the "
            "pool instead and advisories are not published, until this driver restarts",
            self.driver,
        )

    async def _write(
        self,
        old: ResourceSlice | None,
        owner: str,
        generation: int,
        count: int,
        devices: tuple[SliceDevice, ...],
        *,
        counters: tuple[CounterSet, ...] = (),
    ) -> ResourceSlice:
        """Update ``old`` (or create a slice) to hold ``devices`` or ``counters``; what the
        server stored."""
        if old is not None:
            return await self.api.update_slice(
                replace(
                    old,
                    pool=self.node_name,
                    generation=generation,
                    slice_count=count,
                    devices=devices,
                    node_uid=old.node_uid or owner,
                    shared_counters=counters,
                )
            )
        return await self.api.create_slice(
            ResourceSlice(
                name="",
                driver=self.driver,
                node_name=self.node_name,
                pool=self.node_name,
                generation=generation,
                slice_count=count,
                devices=devices,
                node_uid=owner,
                shared_counters=counters,
            )
        )

    def _published(
        self, wanted: tuple[SliceDevice, ...], counters: tuple[CounterSet, ...] = ()
    ) -> None:
        self.published = wanted
        self.published_counters = counters
        self._done.set()
        self._done = anyio.Event()

    def _matches(self, current: Sequence[ResourceSlice], chunks: Sequence[_Chunk]) -> bool:
        if len(current) != len(chunks):
            return False
        generation = current[0].generation
        return all(
            s.generation == generation
            and s.slice_count == len(chunks)
            and s.pool == self.node_name
            and self._same_devices(s, tuple(devices))
            and tuple(s.shared_counters) == counters
            for s, (devices, counters) in zip(current, chunks, strict=True)
        )

    def _same_devices(self, stored: ResourceSlice, devices: tuple[SliceDevice, ...]) -> bool:
        """Whether ``stored`` holds ``devices``: as sent, or as the server stored our write of
        them (defaulted, or changed by an admission webhook) and nobody changed since."""
        held = tuple(stored.devices)
        return held == devices or self._echo.get(stored.name) == (held, devices)


_Chunk = tuple[tuple[SliceDevice, ...], tuple[CounterSet, ...]]


def _newer(version: str, than: str) -> bool:
    """Whether resource version ``version`` comes after ``than`` ("" comes before all). The
    API server's versions are etcd revisions, numbers that grow with every change; one that is
    not a number is taken as newer when it differs."""
    if not version:
        return False
    if not than:
        return True
    try:
        return int(version) > int(than)
    except ValueError:
        return version != than


def _lost_counters(
    devices: tuple[SliceDevice, ...], counters: tuple[CounterSet, ...], stored: ResourceSlice
) -> bool:
    """Whether the server stored a write of counters (sets, or devices' consumption) without
    them."""
    if counters and not stored.shared_counters:
        return True
    return any(d.consumes_counters for d in devices) and not any(
        d.consumes_counters for d in stored.devices
    )


def _chunks(devices: tuple[SliceDevice, ...], counters: tuple[CounterSet, ...]) -> list[_Chunk]:
    """The slices' contents: counter sets first, in slices of their own (Kubernetes 1.35: "only
    one of Devices and SharedCounters can be set in a ResourceSlice"), then the devices, 64 a
    slice when any has taints or consumes counters (the API's
    ResourceSliceMaxDevicesWithTaintsOrConsumesCounters)."""
    size = (
        MAX_DEVICES_PER_SLICE_WITH_TAINTS
        if any(d.taints or d.consumes_counters for d in devices)
        else MAX_DEVICES_PER_SLICE
    )
    out: list[_Chunk] = [
        ((), counters[i : i + MAX_COUNTER_SETS_PER_SLICE])
        for i in range(0, len(counters), MAX_COUNTER_SETS_PER_SLICE)
    ]
    out += [(devices[i : i + size], ()) for i in range(0, len(devices), size)]
    return out or [((), ())]


def _keep_time_added(
    wanted: tuple[SliceDevice, ...], current: Sequence[ResourceSlice]
) -> tuple[SliceDevice, ...]:
    """``wanted`` with each taint's ``timeAdded`` as a stored slice already has it for the same
    device, key, value and effect (a taint that stays keeps its time, across restarts too)."""
    held: dict[tuple[str, str, str, str], datetime.datetime] = {}
    for s in current:
        for d in s.devices:
            for t in d.taints:
                if t.time_added is not None:
                    held[(d.name, t.key, t.value, t.effect)] = t.time_added
    if not held:
        return wanted
    return tuple(
        replace(d, taints=tuple(_with_time(d.name, t, held) for t in d.taints)) if d.taints else d
        for d in wanted
    )


def _with_time(
    name: str, taint: DeviceTaint, held: dict[tuple[str, str, str, str], datetime.datetime]
) -> DeviceTaint:
    kept = held.get((name, taint.key, taint.value, taint.effect))
    return taint if kept is None or kept == taint.time_added else replace(taint, time_added=kept)
