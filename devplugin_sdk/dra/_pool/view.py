"""The pool's slices as the API server holds them, kept by a watch, so that a change is one write
(no list before it) and a quiet pool costs the watch alone.

The watch's events and our own writes keep the view; the echo of our own write costs nothing,
and what the server stored of it (defaulted, or changed by an admission webhook) counts as what
we sent until someone changes it. Each watch resumes from the last version it saw; one that
cannot be reached is watched again from the same version, with no list after it comes back. The
pool is listed only when the view cannot be trusted: at start, after a 410 Gone, a conflict or a
refused write, a watch that broke once open or carried no versions, or a resync period without
a sign of life from the watch. A watch that ends early or fails is reopened with jittered backoff.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence

from devplugin_sdk._backoff import Backoff
from devplugin_sdk.dra._pool.slices import Chunk
from devplugin_sdk.dra.resources import ResourceApi, ResourceSlice, SliceDevice, SliceEvent
from devplugin_sdk.errors import KubeApiError

__all__ = ["View"]

log = logging.getLogger("devplugin_sdk")

# A write read back (its echo came) this long before someone undid it was not fought over: the
# kubelet deleting the node's slices as it restarts, not a second writer answering ours.
_SETTLE = 0.01


class View:
    """One driver's pool on one node as the server holds it.

    Args:
        api: The Kubernetes API.
        driver: The driver name.
        node_name: The node; also the pool's name.
        changed: Called when the pool may differ from what is wanted (someone else changed
            it, or the view must be listed again).
        backoff: Between watches that end early or fail.
    """

    def __init__(
        self,
        api: ResourceApi,
        driver: str,
        node_name: str,
        *,
        changed: Callable[[], None],
        backoff: Backoff,
    ) -> None:
        self.api = api
        self.driver = driver
        self.node_name = node_name
        self._changed = changed
        self._backoff = backoff
        # The pool as the watch's events (and our writes) show it, by slice name; None when it
        # cannot be trusted, and the next ``current`` lists.
        self._known: dict[str, ResourceSlice] | None = None
        # Whether the watch says what changed (an implementation may yield None instead).
        self._content = False
        # The version the next watch resumes from ("" starts over, with ADDED events).
        self._version = ""
        self._alive_at = time.monotonic()  # the watch's last sign of life
        self._events = 0  # events seen so far (a list is a view only if none came during it)
        # Slice name -> (its devices as the server stored our write, the devices we sent).
        self._echo: dict[str, tuple[tuple[SliceDevice, ...], tuple[SliceDevice, ...]]] = {}
        # The slices of our last write whose echo has not come yet, and when the last echo came
        # (our write read back): a write undone well after it was read back is no fight.
        self._unread: set[str] = set()
        self._read_back_at: float | None = None
        self._changed_at: float | None = None  # someone else's first change since that write

    # ------------------------------------------------------------------ for the sync

    async def current(self) -> list[ResourceSlice]:
        """The pool's slices: from the view when it can be trusted (in name order), else listed
        (and the view started from the list, when the watch says what changes)."""
        if self._known is not None:
            return sorted(self._known.values(), key=lambda s: s.name)
        events = self._events
        current = await self.api.list_slices(self.driver, self.node_name)
        if self._content and self._events == events:
            # An event during the list may be newer than what it returned: list again then.
            self._known = {s.name: s for s in current}
        return current

    def holds(
        self, current: Sequence[ResourceSlice], chunks: Sequence[Chunk], *, count: int = 0
    ) -> bool:
        """Whether ``current`` is the pool of ``chunks``: one complete generation, each slice
        holding its chunk (as sent, or as the server stored our write of it); ``count``: the
        pool's slice count when ``current`` and ``chunks`` are a part of it."""
        if len(current) != len(chunks):
            return False
        generation = current[0].generation
        return all(
            s.generation == generation
            and s.slice_count == (count or len(chunks))
            and s.pool == self.node_name
            and self._same_devices(s, chunk.devices)
            and tuple(s.shared_counters) == chunk.counters
            for s, chunk in zip(current, chunks, strict=True)
        )

    def writing(self) -> None:
        """A write of the pool begins: its echoes are awaited from now on."""
        self._unread, self._read_back_at, self._changed_at = set(), None, None

    def wrote(self, stored: ResourceSlice, sent: tuple[SliceDevice, ...]) -> None:
        """The server stored our write of ``sent`` as ``stored``."""
        self._echo[stored.name] = (tuple(stored.devices), sent)
        self._unread.add(stored.name)
        if self._known is not None:
            self._known[stored.name] = stored

    def deleting(self, name: str) -> None:
        """We are deleting slice ``name`` (stale: the pool needs fewer)."""
        self._echo.pop(name, None)

    def deleted(self, name: str) -> None:
        """Slice ``name`` is gone (deleted by us)."""
        if self._known is not None:
            self._known.pop(name, None)

    def forget_echoes(self) -> None:
        """What the server stored of our writes no longer stands for what we send."""
        self._echo.clear()

    def forget(self) -> None:
        """The view cannot be trusted: the next sync lists."""
        self._known = None
        self._changed()

    def quiet_for(self, seconds: float) -> bool:
        """Whether the watch has shown no sign of life (an event, a bookmark, a normal end) for
        ``seconds``: it may have gone deaf."""
        return time.monotonic() - self._alive_at >= seconds

    def stood(self) -> bool:
        """Whether our last write was read back (every slice's echo) and stood at least
        ``_SETTLE`` seconds before someone else changed the pool: undoing it that late is a
        restart of the kubelet, not a fight."""
        at = self._read_back_at
        changed = self._changed_at if self._changed_at is not None else time.monotonic()
        return at is not None and changed - at >= _SETTLE

    def _same_devices(self, stored: ResourceSlice, devices: tuple[SliceDevice, ...]) -> bool:
        """Whether ``stored`` holds ``devices``: as sent, or as the server stored our write of
        them (defaulted, or changed by an admission webhook) and nobody changed since."""
        held = tuple(stored.devices)
        return held == devices or self._echo.get(stored.name) == (held, devices)

    # ------------------------------------------------------------------ the watch

    async def watch(self) -> None:
        """Follow the pool's slices until cancelled, reopening the watch with backoff."""
        backoff = self._backoff
        broken = False
        early = 0  # watches in a row that failed or ended before they had run their course
        while True:
            started = time.monotonic()
            why: str | None = None
            try:
                async for event in self._open():
                    self._seen(event)
            except KubeApiError as exc:
                why = str(exc)
                self._failed(exc)
            lasted = time.monotonic() - started
            if why is None:
                self._alive_at = time.monotonic()
            if not self._version:
                # Nothing to resume from (the watch carried no versions): changes may have
                # been missed while it was closed, so list again.
                self.forget()
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

    def _open(self) -> AsyncIterator[SliceEvent | None]:
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
            self.forget()
            return
        self._content = True
        if _newer(event.resource_version, self._version):
            self._version = event.resource_version
        if event.slice is None or event.kind == "BOOKMARK":
            return
        if self._known is None:
            self._changed()
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
        self._changed()

    def _failed(self, exc: KubeApiError) -> None:
        """A watch that raised: resumable when the API server could not be reached (nothing
        changed that the next watch will not replay); otherwise (410 Gone, a watch that broke
        once open, a refusal) the view is forgotten and the pool listed."""
        if exc.status == 0:
            return
        if exc.status == 410:
            self._version = ""
        self.forget()


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
