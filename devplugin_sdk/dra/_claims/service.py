"""NodePrepareResources and NodeUnprepareResources of a DRA driver: the kubelet's calls for many
claims, and the claims side's start.

For each claim the kubelet names, the service reads the ResourceClaim (before the lock, as
Kubernetes' kubeletplugin helper does), then has the preparer reserve each claim not prepared
yet (under the lock), run its plugins' hooks (outside it: a hanging one delays no other claim)
and record it (under the lock again), and answers per claim: every claim succeeds or fails on
its own, a lock that cannot be taken included. What a claim got is recorded before the answer,
so a repeated call (after a kubelet or plugin restart) returns it again without redoing the
work. The claims' device status is written after the lock. At start, the checkpoint is read and
the CDI directory brought in line with it (``start``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import anyio
import anyio.to_thread

from devplugin_sdk._logging import printable
from devplugin_sdk._wire.dra_model import ClaimRef, PreparedClaim
from devplugin_sdk.dra._claims.checkpoint import Loaded
from devplugin_sdk.dra._claims.files import ClaimFiles
from devplugin_sdk.dra._claims.lock import LockError
from devplugin_sdk.dra._claims.names import ref_problem
from devplugin_sdk.dra._claims.preparer import Built, ClaimError, Preparer, Reservation, shown
from devplugin_sdk.dra._claims.status import StatusWriter
from devplugin_sdk.dra._claims.store import Store
from devplugin_sdk.dra.resources import ClaimDeviceStatus, ResourceApi, ResourceClaim
from devplugin_sdk.errors import KubeApiError

__all__ = ["ClaimService"]

log = logging.getLogger("devplugin_sdk")

_Statuses = list[tuple[ResourceClaim, list[ClaimDeviceStatus]]]


class ClaimService:
    """The kubelet's ``DRAPlugin`` calls of one DRA driver on one node.

    Args:
        driver: The driver name.
        api: Where ResourceClaims are read.
        store: The prepared claims.
        preparer: Prepares and unprepares one claim.
        files: The claims' CDI specs (brought in line with the checkpoint at start).
        status: Writes the claims' device status (KEP-4817); None writes none.
    """

    def __init__(
        self,
        driver: str,
        api: ResourceApi,
        store: Store,
        preparer: Preparer,
        files: ClaimFiles,
        *,
        status: StatusWriter | None = None,
    ) -> None:
        self.driver = driver
        self.api = api
        self.store = store
        self.preparer = preparer
        self.files = files
        self.status = status
        self._lock = anyio.Lock()

    # ------------------------------------------------------------------ start

    async def start(self) -> Loaded:
        """Read the checkpoint, under the instances' lock (the cleanup of unfinished prepares
        must not take the spec of a prepare another instance has in flight); remove temporary
        files and the CDI specs of claims not prepared. What the checkpoint read found.

        A spec without a checkpoint entry was written by a prepare that never answered (the
        plugin died in between): no container uses it, and the kubelet asks again. That holds
        only when the checkpoint was read: if it was not, every spec is kept, recorded as a
        recovered entry until the kubelet prepares or unprepares its claim.
        """
        async with self.store.held(reload=False):
            loaded = await self.store.load()
            if loaded.problem is not None:
                await self._recover(loaded)
                return loaded
            entries = dict(self.store.entries())
            removed, written = await anyio.to_thread.run_sync(self.files.settle, entries)
        log.info(
            "DRA %s: %d prepared claims in %s%s%s",
            self.driver,
            len(entries),
            self.store.checkpoint.path,
            f"; removed {removed} files of unfinished prepares" if removed else "",
            f"; wrote {len(written)} files of prepared claims again (they were gone)"
            if written
            else "",
        )
        return loaded

    async def _recover(self, loaded: Loaded) -> None:
        kept = await anyio.to_thread.run_sync(self.files.recovered, self.store.entries())
        self.store.recover(kept)
        await anyio.to_thread.run_sync(lambda: self.files.clean((), specs=False))
        try:
            await self.store.save()
            saved = ""
        except OSError as exc:
            saved = f"; the new checkpoint cannot be written either: {exc.strerror or exc}"
        log.error(
            "DRA %s: the checkpoint %s cannot be used: %s; %s; kept %d CDI spec%s of claims the "
            "kubelet may still hold, until it prepares or unprepares them%s",
            self.driver,
            self.store.checkpoint.path,
            printable(loaded.problem or ""),
            f"moved to {loaded.aside}" if loaded.aside else "left in place",
            len(kept),
            "" if len(kept) == 1 else "s",
            saved,
        )

    # ------------------------------------------------------------------ NodePrepareResources

    async def prepare(self, refs: Sequence[ClaimRef]) -> dict[str, PreparedClaim]:
        """Prepare each claim; one result per claim UID, errors included."""
        # The API reads come first, outside the lock, as kubeletplugin does them.
        claims: dict[str, ResourceClaim | ClaimError] = {}
        for ref in refs:
            if self._done(ref.uid) or ref.uid in claims:
                continue
            try:
                claims[ref.uid] = await self._read(ref)
            except ClaimError as exc:
                claims[ref.uid] = exc
        results: dict[str, PreparedClaim] = {}
        statuses: _Statuses = []
        try:
            async with self.store.held():  # other instances: the whole call
                await self._prepare_all(refs, claims, results, statuses)
        except LockError as exc:
            # Every claim not answered yet gets the lock's error; the kubelet retries.
            log.error("DRA %s: cannot prepare: %s", self.driver, exc)  # noqa: TRY400
            for ref in refs:
                results.setdefault(ref.uid, PreparedClaim(error=str(exc)))
        if self.status is not None:  # outside the lock
            for claim, entries in statuses:
                await self.status.write(claim, entries)
        return results

    async def _prepare_all(
        self,
        refs: Sequence[ClaimRef],
        claims: dict[str, ResourceClaim | ClaimError],
        results: dict[str, PreparedClaim],
        statuses: _Statuses,
    ) -> None:
        """Reserve each claim under the in-process lock, build them all at once outside it (the
        plugins' hooks), record them under it again; reservations end either way."""
        reserved: dict[str, Reservation] = {}
        try:
            async with self._lock:
                for ref in refs:
                    if ref.uid in results or ref.uid in reserved:
                        continue
                    outcome = await self._reserve(ref, claims.get(ref.uid))
                    if isinstance(outcome, Reservation):
                        reserved[ref.uid] = outcome
                    else:
                        results[ref.uid] = outcome
            built: dict[str, Built | PreparedClaim] = {}
            async with anyio.create_task_group() as tg:
                for uid, reservation in reserved.items():
                    tg.start_soon(self._build, reservation, built, uid)
            async with self._lock:
                for uid, reservation in reserved.items():
                    made = built[uid]
                    if isinstance(made, PreparedClaim):
                        results[uid] = made
                    else:
                        results[uid] = await self._record(reservation, made, statuses)
        finally:
            for uid in reserved:
                self.store.release(uid)

    def _done(self, uid: str) -> bool:
        entry = self.store.get(uid)
        return entry is not None and not entry.recovered

    async def _read(self, ref: ClaimRef) -> ResourceClaim:
        # Checked before any file, path or API call is named after them.
        problem = ref_problem(ref)
        if problem is not None:
            raise ClaimError(f"claim {shown(ref)}: {problem}")
        where = printable(f"{ref.namespace}/{ref.name}")
        try:
            claim = await self.api.read_claim(ref.namespace, ref.name)
        except KubeApiError as exc:
            raise ClaimError(f"cannot read ResourceClaim {where}: {exc}") from exc
        except Exception as exc:  # another ResourceApi's failure: this claim's, not the call's
            raise ClaimError(
                f"cannot read ResourceClaim {where}: {type(exc).__name__}: {printable(str(exc))}"
            ) from exc
        if claim.uid != ref.uid:
            raise ClaimError(
                f"ResourceClaim {where} was replaced: its UID is {printable(claim.uid)}, "
                f"the kubelet asked for {ref.uid}"
            )
        if not claim.allocated:
            raise ClaimError(f"ResourceClaim {where} is not allocated")
        return claim

    async def _reserve(
        self, ref: ClaimRef, claim: ResourceClaim | ClaimError | None
    ) -> Reservation | PreparedClaim:
        entry = self.store.get(ref.uid)
        if entry is not None and not entry.recovered:
            # Prepared before: the same answer, no work; its files written again if they are
            # gone (a reboot empties /var/run/cdi, and the kubelet asks again).
            try:
                await anyio.to_thread.run_sync(self.files.restore, entry)
            except OSError as exc:
                return self._refused(ref, ClaimError(f"cannot write its files again: {exc}"))
            return PreparedClaim(entry.devices)
        if self.store.reserving(ref.uid):
            return self._refused(
                ref, ClaimError(f"claim {shown(ref)} is being prepared by another call")
            )
        if claim is None:  # it was prepared when looked at, then another instance undid it
            try:
                claim = await self._read(ref)
            except ClaimError as exc:
                claim = exc
        if isinstance(claim, ClaimError):
            return self._refused(ref, claim)
        try:
            return self.preparer.reserve(ref, claim)
        except ClaimError as exc:
            return self._refused(ref, exc)
        except Exception as exc:
            log.exception("DRA %s: preparing claim %s failed", self.driver, shown(ref))
            return PreparedClaim(error=f"preparing failed: {type(exc).__name__}: {exc}")

    async def _build(
        self, reservation: Reservation, built: dict[str, Built | PreparedClaim], uid: str
    ) -> None:
        ref = reservation.ref
        try:
            built[uid] = await self.preparer.build(reservation)
        except ClaimError as exc:
            built[uid] = self._refused(ref, exc)
        except Exception as exc:
            log.exception("DRA %s: preparing claim %s failed", self.driver, shown(ref))
            built[uid] = PreparedClaim(error=f"preparing failed: {type(exc).__name__}: {exc}")

    async def _record(
        self, reservation: Reservation, built: Built, statuses: _Statuses
    ) -> PreparedClaim:
        ref = reservation.ref
        try:
            entry, found = await self.preparer.record(reservation, built)
        except ClaimError as exc:
            return self._refused(ref, exc)
        except Exception as exc:
            log.exception("DRA %s: preparing claim %s failed", self.driver, shown(ref))
            return PreparedClaim(error=f"preparing failed: {type(exc).__name__}: {exc}")
        statuses.append((reservation.claim, found))  # written after the lock (none: nothing)
        log.info(
            "DRA %s: prepared claim %s: %s",
            self.driver,
            shown(ref),
            printable(", ".join(d.device for d in entry.devices)) or "no devices of this driver",
        )
        return PreparedClaim(entry.devices)

    def _refused(self, ref: ClaimRef, exc: ClaimError) -> PreparedClaim:
        log.warning(
            "DRA %s: cannot prepare claim %s: %s", self.driver, shown(ref), printable(str(exc))
        )
        return PreparedClaim(error=str(exc))

    # ------------------------------------------------------------------ NodeUnprepareResources

    async def unprepare(self, refs: Sequence[ClaimRef]) -> dict[str, str]:
        """Undo each claim's preparation; an unknown claim is already undone (no error)."""
        errors: dict[str, str] = {}
        try:
            await self._unprepare_all(refs, errors)
        except LockError as exc:
            log.error("DRA %s: cannot unprepare: %s", self.driver, exc)  # noqa: TRY400
            for ref in refs:
                errors.setdefault(ref.uid, str(exc))
        if self.status is not None:
            for ref in refs:
                # A name the API server would not take never reaches it in a path.
                if not errors.get(ref.uid) and ref_problem(ref) is None:
                    await self.status.clear(ResourceClaim(ref.namespace, ref.name, ref.uid))
        return errors

    async def _unprepare_all(self, refs: Sequence[ClaimRef], errors: dict[str, str]) -> None:
        async with self.store.held(), self._lock:  # other instances too
            for ref in refs:
                try:
                    await self.preparer.unprepare(ref)
                except OSError as exc:
                    # A file system refusing (permissions, I/O): the message, not a traceback.
                    log.error(  # noqa: TRY400
                        "DRA %s: cannot unprepare claim %s: %s",
                        self.driver,
                        shown(ref),
                        printable(str(exc)),
                    )
                    errors[ref.uid] = f"cannot unprepare: {exc}"
                else:
                    errors[ref.uid] = ""
