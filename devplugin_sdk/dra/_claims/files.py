"""The files of one driver's claims: each claim's CDI spec (its name, writing, removal), and the
durable transaction that makes a prepared claim survive a crash.

A prepare writes its metadata, its spec and the new checkpoint (to a temporary file) at once,
and renames the checkpoint into place only when the others are durable: one fsync per file and
one per directory, and the answer waits for about two of them rather than five in a row. The
record never names a spec that a crash could lose, and no spec stays that no record names: a
prepare whose record cannot be written removes the spec it wrote, an unprepare removes the
record before the spec, and a checkpoint that cannot be read deletes no spec (the kubelet may
still hold its CDI IDs): each becomes a recovered entry, which knows its devices from the claim's
metadata files. What the files held is recorded too, and a recorded claim whose files are gone
(a reboot empties ``/var/run/cdi``) gets them written again, at start and on a repeated prepare.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
from collections.abc import Callable, Container, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import anyio
import anyio.to_thread

from devplugin_sdk import _files, cdi
from devplugin_sdk._logging import printable
from devplugin_sdk._wire.dra_model import ClaimRef
from devplugin_sdk.dra._claims.checkpoint import Entry, Staged
from devplugin_sdk.dra._claims.metadata import Metadata
from devplugin_sdk.dra._claims.store import Store

__all__ = ["ClaimFiles", "MetadataWrite", "PersistError", "claim_spec_name"]

log = logging.getLogger("devplugin_sdk")


def claim_spec_name(driver: str, uid: str) -> str:
    """The CDI spec file of one claim: ``k8s.<driver>-claim_<uid>.json``."""
    return f"{_vendor(driver)}-claim_{uid}.json"


def _vendor(driver: str) -> str:
    # CDI vendors prefixed k8s. are what DRA drivers use for per-claim specs; the driver name is
    # a DNS subdomain, which a CDI vendor name may hold as is.
    return f"k8s.{driver}"


class PersistError(Exception):
    """A prepared claim's files could not be written; the message says which and why."""


@dataclass(frozen=True, slots=True)
class MetadataWrite:
    """A request's ``metadata.json``, to be written with the claim's other files."""

    request: str
    write: Callable[[], object]


class ClaimFiles:
    """The CDI specs (and metadata files) of one driver's claims (blocking methods: call from a
    worker thread; the async ones hop there themselves).

    Args:
        driver: The driver name.
        cdi_dir: Where per-claim CDI specs go.
        metadata: The claims' ``metadata.json`` files (KEP-5304); None when none are written.
    """

    def __init__(self, driver: str, cdi_dir: Path, metadata: Metadata | None = None) -> None:
        self.driver = driver
        self.cdi_dir = cdi_dir
        self.metadata = metadata
        #: The CDI kind of the claims' devices.
        self.kind = f"{_vendor(driver)}/claim"
        self._spec_name = re.compile(
            rf"{re.escape(_vendor(driver))}-claim_(?P<uid>[0-9A-Za-z-]+)\.json"
        )
        # cdi.write_spec's temporary files: .<stem>.<8 random characters>.tmp
        self._temp_name = re.compile(
            rf"\.{re.escape(_vendor(driver))}-claim_[0-9A-Za-z-]+\.[a-z0-9_]{{8}}\.tmp"
        )

    def spec_name(self, uid: str) -> str:
        """The claim's CDI spec file (``claim_spec_name``)."""
        return claim_spec_name(self.driver, uid)

    # ------------------------------------------------------------------ start

    def recovered(self, known: Container[str]) -> dict[str, Entry]:
        """A ``recovered`` entry for each claim spec of ours in the CDI directory whose UID is
        not ``known``: the checkpoint was unreadable, and the kubelet may hold its CDI IDs."""
        out: dict[str, Entry] = {}
        # The metadata files (on the plugin's disk, written before the spec that mounts them)
        # say whose claim it is and which devices it holds; the spec names only requests, and
        # the API may not answer at start.
        recorded = self.metadata.recorded() if self.metadata is not None else {}
        for name in self._names():
            match = self._spec_name.fullmatch(name)
            if match is None or match["uid"] in known:
                continue
            uid = match["uid"]
            ref, devices = recorded.get(uid, (ClaimRef("", uid, ""), ()))
            out[uid] = Entry(ref, devices, name, recovered=True)
        return out

    def clean(self, known: Container[str], *, specs: bool = True) -> int:
        """Remove temporary files and (with ``specs``) the claim specs not ``known``; how
        many."""
        removed = 0
        for name in self._names():
            stale = self._temp_name.fullmatch(name) or (
                specs and self._spec_name.fullmatch(name) and name not in known
            )
            if stale:
                with contextlib.suppress(FileNotFoundError):
                    (self.cdi_dir / name).unlink()
                    removed += 1
        return removed

    def settle(self, entries: Mapping[str, Entry]) -> tuple[int, list[str]]:
        """Bring the files in line with a checkpoint read at start: remove temporary files and
        the specs and metadata of claims it does not record (prepares that never answered), and
        write again the recorded claims' files that are gone; how many were removed, and the
        files written (one that cannot be written is logged: the repeated prepare tries again).
        """
        removed = self.clean({e.spec_file for e in entries.values() if e.spec_file})
        if self.metadata is not None:
            removed += self.metadata.clean(entries.keys())
        written: list[str] = []
        for entry in entries.values():
            try:
                written += self.restore(entry)
            except OSError as exc:
                # The file system's refusal, not a traceback.
                log.error(  # noqa: TRY400
                    "DRA %s: cannot write the files of claim %s again: %s",
                    self.driver,
                    printable(str(entry.claim)),
                    exc,
                )
        return removed, written

    def restore(self, entry: Entry) -> list[str]:
        """Write the claim's spec and metadata files again where they are gone, from what its
        entry recorded; the files written (blocking).

        Raises:
            OSError: a file could not be written.
        """
        content = entry.content
        if content is None or entry.recovered:
            return []
        written: list[str] = []
        if (
            content.spec is not None
            and entry.spec_file
            and self._spec_name.fullmatch(entry.spec_file)
        ):
            path = self.cdi_dir / entry.spec_file
            if not os.path.lexists(path):
                self.cdi_dir.mkdir(mode=0o755, parents=True, exist_ok=True)
                data = (json.dumps(content.spec, indent=2) + "\n").encode()
                _files.write_atomically(path, data, mode=0o644)
                written.append(str(path))
        if self.metadata is not None:
            for request, document in content.metadata.items():
                try:
                    path = self.metadata.path(entry.claim.uid, request)
                except ValueError:
                    continue  # not a name this version records
                if not os.path.lexists(path):
                    self.metadata.write(entry.claim.uid, request, document)
                    written.append(str(path))
        return written

    def _names(self) -> list[str]:
        try:
            return sorted(p.name for p in self.cdi_dir.iterdir())
        except OSError:
            return []

    # ------------------------------------------------------------------ prepare

    async def persist(
        self,
        store: Store,
        entry: Entry,
        spec: cdi.CdiSpec | None,
        metadata: Sequence[MetadataWrite],
    ) -> None:
        """Make a prepared claim durable: its metadata files, its CDI spec and its checkpoint
        entry (in ``store``), each file fsynced once and each directory once.

        The metadata, the spec and the new checkpoint (staged in a temporary file) are written
        at the same time, in worker threads; the checkpoint is renamed into place only once
        all of them are durable. On any failure nothing is recorded, and a spec no record names
        is removed.

        Raises:
            PersistError: a file could not be written (the first failure, in that order).
        """
        previous = store.get(entry.claim.uid)  # a recovered entry, whose spec may be in use
        written = _Written(len(metadata))
        async with anyio.create_task_group() as tg:
            for i, write in enumerate(metadata):
                tg.start_soon(written.metadata, i, write)
            if spec is not None and entry.spec_file is not None:
                tg.start_soon(written.spec, self.cdi_dir, spec, entry.spec_file)
            tg.start_soon(written.checkpoint, store, entry)
        if not written.failures and written.staged is not None:
            try:
                await store.commit(written.staged, entry)
            except OSError as exc:
                written.failed(store, exc)
            else:
                if previous is not None and previous.spec_file not in (None, entry.spec_file):
                    await self.remove_spec(previous.spec_file)
                return
        if written.staged is not None:
            await store.discard(written.staged)
        if written.wrote_spec and previous is None:
            # The record and the spec change together: no spec stays that no record names.
            await self.remove_spec(entry.spec_file)
        raise PersistError(written.first())

    async def remove_spec(self, name: str | None) -> None:
        """Remove one claim spec of ours; a failure is logged (the next start removes it)."""
        if name is None or not self._spec_name.fullmatch(name):
            return
        try:
            await anyio.to_thread.run_sync(cdi.remove_spec, self.cdi_dir / name)
        except OSError as exc:
            log.warning("DRA %s: cannot remove CDI spec %s: %s", self.driver, name, exc)

    # ------------------------------------------------------------------ unprepare

    def remove(self, ref: ClaimRef) -> None:
        """Remove the claim's spec and metadata files (blocking). The spec may exist without an
        entry (a prepare that never answered): it goes too.

        Raises:
            OSError: the spec could not be removed (the kubelet's retry, or the next start,
                removes it).
        """
        spec_file = claim_spec_name(self.driver, ref.uid) if ref.uid else None
        if spec_file is not None and self._spec_name.fullmatch(spec_file):
            cdi.remove_spec(self.cdi_dir / spec_file)
        if self.metadata is not None:
            self.metadata.remove(ref)


class _Written:
    """What a prepare's concurrent writes did: each failure by its place (the metadata files in
    order, then the spec, then the checkpoint), whether the spec was written, the staged
    checkpoint."""

    def __init__(self, metadata: int) -> None:
        self._spec_at = metadata
        self._checkpoint_at = metadata + 1
        self.failures: dict[int, str] = {}
        self.wrote_spec = False
        self.staged: Staged | None = None

    async def metadata(self, i: int, write: MetadataWrite) -> None:
        try:
            await anyio.to_thread.run_sync(write.write)
        except OSError as exc:
            self.failures[i] = f"cannot write the device metadata of request {write.request}: {exc}"

    async def spec(self, directory: Path, spec: cdi.CdiSpec, name: str) -> None:
        try:
            await anyio.to_thread.run_sync(cdi.write_spec, spec, directory, name)
        except OSError as exc:
            self.failures[self._spec_at] = f"cannot write CDI spec {name}: {exc}"
        else:
            self.wrote_spec = True

    async def checkpoint(self, store: Store, entry: Entry) -> None:
        try:
            self.staged = await store.stage(entry)
        except OSError as exc:
            self.failed(store, exc)

    def failed(self, store: Store, exc: OSError) -> None:
        self.failures[self._checkpoint_at] = (
            f"cannot write the checkpoint {store.checkpoint.path}: {exc}"
        )

    def first(self) -> str:
        return self.failures[min(self.failures)]
