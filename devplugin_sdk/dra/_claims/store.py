"""The prepared claims of one driver on this node: the table, its checkpoint, and the lock that
the driver's instances on the node share.

The table has one owner: every change goes through the checkpoint first (a prepare's staged
file is renamed into place, an unprepare's record is written) and only then into the table, so
what the table holds is what a restart reads back. During a rolling upgrade two instances (pods)
of the driver run side by side, and the kubelet may prepare a claim through one and unprepare it
through the other (it calls the most recent connected plugin, pkg/kubelet/cm/dra/plugin). As
Kubernetes' kubeletplugin helper does with ``RollingUpdate``, every call then holds an exclusive
``flock`` on ``serialize.lock`` in the driver's private directory (``lock.py``), and the table is
read again from the checkpoint when another process wrote it since this one last looked (the
generation in the file says). Without a pod UID there is one instance, and nothing is locked.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from types import MappingProxyType

import anyio
import anyio.to_thread

from devplugin_sdk._wire.dra_model import ClaimRef
from devplugin_sdk.dra._claims.checkpoint import Checkpoint, Entry, Loaded, Staged
from devplugin_sdk.dra._claims.lock import InstanceLock
from devplugin_sdk.dra._claims.shares import Use

__all__ = ["LOCK_NAME", "Store"]

log = logging.getLogger("devplugin_sdk")

#: The lock file's name, as the kubeletplugin helper names it.
LOCK_NAME = "serialize.lock"


class Store:
    """The prepared claims by UID, as every instance of the driver on this node sees them.

    Args:
        checkpoint: The driver's checkpoint (shared by the instances).
        lock_path: The lock file; None when this is the only instance (nothing is locked, and
            nothing is read again).
        lock_timeout: The longest wait for another instance to release the lock, seconds.

    Attributes:
        loaded: What the start's ``load`` found (a problem, when the file was set aside).
        reloads: How many times another instance's writes were read in.
    """

    def __init__(
        self, checkpoint: Checkpoint, lock_path: Path | None = None, *, lock_timeout: float = 20.0
    ) -> None:
        self.checkpoint = checkpoint
        self.lock_path = lock_path
        self.loaded = Loaded()
        self.reloads = 0
        self._entries: dict[str, Entry] = {}
        # Claims whose prepare is under way outside the lock: what they will hold (``reserve``).
        self._reserved: dict[str, Entry] = {}
        self._lock = InstanceLock(lock_path, lock_timeout) if lock_path is not None else None

    # ------------------------------------------------------------------ reading

    def get(self, uid: str) -> Entry | None:
        """The claim's entry, or None."""
        return self._entries.get(uid)

    def entries(self) -> Mapping[str, Entry]:
        """Every entry by UID (a read-only view; changes go through this store)."""
        return MappingProxyType(self._entries)

    def recovered(self) -> int:
        """Claims known only by the CDI spec kept for them (the checkpoint was unreadable)."""
        return sum(entry.recovered for entry in self._entries.values())

    def held_exclusively(self, *, but: str = "") -> dict[str, ClaimRef]:
        """The devices prepared (or reserved) for a claim that holds them alone (not shares,
        not admin), but the claim of UID ``but``. A recovered claim's devices are what its
        metadata files say."""
        held: dict[str, ClaimRef] = {}
        for uid, entry in (*self._entries.items(), *self._reserved.items()):
            if uid == but:
                continue
            admin = {u.device for u in entry.uses if u.admin}
            for d in entry.devices:
                if not d.share_id and d.device not in admin:
                    held[d.device] = entry.claim
        return held

    def holding(self) -> list[Entry]:
        """The claims prepared or being prepared (reserved): what other claims still hold when
        one is unprepared."""
        return [*self._entries.values(), *self._reserved.values()]

    def uses(self) -> list[tuple[Use, str]]:
        """What the prepared (and reserved) claims hold beyond their devices, each with its
        claim."""
        entries = (*self._entries.values(), *self._reserved.values())
        return [(u, str(e.claim)) for e in entries for u in e.uses]

    def reserving(self, uid: str) -> bool:
        """Whether a prepare of the claim is under way."""
        return uid in self._reserved

    def reserve(self, entry: Entry) -> None:
        """Count what ``entry`` holds as held while its claim's prepare runs its slow part
        outside the lock (``release`` ends it, once recorded or failed): two prepares never
        both take one device."""
        self._reserved[entry.claim.uid] = entry

    def release(self, uid: str) -> None:
        """End the claim's reservation."""
        self._reserved.pop(uid, None)

    # ------------------------------------------------------------------ start

    async def load(self) -> Loaded:
        """Read the checkpoint (at start, under ``held(reload=False)``) and remove the
        temporary files a killed writer left."""
        loaded = await anyio.to_thread.run_sync(self.checkpoint.load)
        self.loaded = loaded
        self._replace(loaded.entries)
        await anyio.to_thread.run_sync(self.checkpoint.remove_temporaries)
        if loaded.converted_from is not None:
            log.info(
                "DRA: the checkpoint %s is in format %s; it is written in the current one at the "
                "next change",
                self.checkpoint.path,
                loaded.converted_from,
            )
        return loaded

    def recover(self, entries: Mapping[str, Entry]) -> None:
        """Add the ``recovered`` entries rebuilt from CDI specs (the checkpoint was unreadable);
        ``save`` records them."""
        for uid, entry in entries.items():
            self._entries.setdefault(uid, entry)

    async def save(self) -> None:
        """Write the table as it is.

        Raises:
            OSError: it could not be written.
        """
        await anyio.to_thread.run_sync(self.checkpoint.save, dict(self._entries))

    # ------------------------------------------------------------------ changes

    async def stage(self, entry: Entry) -> Staged:
        """The checkpoint with ``entry``, written to a temporary file (``commit`` puts it in
        place and in the table, ``discard`` drops it).

        Raises:
            OSError: it could not be written.
        """
        entries = {**self._entries, entry.claim.uid: entry}
        return await anyio.to_thread.run_sync(self.checkpoint.stage, entries)

    async def commit(self, staged: Staged, entry: Entry) -> None:
        """Rename a staged checkpoint into place; ``entry`` is then in the table.

        Raises:
            OSError: it could not be renamed (nothing changed).
        """
        await anyio.to_thread.run_sync(self.checkpoint.commit, staged)
        self._entries[entry.claim.uid] = entry

    async def discard(self, staged: Staged) -> None:
        """Drop a staged checkpoint."""
        await anyio.to_thread.run_sync(self.checkpoint.discard, staged)

    async def remove(self, uid: str, then: Callable[[], object]) -> Entry | None:
        """Remove the claim's entry and write the checkpoint without it, then call ``then`` (the
        claim's files) in the same worker thread; the entry removed, or None.

        Raises:
            OSError: the checkpoint could not be written (the entry stays, ``then`` is not
                called: its files stay with it) or ``then`` failed (the entry is gone).
        """
        entry = self._entries.pop(uid, None)
        remaining = dict(self._entries) if entry is not None else None

        def work() -> None:
            if remaining is not None:
                try:
                    self.checkpoint.save(remaining)
                except OSError as exc:
                    raise _Unrecorded(exc) from exc
            then()

        try:
            await anyio.to_thread.run_sync(work)
        except _Unrecorded as exc:
            if entry is not None:
                self._entries[uid] = entry
            raise exc.error from None
        return entry

    # ------------------------------------------------------------------ the instances' lock

    @contextlib.asynccontextmanager
    async def held(self, *, reload: bool = True) -> AsyncIterator[None]:
        """Hold the lock the driver's instances share (``lock.InstanceLock``: this process
        holds it while any of its calls is in this block); with ``reload``, the table is
        brought up to date with the checkpoint when the lock is taken (at start, ``load`` reads
        it instead).

        Raises:
            LockError: the lock file is unusable, or another process held the lock too long
                (nothing changes).
        """
        if self._lock is None:
            yield
            return

        async def fresh() -> None:
            if reload and await anyio.to_thread.run_sync(self.checkpoint.changed):
                await self._reload()

        async with self._lock.held(fresh):
            yield

    async def _reload(self) -> None:
        loaded = await anyio.to_thread.run_sync(self.checkpoint.load)
        if loaded.problem is not None:
            # Moved aside by load(); our own view is written back by the next change.
            log.error(
                "DRA: the checkpoint %s written by another instance cannot be used: %s; "
                "keeping this instance's %d prepared claims",
                self.checkpoint.path,
                loaded.problem,
                len(self._entries),
            )
            return
        self.reloads += 1
        self._replace(loaded.entries)

    def _replace(self, entries: Mapping[str, Entry]) -> None:
        self._entries.clear()  # in place: ``entries()`` views stay true
        self._entries.update(entries)


class _Unrecorded(Exception):
    """The checkpoint could not be written during a removal (``error`` says why)."""

    def __init__(self, error: OSError) -> None:
        super().__init__(str(error))
        self.error = error
