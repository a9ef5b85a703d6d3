"""The preparation of one claim, and its undoing: what the kubelet's containers get for it.

The preparer takes the results allocated to this driver, finds each device among the served
plugins, refuses what the scheduler should never have allocated (a device of another pool, not
published, unhealthy, or held by another claim), takes the shares of a shared device, resolves
the claim's configuration, asks the device's plugin for its container edits (its
``allocate()``, the same mapping the device-plugin API uses), the plugins for the devices'
status, and hands the claim's CDI spec, metadata and record to the files transaction. The
calls for many claims (reads, the lock, answers, statuses) are the service's (``service.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import anyio

from devplugin_sdk import cdi
from devplugin_sdk._logging import printable
from devplugin_sdk._wire.dra_model import ClaimRef, PreparedDevice
from devplugin_sdk.dra import config as claim_config
from devplugin_sdk.dra._claims import shares as _shares
from devplugin_sdk.dra._claims.checkpoint import Content, Entry
from devplugin_sdk.dra._claims.files import ClaimFiles, MetadataWrite, PersistError
from devplugin_sdk.dra._claims.metadata import MetadataDevice
from devplugin_sdk.dra._claims.names import request_problem
from devplugin_sdk.dra._claims.release import release_configured
from devplugin_sdk.dra._claims.status import device_statuses
from devplugin_sdk.dra._claims.store import Store
from devplugin_sdk.dra._pool.pool import Found
from devplugin_sdk.dra.resources import AllocatedDevice, ClaimDeviceStatus, ResourceClaim
from devplugin_sdk.types import Allocation, Device, Health

if TYPE_CHECKING:
    from devplugin_sdk.plugin import DevicePlugin

__all__ = ["Built", "ClaimError", "Lookup", "Preparer", "Reservation", "shown"]

log = logging.getLogger("devplugin_sdk")

#: Finds a device of this driver's pool by its name in the slices.
Lookup = Callable[[str], Found | None]

_ByRequest = dict[str, list[tuple[AllocatedDevice, Found]]]
_Given = dict[int, Sequence[Device]]


def shown(ref: ClaimRef) -> str:
    """A claim as logs and messages show it: the kubelet's strings, escaped."""
    return printable(str(ref))


class ClaimError(Exception):
    """This claim cannot be prepared; the message goes into its response entry."""


class Preparer:
    """Prepares and unprepares the claims of one DRA driver on one node.

    A prepare has three steps: ``reserve`` (checks, shares, configuration) and ``record``
    (files, checkpoint) run under the lock, ``build`` (the plugins' hooks, which may hang on
    the hardware) outside it, so that a claim on another device never waits behind a slow one.

    Args:
        driver: The driver name.
        pool: The driver's pool on this node (the node name).
        lookup: Finds a published device by name.
        store: The prepared claims (what other claims hold; where a claim is recorded).
        files: The claims' CDI specs and the durable transaction.
        hook_timeout: Bound on each plugin's ``allocate()`` and ``device_status()``.

    Each request's ``metadata.json`` (KEP-5304), when ``files`` has metadata, is mounted by the
    claim's spec.
    """

    def __init__(
        self,
        driver: str,
        pool: str,
        *,
        lookup: Lookup,
        store: Store,
        files: ClaimFiles,
        hook_timeout: float,
    ) -> None:
        self.driver = driver
        self.pool = pool
        self.lookup = lookup
        self.store = store
        self.files = files
        self.hook_timeout = hook_timeout
        self._warned_annotations: set[str] = set()

    def reserve(self, ref: ClaimRef, claim: ResourceClaim) -> Reservation:
        """Check ``claim`` against what other claims hold and reserve what it takes (the caller
        holds the lock; ``Store.release`` ends the reservation).

        Raises:
            ClaimError: it cannot be prepared (nothing is reserved).
        """
        by_request, uses, given = self._take(claim)
        configs = _configs(claim, self.driver, by_request)
        held = tuple(
            PreparedDevice((request,), result.pool, result.device, (), result.share_id)
            for request, members in by_request.items()
            for result, _ in members
        )
        self.store.reserve(Entry(ref, held, uses=tuple(uses)))
        return Reservation(ref, claim, by_request, uses, given, configs)

    async def build(self, reserved: Reservation) -> Built:
        """The slow part of a prepare, outside the lock: the plugins' ``allocate()`` with the
        claim's configuration and their ``device_status()``, each bounded by
        ``hook_timeout``.

        Raises:
            ClaimError: a plugin failed or did not answer in time.
        """
        built = Built()
        for request, members in reserved.by_request.items():
            await self._request(
                reserved.ref,
                reserved.claim,
                request,
                members,
                given=reserved.given,
                config=reserved.configs[request],
                built=built,
            )
        return built

    async def record(
        self, reserved: Reservation, built: Built
    ) -> tuple[Entry, list[ClaimDeviceStatus]]:
        """Write the claim's files and record it (the caller holds the lock); its entry, and
        the device statuses to write.

        Raises:
            ClaimError: its files could not be written (nothing is recorded).
        """
        ref = reserved.ref
        spec_file = self.files.spec_name(ref.uid) if built.spec_devices else None
        spec = cdi.CdiSpec(self.files.kind, built.spec_devices) if spec_file is not None else None
        content = Content(spec.to_dict() if spec is not None else None, built.documents)
        entry = Entry(
            ref, tuple(built.prepared), spec_file, uses=tuple(reserved.uses), content=content
        )
        try:
            await self.files.persist(self.store, entry, spec, built.metadata)
        except PersistError as exc:
            raise ClaimError(str(exc)) from None
        return entry, built.statuses

    async def unprepare(self, ref: ClaimRef) -> bool:
        """Undo the claim's preparation: its record first, then its files; whether it was
        prepared.

        Raises:
            OSError: the record could not be written (it stays, with its files: the kubelet
                retries) or a file could not be removed.
        """
        entry = await self.store.remove(ref.uid, partial(self.files.remove, ref))
        if entry is not None:
            log.info("DRA %s: unprepared claim %s", self.driver, shown(ref))
            # Under the lock; a claim reserved meanwhile holds its devices (its settings stay).
            await release_configured(entry, self.store.holding(), self.lookup, self.hook_timeout)
        return entry is not None

    def _take(self, claim: ResourceClaim) -> tuple[_ByRequest, list[_shares.Use], _Given]:
        """The claim's results for this driver, checked, by request; what they hold; the
        devices each result gets (by the result's ``id``)."""
        ours = _ours(claim, self.driver)
        by_request: _ByRequest = {}
        uses: list[_shares.Use] = []
        given: _Given = {}
        # What other claims hold, worked out once per claim rather than once per device (this
        # claim's own entry is not another claim: a recovered one is prepared again).
        held = _Held(self.store, claim.uid)
        checked = [(result, self._check(result, held)) for result in ours]
        try:
            _shares.overlap([(r, f) for r, f in checked if not (r.admin_access or f.shares)])
        except _shares.ShareError as exc:
            raise ClaimError(str(exc)) from None
        for result, found in checked:
            given[id(result)] = self._give(result, found, uses, held)
            # kubeletplugin reports the request without its subrequest ("gpus/large" -> gpus).
            by_request.setdefault(result.request.split("/")[0], []).append((result, found))
        return by_request, uses, given

    async def _request(
        self,
        ref: ClaimRef,
        claim: ResourceClaim,
        request: str,
        members: list[tuple[AllocatedDevice, Found]],
        *,
        given: _Given,
        config: claim_config.RequestConfig,
        built: Built,
    ) -> None:
        """One request's part of the claim (edits, statuses, metadata, devices), into
        ``built``."""
        edits, extra_ids = await self._edits(
            request,
            [(f, given[id(r)]) for r, f in members],
            ref,
            config,
            admin=all(r.admin_access for r, _ in members),
        )
        found_status = await device_statuses(self.driver, members, shown(ref), self.hook_timeout)
        built.statuses += found_status.values()
        edits = self._with_metadata(
            claim,
            request,
            members,
            found_status,
            edits,
            writes=built.metadata,
            documents=built.documents,
        )
        ids = list(extra_ids)
        if edits is not None:
            name = f"{ref.uid}-{request}"
            built.spec_devices[name] = edits
            ids.insert(0, f"{self.files.kind}={name}")
        built.prepared += [
            PreparedDevice((request,), result.pool, result.device, tuple(ids), result.share_id)
            for result, _ in members
        ]

    def _check(self, result: AllocatedDevice, held: _Held) -> Found:
        if result.pool != self.pool:
            raise ClaimError(
                f"device {result.device} is in pool {result.pool}, not this node's {self.pool}"
            )
        found = self.lookup(result.device)
        if found is None:
            raise ClaimError(f"device {result.device} is not one this driver publishes now")
        if result.admin_access:
            return found  # monitoring: any device, in use or not, healthy or not
        if found.health is not Health.HEALTHY:
            raise ClaimError(f"device {result.device} ({found.device.id}) is unhealthy")
        if found.shares:
            return found  # shared: what is free is counted when its shares are taken
        exclusive = held.exclusive()
        # The last line of defence: the scheduler should never allocate a device twice, nor a
        # whole device and one of its partitions (its counters forbid it).
        for name in (result.device, *found.parts, *((found.whole,) if found.whole else ())):
            holder = exclusive.get(name)
            if holder is not None:
                what = "" if name == result.device else f" through {name}, which it overlaps,"
                raise ClaimError(
                    f"device {result.device} is already prepared{what} for claim {holder}"
                )
        return found

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
            raise ClaimError(str(exc)) from None
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
                raise ClaimError(
                    f"{resource}: allocate() did not finish within {self.hook_timeout:g}s"
                ) from None
            except Exception as exc:
                raise ClaimError(f"{resource}: allocate() failed: {exc}") from exc
        merged = _merge(allocations)
        if merged.annotations and request not in self._warned_annotations:
            self._warned_annotations.add(request)
            log.warning(
                "DRA %s: claim %s: allocate() returned annotations (%s); DRA has no way to pass "
                "them to the container, they are dropped",
                self.driver,
                shown(ref),
                printable(", ".join(sorted(merged.annotations))),
            )
        edits = Allocation(device_nodes=merged.device_nodes, mounts=merged.mounts, env=merged.env)
        empty = not (edits.device_nodes or edits.mounts or edits.env)
        return (None if empty else edits), merged.cdi_devices

    def _with_metadata(
        self,
        claim: ResourceClaim,
        request: str,
        members: Sequence[tuple[AllocatedDevice, Found]],
        statuses: dict[str, ClaimDeviceStatus],
        edits: Allocation | None,
        *,
        writes: list[MetadataWrite],
        documents: dict[str, Mapping[str, Any]],
    ) -> Allocation | None:
        """``edits`` plus the bind mount of the request's ``metadata.json``, whose write is
        added to ``writes`` (the files transaction does it, before the spec is recorded)."""
        metadata = self.files.metadata
        if metadata is None:
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
        mount = metadata.mount(claim, request)
        document = metadata.document(claim, members[0][0].request, devices)
        documents[request] = document
        writes.append(MetadataWrite(request, partial(metadata.write, claim.uid, request, document)))
        if edits is None:
            return Allocation(mounts=(mount,))
        return Allocation(edits.device_nodes, (*edits.mounts, mount), edits.env)


@dataclass(frozen=True, slots=True)
class Reservation:
    """A claim checked and reserved under the lock (``Preparer.reserve``): what its requests
    take, to be built outside the lock and recorded under it."""

    ref: ClaimRef
    claim: ResourceClaim
    by_request: _ByRequest
    uses: list[_shares.Use]
    given: _Given
    configs: dict[str, claim_config.RequestConfig]


@dataclass(slots=True)
class Built:
    """What a claim's requests make: its spec's devices, its prepared devices, their statuses,
    and the metadata files to write."""

    spec_devices: dict[str, Allocation] = field(default_factory=dict)
    prepared: list[PreparedDevice] = field(default_factory=list)
    statuses: list[ClaimDeviceStatus] = field(default_factory=list)
    metadata: list[MetadataWrite] = field(default_factory=list)
    documents: dict[str, Mapping[str, Any]] = field(default_factory=dict)


class _Held:
    """What the claims prepared so far hold, worked out once for a claim being prepared (not
    once for each of its devices)."""

    def __init__(self, store: Store, claim: str) -> None:
        self._store = store
        self._claim = claim
        self._exclusive: dict[str, ClaimRef] | None = None
        self._uses: list[tuple[_shares.Use, str]] | None = None

    def exclusive(self) -> dict[str, ClaimRef]:
        if self._exclusive is None:
            self._exclusive = self._store.held_exclusively(but=self._claim)
        return self._exclusive

    def uses(self) -> list[tuple[_shares.Use, str]]:
        if self._uses is None:
            self._uses = self._store.uses()
        return self._uses


def _ours(claim: ResourceClaim, driver: str) -> list[AllocatedDevice]:
    """The claim's results for ``driver``; a device listed twice is refused."""
    ours = [r for r in claim.results if r.driver == driver]
    for result in ours:
        # The request names a CDI device and a metadata directory: checked before either.
        problem = request_problem(result.request)
        if problem is not None:
            raise ClaimError(problem)
    seen: dict[tuple[str, str, str], str] = {}
    for result in ours:
        # Shares of one device are distinct allocations (their shareIDs differ).
        first = seen.get((result.pool, result.device, result.share_id))
        if first is not None:
            raise ClaimError(
                f"the claim lists device {printable(result.device)} twice (requests "
                f"{printable(first)} and {printable(result.request)})"
            )
        seen[(result.pool, result.device, result.share_id)] = result.request
    return ours


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
        raise ClaimError(str(exc)) from None
    return {main: resolved[members[0][0].request] for main, members in by_request.items()}


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
