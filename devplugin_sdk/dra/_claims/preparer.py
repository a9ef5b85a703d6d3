"""NodePrepareResources and NodeUnprepareResources of a DRA driver: claims to CDI devices.

For each claim the kubelet names, the preparer reads the ResourceClaim, takes the results
allocated to this driver, finds each device among the served plugins, asks the device's plugin
for its container edits (its ``allocate()``, the same mapping the device-plugin API uses), writes
one CDI spec per claim and returns the CDI device IDs per request. Every claim succeeds or fails
on its own. What a claim got is checkpointed before the answer, so a repeated call (after a
kubelet or plugin restart) returns it again without redoing the work. Calls are serialised, as
Kubernetes' kubeletplugin helper does by default; the API reads happen before the lock.

The checkpoint and the specs change together: a prepare whose record cannot be written removes
the spec it wrote, an unprepare removes the record before the spec, and a checkpoint that cannot
be read deletes no spec (the kubelet may still hold its CDI IDs): each becomes a recovered entry.
A prepare writes its metadata, its spec and the new checkpoint (to a temporary file) at once, and
renames the checkpoint into place only when the others are durable: one fsync per file and one
per directory, and the answer waits for about two of them rather than five in a row.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import anyio
import anyio.to_thread

from devplugin_sdk import cdi
from devplugin_sdk._logging import printable
from devplugin_sdk._wire.dra_model import ClaimRef, PreparedClaim, PreparedDevice
from devplugin_sdk.dra import config as claim_config
from devplugin_sdk.dra._claims import shares as _shares
from devplugin_sdk.dra._claims.checkpoint import Checkpoint, Entry, Loaded
from devplugin_sdk.dra._claims.lock import SharedState
from devplugin_sdk.dra._claims.metadata import Metadata, MetadataDevice
from devplugin_sdk.dra._claims.status import StatusWriter, status_problem
from devplugin_sdk.dra._pool.pool import Found
from devplugin_sdk.dra.resources import (
    AllocatedDevice,
    ClaimDeviceStatus,
    ResourceApi,
    ResourceClaim,
)
from devplugin_sdk.errors import KubeApiError
from devplugin_sdk.types import Allocation, Device, DeviceStatus, Health

if TYPE_CHECKING:
    from devplugin_sdk.plugin import DevicePlugin

__all__ = ["Preparer", "spec_file_name"]

log = logging.getLogger("devplugin_sdk")


#: Finds a device of this driver's pool by its name in the slices.
Lookup = Callable[[str], Found | None]

# Kubernetes object UIDs are UUIDs; the UID names the claim's CDI spec file and CDI devices.
_UID = re.compile(r"[0-9A-Za-z-]{1,64}")


def _shown(ref: ClaimRef) -> str:
    """A claim as logs and messages show it: the kubelet's strings, escaped."""
    return printable(str(ref))


class _ClaimError(Exception):
    """This claim cannot be prepared; the message goes into its response entry."""


def spec_file_name(driver: str, uid: str) -> str:
    """The CDI spec file of one claim: ``k8s.<driver>-claim_<uid>.json``."""
    return f"{_vendor(driver)}-claim_{uid}.json"


def _vendor(driver: str) -> str:
    # CDI vendors prefixed k8s. are what DRA drivers use for per-claim specs; the driver name is
    # a DNS subdomain, which a CDI vendor name may hold as is.
    return f"k8s.{driver}"


class Preparer:
    """Prepares and unprepares the claims of one DRA driver on one node.

    Args:
        driver: The driver name.
        pool: The driver's pool on this node (the node name).
        api: Where ResourceClaims are read.
        lookup: Finds a published device by name.
        checkpoint: The prepared-claims file.
        cdi_dir: Where per-claim CDI specs go.
        hook_timeout: Bound on each plugin's ``allocate()``.
        metadata: Writes each request's ``metadata.json`` (KEP-5304), mounted by the claim's
            spec; None writes none.
        status: Writes the claims' device status (KEP-4817); None writes none.
    """

    def __init__(
        self,
        driver: str,
        pool: str,
        api: ResourceApi,
        *,
        lookup: Lookup,
        checkpoint: Checkpoint,
        cdi_dir: Path,
        hook_timeout: float,
        metadata: Metadata | None = None,
        status: StatusWriter | None = None,
        shared: SharedState | None = None,
    ) -> None:
        self.driver = driver
        self.pool = pool
        self.api = api
        self.lookup = lookup
        self.checkpoint = checkpoint
        self.shared = shared or SharedState(checkpoint, None)  # rolling upgrades: dra._claims.lock
        self.cdi_dir = cdi_dir
        self.hook_timeout = hook_timeout
        self.metadata = metadata
        self.status = status
        self._statuses: dict[str, tuple[ResourceClaim, list[ClaimDeviceStatus]]] = {}
        self.kind = f"{_vendor(driver)}/claim"
        self.prepared: dict[str, Entry] = {}
        self.loaded = Loaded()  # what load() found: a problem, when the file was set aside
        self._lock = anyio.Lock()
        self._warned_annotations: set[str] = set()
        self._spec_name = re.compile(
            rf"{re.escape(_vendor(driver))}-claim_(?P<uid>[0-9A-Za-z-]+)\.json"
        )
        self._temp_name = re.compile(
            rf"\.{re.escape(_vendor(driver))}-claim_[0-9A-Za-z-]+\.[a-z0-9_]{{8}}\.tmp"
        )

    # ------------------------------------------------------------------ start

    async def load(self) -> None:
        """Read the checkpoint; remove temporary files and CDI specs of unprepared claims.

        A spec without a checkpoint entry was written by a prepare that never answered (the
        plugin died in between): no container uses it, and the kubelet asks again. That holds
        only when the checkpoint was read: if it was not, every spec is kept, recorded as a
        recovered entry until the kubelet prepares or unprepares its claim.
        """
        loaded = await anyio.to_thread.run_sync(self.checkpoint.load)
        self.loaded = loaded
        self.prepared = loaded.entries
        await anyio.to_thread.run_sync(self.checkpoint.remove_temporaries)
        if loaded.problem is not None:
            await self._recover(loaded)
            return
        removed = await anyio.to_thread.run_sync(self._clean_cdi_dir)
        log.info(
            "DRA %s: %d prepared claims in %s%s",
            self.driver,
            len(self.prepared),
            self.checkpoint.path,
            f"; removed {removed} CDI files of unfinished prepares" if removed else "",
        )

    async def _recover(self, loaded: Loaded) -> None:
        kept = await anyio.to_thread.run_sync(self._keep_specs)
        await anyio.to_thread.run_sync(partial(self._clean_cdi_dir, specs=False))
        try:
            await anyio.to_thread.run_sync(self.checkpoint.save, self.prepared)
            saved = ""
        except OSError as exc:
            saved = f"; the new checkpoint cannot be written either: {exc.strerror or exc}"
        log.error(
            "DRA %s: the checkpoint %s cannot be used: %s; %s; kept %d CDI spec%s of claims the "
            "kubelet may still hold, until it prepares or unprepares them%s",
            self.driver,
            self.checkpoint.path,
            printable(loaded.problem or ""),
            f"moved to {loaded.aside}" if loaded.aside else "left in place",
            kept,
            "" if kept == 1 else "s",
            saved,
        )

    def _keep_specs(self) -> int:
        """Record every claim spec of ours in the CDI directory as a recovered entry."""
        kept = 0
        try:
            names = sorted(p.name for p in self.cdi_dir.iterdir())
        except OSError:
            return 0
        for name in names:
            match = self._spec_name.fullmatch(name)
            if match is None or match["uid"] in self.prepared:
                continue
            uid = match["uid"]
            self.prepared[uid] = Entry(ClaimRef("", uid, ""), (), name, recovered=True)
            kept += 1
        return kept

    def recovered(self) -> int:
        """Claims known only by the CDI spec kept for them (the checkpoint was unreadable)."""
        return sum(entry.recovered for entry in self.prepared.values())

    def _clean_cdi_dir(self, *, specs: bool = True) -> int:
        """Remove temporary files and (with ``specs``) the specs no entry names."""
        known = {entry.spec_file for entry in self.prepared.values()}
        removed = 0
        try:
            names = sorted(p.name for p in self.cdi_dir.iterdir())
        except OSError:
            return 0
        for name in names:
            stale = self._temp_name.fullmatch(name) or (
                specs and self._spec_name.fullmatch(name) and name not in known
            )
            if stale:
                with contextlib.suppress(FileNotFoundError):
                    (self.cdi_dir / name).unlink()
                    removed += 1
        return removed

    # ------------------------------------------------------------------ NodePrepareResources

    async def prepare(self, refs: Sequence[ClaimRef]) -> dict[str, PreparedClaim]:
        """Prepare each claim; one result per claim UID, errors included."""
        # The API reads come first, outside the lock, as kubeletplugin does them.
        claims: dict[str, ResourceClaim | Exception] = {}
        for ref in refs:
            if self._done(ref.uid) or ref.uid in claims:
                continue
            try:
                claims[ref.uid] = await self._read(ref)
            except _ClaimError as exc:
                claims[ref.uid] = exc
        results: dict[str, PreparedClaim] = {}
        async with self._lock, self.shared.held(self.prepared):  # other instances too
            for ref in refs:
                results[ref.uid] = await self._prepare_one(ref, claims.get(ref.uid))
        await self._write_statuses()
        return results

    async def _write_statuses(self) -> None:
        """The device status of the claims just prepared, outside the lock."""
        pending, self._statuses = self._statuses, {}
        if self.status is not None:
            for claim, entries in pending.values():
                await self.status.write(claim, entries)

    def _done(self, uid: str) -> bool:
        entry = self.prepared.get(uid)
        return entry is not None and not entry.recovered

    async def _read(self, ref: ClaimRef) -> ResourceClaim:
        if not (ref.uid and ref.namespace and ref.name):
            raise _ClaimError(
                f"the request names claim {_shown(ref)} without namespace, name or UID"
            )
        if not _UID.fullmatch(ref.uid):
            raise _ClaimError(f"claim {_shown(ref)}: the UID is not a Kubernetes UID")
        shown = printable(f"{ref.namespace}/{ref.name}")
        try:
            claim = await self.api.read_claim(ref.namespace, ref.name)
        except KubeApiError as exc:
            raise _ClaimError(f"cannot read ResourceClaim {shown}: {exc}") from exc
        if claim.uid != ref.uid:
            raise _ClaimError(
                f"ResourceClaim {shown} was replaced: its UID is {printable(claim.uid)}, "
                f"the kubelet asked for {ref.uid}"
            )
        if not claim.allocated:
            raise _ClaimError(f"ResourceClaim {shown} is not allocated")
        return claim

    async def _prepare_one(
        self, ref: ClaimRef, claim: ResourceClaim | Exception | None
    ) -> PreparedClaim:
        entry = self.prepared.get(ref.uid)
        if entry is not None and not entry.recovered:
            return PreparedClaim(entry.devices)  # prepared before: the same answer, no work
        if claim is None:  # it was prepared when looked at, then another instance undid it
            try:
                claim = await self._read(ref)
            except _ClaimError as exc:
                claim = exc
        try:
            entry = await self._do_prepare(ref, _claim_or_raise(claim))
        except _ClaimError as exc:
            log.warning(
                "DRA %s: cannot prepare claim %s: %s", self.driver, _shown(ref), printable(str(exc))
            )
            return PreparedClaim(error=str(exc))
        except Exception as exc:
            log.exception("DRA %s: preparing claim %s failed", self.driver, _shown(ref))
            return PreparedClaim(error=f"preparing failed: {type(exc).__name__}: {exc}")
        log.info(
            "DRA %s: prepared claim %s: %s",
            self.driver,
            _shown(ref),
            printable(", ".join(d.device for d in entry.devices)) or "no devices of this driver",
        )
        return PreparedClaim(entry.devices)

    async def _do_prepare(self, ref: ClaimRef, claim: ResourceClaim) -> Entry:
        ours = [r for r in claim.results if r.driver == self.driver]
        seen: dict[tuple[str, str, str], str] = {}
        for result in ours:
            # Shares of one device are distinct allocations (their shareIDs differ).
            first = seen.get((result.pool, result.device, result.share_id))
            if first is not None:
                raise _ClaimError(
                    f"the claim lists device {printable(result.device)} twice (requests "
                    f"{printable(first)} and {printable(result.request)})"
                )
            seen[(result.pool, result.device, result.share_id)] = result.request
        by_request: dict[str, list[tuple[AllocatedDevice, Found]]] = {}
        uses: list[_shares.Use] = []
        given: dict[int, Sequence[Device]] = {}
        # What other claims hold, worked out once per claim rather than once per device.
        held = _Held(self)
        for result in ours:
            found = self._check(result, held)
            given[id(result)] = self._give(result, found, uses, held)
            # kubeletplugin reports the request without its subrequest ("gpus/large" -> gpus).
            by_request.setdefault(result.request.split("/")[0], []).append((result, found))
        configs = _configs(claim, self.driver, by_request)
        spec_devices: dict[str, Allocation] = {}
        prepared: list[PreparedDevice] = []
        statuses: list[ClaimDeviceStatus] = []
        metadata: list[_MetadataWrite] = []
        for request, members in by_request.items():
            edits, extra_ids = await self._edits(
                request,
                [(f, given[id(r)]) for r, f in members],
                ref,
                configs[request],
                admin=all(r.admin_access for r, _ in members),
            )
            found_status = await self._device_statuses(members, ref)
            statuses += found_status.values()
            edits = self._with_metadata(
                claim, request, members, found_status, edits, writes=metadata
            )
            ids = list(extra_ids)
            if edits is not None:
                name = f"{ref.uid}-{request}"
                spec_devices[name] = edits
                ids.insert(0, f"{self.kind}={name}")
            prepared += [
                PreparedDevice((request,), result.pool, result.device, tuple(ids), result.share_id)
                for result, _ in members
            ]
        spec_file = spec_file_name(self.driver, ref.uid) if spec_devices else None
        spec = cdi.CdiSpec(self.kind, spec_devices) if spec_file is not None else None
        entry = Entry(ref, tuple(prepared), spec_file, uses=tuple(uses))
        await self._persist(entry, spec, metadata)
        self._statuses[ref.uid] = (claim, statuses)  # written after the lock (none: nothing)
        return entry

    async def _device_statuses(
        self, members: Sequence[tuple[AllocatedDevice, Found]], ref: ClaimRef
    ) -> dict[str, ClaimDeviceStatus]:
        """Each device's status from its plugin's ``device_status`` (when overridden), by
        device name; an answer the API server would refuse, or an error, is left out."""
        out: dict[str, ClaimDeviceStatus] = {}
        for result, found in members:
            if not found.plugin.overrides("device_status"):
                continue
            try:
                with anyio.fail_after(self.hook_timeout):
                    status = await found.plugin.device_status(found.device)
            except Exception as exc:
                log.warning(
                    "DRA %s: claim %s: device_status(%s) failed: %s",
                    self.driver,
                    _shown(ref),
                    printable(result.device),
                    printable(str(exc) or type(exc).__name__),
                )
                continue
            if status is None:
                continue
            problem = (
                status_problem(status) if isinstance(status, DeviceStatus) else "not a DeviceStatus"
            )
            if problem is not None:
                log.warning(
                    "DRA %s: claim %s: the status of device %s is left out: %s",
                    self.driver,
                    _shown(ref),
                    printable(result.device),
                    printable(problem),
                )
                continue
            out[result.device] = ClaimDeviceStatus(self.driver, result.pool, result.device, status)
        return out

    def _with_metadata(
        self,
        claim: ResourceClaim,
        request: str,
        members: Sequence[tuple[AllocatedDevice, Found]],
        statuses: dict[str, ClaimDeviceStatus],
        edits: Allocation | None,
        *,
        writes: list[_MetadataWrite],
    ) -> Allocation | None:
        """``edits`` plus the bind mount of the request's ``metadata.json``, whose write is
        added to ``writes`` (``_persist`` does it, before the spec is recorded)."""
        if self.metadata is None:
            return edits
        devices = [
            MetadataDevice(
                result.pool,
                result.device,
                found.device.attributes,
                statuses[result.device].status.network_data if result.device in statuses else None,
            )
            for result, found in members
        ]
        mount = self.metadata.mount(claim, request)
        full_name = members[0][0].request
        write = partial(self.metadata.write, claim, request, full_name, devices)
        writes.append(_MetadataWrite(request, write))
        if edits is None:
            return Allocation(mounts=(mount,))
        return Allocation(edits.device_nodes, (*edits.mounts, mount), edits.env)

    # ------------------------------------------------------------------ the files of a prepare

    async def _persist(
        self, entry: Entry, spec: cdi.CdiSpec | None, metadata: Sequence[_MetadataWrite]
    ) -> None:
        """Make a prepared claim durable: its metadata files, its CDI spec and its checkpoint
        entry, each file fsynced once and each directory once.

        The metadata, the spec and the new checkpoint (staged in a temporary file) are written
        at the same time, in worker threads; the checkpoint is renamed into place only once
        all of them are durable: the record never names a spec that a crash could lose. On any
        failure nothing is recorded, and a spec no record names is removed.

        Raises:
            _ClaimError: a file could not be written (the first failure, in that order).
        """
        ref = entry.claim
        previous = self.prepared.get(ref.uid)  # a recovered entry, whose spec may be in use
        failures: dict[int, str] = {}
        staged: list[Path] = []
        wrote_spec = False

        async def write_metadata(i: int, write: _MetadataWrite) -> None:
            try:
                await anyio.to_thread.run_sync(write.write)
            except OSError as exc:
                failures[i] = f"cannot write the device metadata of request {write.request}: {exc}"

        async def write_spec(spec: cdi.CdiSpec, name: str) -> None:
            nonlocal wrote_spec
            try:
                await anyio.to_thread.run_sync(cdi.write_spec, spec, self.cdi_dir, name)
            except OSError as exc:
                failures[len(metadata)] = f"cannot write CDI spec {name}: {exc}"
            else:
                wrote_spec = True

        async def stage() -> None:
            try:
                staged.append(
                    await anyio.to_thread.run_sync(
                        self.checkpoint.stage, {**self.prepared, ref.uid: entry}
                    )
                )
            except OSError as exc:
                failures[len(metadata) + 1] = self._checkpoint_failed(exc)

        async with anyio.create_task_group() as tg:
            for i, write in enumerate(metadata):
                tg.start_soon(write_metadata, i, write)
            if spec is not None and entry.spec_file is not None:
                tg.start_soon(write_spec, spec, entry.spec_file)
            tg.start_soon(stage)
        if not failures:
            try:
                await anyio.to_thread.run_sync(self.checkpoint.commit, staged[0])
            except OSError as exc:
                failures[len(metadata) + 1] = self._checkpoint_failed(exc)
        if failures:
            for path in staged:
                await anyio.to_thread.run_sync(self.checkpoint.discard, path)
            if wrote_spec and previous is None:
                # The record and the spec change together: no spec stays that no record names.
                await self._remove_spec(entry.spec_file)
            raise _ClaimError(failures[min(failures)])
        self.prepared[ref.uid] = entry
        if previous is not None and previous.spec_file not in (None, entry.spec_file):
            await self._remove_spec(previous.spec_file)

    def _checkpoint_failed(self, exc: OSError) -> str:
        return f"cannot write the checkpoint {self.checkpoint.path}: {exc}"

    async def _remove_spec(self, name: str | None) -> None:
        if name is None or not self._spec_name.fullmatch(name):
            return
        try:
            await anyio.to_thread.run_sync(cdi.remove_spec, self.cdi_dir / name)
        except OSError as exc:
            # The next start removes a spec no record names.
            log.warning("DRA %s: cannot remove CDI spec %s: %s", self.driver, name, exc)

    def _check(self, result: AllocatedDevice, held: _Held) -> Found:
        if result.pool != self.pool:
            raise _ClaimError(
                f"device {result.device} is in pool {result.pool}, not this node's {self.pool}"
            )
        found = self.lookup(result.device)
        if found is None:
            raise _ClaimError(f"device {result.device} is not one this driver publishes now")
        if result.admin_access:
            return found  # monitoring: any device, in use or not, healthy or not
        if found.health is not Health.HEALTHY:
            raise _ClaimError(f"device {result.device} ({found.device.id}) is unhealthy")
        if found.shares:
            return found  # shared: what is free is counted when its shares are taken
        exclusive = held.exclusive()
        # The last line of defence: the scheduler should never allocate a device twice, nor a
        # whole device and one of its partitions (its counters forbid it).
        for name in (result.device, *found.parts, *((found.whole,) if found.whole else ())):
            holder = exclusive.get(name)
            if holder is not None:
                what = "" if name == result.device else f" through {name}, which it overlaps,"
                raise _ClaimError(
                    f"device {result.device} is already prepared{what} for claim {holder}"
                )
        return found

    def _held_exclusively(self) -> dict[str, ClaimRef]:
        """The devices prepared for a claim that holds them alone (not shares, not admin)."""
        held: dict[str, ClaimRef] = {}
        for entry in self.prepared.values():
            admin = {u.device for u in entry.uses if u.admin}
            for d in entry.devices:
                if not d.share_id and d.device not in admin:
                    held[d.device] = entry.claim
        return held

    def _give(
        self, result: AllocatedDevice, found: Found, uses: list[_shares.Use], held: _Held
    ) -> Sequence[Device]:
        """The devices whose edits ``result`` gets (a shared device's shares taken for it),
        recording in ``uses`` what it then holds."""
        if result.admin_access:
            uses.append(_shares.Use(result.device, result.share_id, admin=True))
            return (found.device,)
        if not found.shares:
            return (found.device,)
        taken = [*held.uses(), *((u, "this claim") for u in uses)]
        try:
            got, use = _shares.take(result, found.shares, taken)
        except _shares.ShareError as exc:
            raise _ClaimError(str(exc)) from None
        uses.append(use)
        return got

    async def _edits(
        self,
        request: str,
        found: Sequence[tuple[Found, Sequence[Device]]],
        ref: ClaimRef,
        config: claim_config.RequestConfig,
        *,
        admin: bool = False,
    ) -> tuple[Allocation | None, tuple[str, ...]]:
        """One request's container edits (its devices' plugins' allocations, merged; for admin
        access only the devices' nodes) and the CDI names the plugins return themselves."""
        if admin:
            watch = _shares.admin_edits([d for _, devices in found for d in devices])
            return (watch if watch.device_nodes else None), ()
        allocations: list[Allocation] = []
        by_resource: dict[str, list[Device]] = {}
        plugins: dict[str, DevicePlugin] = {}
        for item, devices in found:
            by_resource.setdefault(item.resource, []).extend(devices)
            plugins[item.resource] = item.plugin
        for resource, items in by_resource.items():
            plugin = plugins[resource]
            try:
                with anyio.fail_after(self.hook_timeout):
                    if isinstance(plugin, claim_config.Configurable):
                        allocations.append(await plugin.allocate_configured(items, config))
                    else:
                        allocations.append(await plugin.allocate(items))
            except TimeoutError:
                raise _ClaimError(
                    f"{resource}: allocate() did not finish within {self.hook_timeout:g}s"
                ) from None
            except Exception as exc:
                raise _ClaimError(f"{resource}: allocate() failed: {exc}") from exc
        merged = _merge(allocations)
        if merged.annotations and request not in self._warned_annotations:
            self._warned_annotations.add(request)
            log.warning(
                "DRA %s: claim %s: allocate() returned annotations (%s); DRA has no way to pass "
                "them to the container, they are dropped",
                self.driver,
                ref,
                ", ".join(sorted(merged.annotations)),
            )
        edits = Allocation(device_nodes=merged.device_nodes, mounts=merged.mounts, env=merged.env)
        empty = not (edits.device_nodes or edits.mounts or edits.env)
        return (None if empty else edits), merged.cdi_devices

    # ------------------------------------------------------------------ NodeUnprepareResources

    async def unprepare(self, refs: Sequence[ClaimRef]) -> dict[str, str]:
        """Undo each claim's preparation; an unknown claim is already undone (no error)."""
        errors: dict[str, str] = {}
        async with self._lock, self.shared.held(self.prepared):  # other instances too
            for ref in refs:
                try:
                    await self._unprepare_one(ref)
                except OSError as exc:
                    # A file system refusing (permissions, I/O): the message, not a traceback.
                    log.error(  # noqa: TRY400
                        "DRA %s: cannot unprepare claim %s: %s", self.driver, _shown(ref), exc
                    )
                    errors[ref.uid] = f"cannot unprepare: {exc}"
                else:
                    errors[ref.uid] = ""
        if self.status is not None:
            for ref in refs:
                if not errors.get(ref.uid):
                    await self.status.clear(ResourceClaim(ref.namespace, ref.name, ref.uid))
        return errors

    async def _unprepare_one(self, ref: ClaimRef) -> None:
        entry = self.prepared.get(ref.uid)
        if entry is not None:
            del self.prepared[ref.uid]
        try:
            await anyio.to_thread.run_sync(self._remove_files, ref, entry is not None)
        except _RecordError as exc:
            if entry is not None:
                self.prepared[ref.uid] = entry
            raise exc.error from None
        if entry is not None:
            log.info("DRA %s: unprepared claim %s", self.driver, _shown(ref))

    def _remove_files(self, ref: ClaimRef, record: bool) -> None:
        """Unprepare's disk work, in one worker thread: the record first (when ``record``); if
        it cannot be written, the spec stays with it (the kubelet retries). A spec whose removal
        fails after it is removed again by the retry, or the next start.

        Raises:
            _RecordError: the checkpoint could not be written.
            OSError: the spec could not be removed.
        """
        if record:
            try:
                self.checkpoint.save(self.prepared)
            except OSError as exc:
                raise _RecordError(exc) from exc
        # The spec may exist without an entry (a prepare that never answered): remove it too.
        spec_file = spec_file_name(self.driver, ref.uid) if ref.uid else None
        if spec_file is not None and self._spec_name.fullmatch(spec_file):
            cdi.remove_spec(self.cdi_dir / spec_file)
        if self.metadata is not None:
            self.metadata.remove(ref.namespace, ref.name)

    def in_use(self) -> set[str]:
        """Names of the devices prepared for some claim."""
        return {d.device for entry in self.prepared.values() for d in entry.devices}


class _RecordError(Exception):
    """The checkpoint could not be written during an unprepare (``error`` says why)."""

    def __init__(self, error: OSError) -> None:
        super().__init__(str(error))
        self.error = error


@dataclass(frozen=True, slots=True)
class _MetadataWrite:
    """A request's ``metadata.json``, to be written with the claim's other files."""

    request: str
    write: Callable[[], object]


class _Held:
    """What the claims prepared so far hold, worked out once for a claim being prepared (not
    once for each of its devices)."""

    def __init__(self, preparer: Preparer) -> None:
        self._preparer = preparer
        self._exclusive: dict[str, ClaimRef] | None = None
        self._uses: list[tuple[_shares.Use, str]] | None = None

    def exclusive(self) -> dict[str, ClaimRef]:
        if self._exclusive is None:
            self._exclusive = self._preparer._held_exclusively()
        return self._exclusive

    def uses(self) -> list[tuple[_shares.Use, str]]:
        if self._uses is None:
            self._uses = [
                (u, str(e.claim)) for e in self._preparer.prepared.values() for u in e.uses
            ]
        return self._uses


def _configs(
    claim: ResourceClaim, driver: str, by_request: dict[str, list[tuple[AllocatedDevice, Found]]]
) -> dict[str, claim_config.RequestConfig]:
    """Each request's configuration (``dra.config.resolve``), keyed like ``by_request``: the
    kinds a request takes are those its devices' plugins declare."""
    kinds = {
        members[0][0].request: [
            kind
            for _, found in members
            if isinstance(found.plugin, claim_config.Configurable)
            for kind in found.plugin.config_kinds
        ]
        for members in by_request.values()
    }
    try:
        resolved = claim_config.resolve(claim, driver, kinds)
    except claim_config.ClaimConfigError as exc:
        raise _ClaimError(str(exc)) from None
    return {main: resolved[members[0][0].request] for main, members in by_request.items()}


def _claim_or_raise(claim: ResourceClaim | Exception | None) -> ResourceClaim:
    if isinstance(claim, _ClaimError):
        raise claim
    if not isinstance(claim, ResourceClaim):
        raise _ClaimError(f"the claim could not be read: {claim}")
    return claim


def _merge(allocations: Sequence[Allocation]) -> Allocation:
    if len(allocations) == 1:
        return allocations[0]
    nodes: dict[str, object] = {}
    out_nodes = []
    mounts = []
    seen_mounts: set[str] = set()
    env: dict[str, str] = {}
    annotations: dict[str, str] = {}
    cdi_names: dict[str, None] = {}
    for a in allocations:
        for node in a.device_nodes:
            if node.container_path not in nodes:
                nodes[node.container_path] = node
                out_nodes.append(node)
        for mount in a.mounts:
            if mount.container_path not in seen_mounts:
                seen_mounts.add(mount.container_path)
                mounts.append(mount)
        env.update(a.env)
        annotations.update(a.annotations)
        cdi_names.update(dict.fromkeys(a.cdi_devices))
    return Allocation(tuple(out_nodes), tuple(mounts), env, annotations, tuple(cdi_names))
