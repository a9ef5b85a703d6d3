"""Stale prepared claims, and a corrupt checkpoint told to the operator.

The kubelet unprepares each claim it prepared, but not always: a pod force-deleted while the
kubelet was down, a claim deleted and re-created under the same name, a kubelet that lost its
own state. What such a claim holds (its CDI spec, its devices, its shares) would stay taken
until the node restarts. So, at start and every ``Dra.cleanup_interval`` (NVIDIA's driver has
the same ``CheckpointCleanupManager`` every 10 minutes), each prepared claim is read from the
API, and it is stale when the API no longer has it (404), has another object under its name (its
UID changed), or has it reserved for no pod. One read proves nothing: a proxy's stray 404, a
status briefly without its reservation would take a running pod's devices. A claim is unprepared
only when two consecutive sweeps, at least one period apart, both find it stale; an answer that
is not the claim asked for, an API server that cannot be reached, refuses, or times out is no
verdict at all. Claims known only by a recovered CDI spec (no name to read) are left to the
kubelet.

A checkpoint that could not be used at start (moved aside by ``Checkpoint.load``) is reported
as a Kubernetes Event on the Node (reason ``CheckpointCorrupted``, with the path and the cause),
so that an operator sees it in ``kubectl describe node`` without reading the plugin's logs.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Awaitable, Callable, Sequence

import anyio

from devplugin_sdk._logging import printable
from devplugin_sdk._wire.dra_model import ClaimRef
from devplugin_sdk.dra._claims.checkpoint import Entry
from devplugin_sdk.dra._claims.names import ref_problem
from devplugin_sdk.dra._claims.store import Store
from devplugin_sdk.dra.resources import NodeEvent, ResourceApi
from devplugin_sdk.errors import KubeApiError

__all__ = ["CHECKPOINT_CORRUPTED", "Cleanup", "report_corrupt_checkpoint"]

log = logging.getLogger("devplugin_sdk")

#: The Event's reason (as NVIDIA's driver names it, dra-driver-nvidia-gpu PR #1259).
CHECKPOINT_CORRUPTED = "CheckpointCorrupted"
# One API read per claim is bounded: a hanging server delays the sweep, never the driver.
_READ_TIMEOUT = 10.0

# A read that gave no verdict (an error, a timeout, an answer that is not the claim).
_UNKNOWN = ("", "")

#: Called with the driver, why a claim was unprepared (``gone``, ``replaced``, ``unreserved``).
Counter = Callable[[str, str], None]
#: Unprepares claims as the kubelet's call does (``ClaimService.unprepare``): each UID's error.
Unprepare = Callable[[Sequence[ClaimRef]], Awaitable[dict[str, str]]]


class Cleanup:
    """Unprepares the stale claims of one driver.

    Args:
        driver: The driver name.
        api: Where claims are read.
        store: The driver's prepared claims.
        unprepare: Unprepares claims, under the lock, as the kubelet's call does.
        interval: Seconds between sweeps; 0 sweeps once, at start.
        counted: Told of each claim unprepared here (the metric).
    """

    def __init__(
        self,
        driver: str,
        api: ResourceApi,
        store: Store,
        unprepare: Unprepare,
        *,
        interval: float,
        counted: Counter | None = None,
    ) -> None:
        self.driver = driver
        self.api = api
        self.store = store
        self.unprepare = unprepare
        self.interval = interval
        self.counted = counted
        self.unprepared = 0
        self.sweeps = 0
        # The claims the last sweeps found stale, by UID, with their entry then (a claim prepared
        # again since is another suspect).
        self._suspects: dict[str, Entry] = {}

    async def run(self) -> None:
        """Sweep at start, then every ``interval``, until cancelled."""
        while True:
            await self.sweep()
            if self.interval <= 0:
                return
            await anyio.sleep(self.next_delay())

    def next_delay(self) -> float:
        """The wait before the next sweep: ``interval`` within 20 % either way, so that the
        nodes of a fleet started together do not read their claims in step; at least
        ``interval`` after a sweep that found a claim stale (the second read is a period on)."""
        return self.interval * random.uniform(1.0 if self._suspects else 0.8, 1.2)

    async def sweep(self) -> int:
        """Check every prepared claim once; how many were unprepared."""
        stale: list[tuple[ClaimRef, str, str]] = []
        suspects: dict[str, Entry] = {}
        for uid, entry in list(self.store.entries().items()):
            ref = entry.claim
            if ref_problem(ref) is not None:
                continue  # no name to read (recovered), or one that must not become a URL path
            verdict = await self._verdict(ref)
            if self.store.get(uid) is not entry:
                continue  # unprepared or prepared again meanwhile
            before = self._suspects.get(uid)
            if verdict is _UNKNOWN:
                if before is not None:
                    suspects[uid] = before  # no answer is no verdict: the suspicion stands
            elif verdict is not None and before is entry:
                stale.append((ref, *verdict))
            elif verdict is not None:
                suspects[uid] = entry
                log.info(
                    "DRA %s: claim %s looks stale (%s); unprepared if the next check agrees",
                    self.driver,
                    printable(str(ref)),
                    verdict[1],
                )
        self._suspects = suspects
        for ref, reason, why in stale:
            errors = await self.unprepare([ref])
            if errors.get(ref.uid):
                continue  # logged by the service; the next sweep tries again
            self.unprepared += 1
            log.warning(
                "DRA %s: unprepared stale claim %s: %s",
                self.driver,
                printable(str(ref)),
                printable(why),
            )
            if self.counted is not None:
                self.counted(self.driver, reason)
        self.sweeps += 1
        return len(stale)

    async def _verdict(self, ref: ClaimRef) -> tuple[str, str] | None:
        """``(reason, why)`` when the API's answer says the claim is stale; None when it says
        it is in use; ``_UNKNOWN`` when there is no answer to judge by."""
        try:
            with anyio.fail_after(_READ_TIMEOUT):
                claim = await self.api.read_claim(ref.namespace, ref.name)
        except KubeApiError as exc:
            if exc.not_found:
                return "gone", "the ResourceClaim no longer exists"
            log.info(
                "DRA %s: cannot check claim %s (%s); kept",
                self.driver,
                printable(str(ref)),
                printable(str(exc)),
            )
            return _UNKNOWN
        except TimeoutError:
            log.info(
                "DRA %s: cannot check claim %s (timed out); kept", self.driver, printable(str(ref))
            )
            return _UNKNOWN
        if (claim.namespace, claim.name) != (ref.namespace, ref.name) or not claim.uid:
            # Not the object asked for (a proxy's answer, a body that was not a claim): an
            # error of that read, never "replaced".
            log.info(
                "DRA %s: cannot check claim %s (the answer is not that claim); kept",
                self.driver,
                printable(str(ref)),
            )
            return _UNKNOWN
        if claim.uid != ref.uid:
            return "replaced", f"the ResourceClaim of that name now has UID {claim.uid}"
        if not claim.reserved_for:
            return "unreserved", "the ResourceClaim is reserved for no pod"
        return None


async def report_corrupt_checkpoint(
    api: ResourceApi, driver: str, node_name: str, message: str
) -> bool:
    """Record a ``CheckpointCorrupted`` Warning Event on the Node; whether it was recorded
    (an API refusal is logged, and the driver serves on)."""
    try:
        with anyio.fail_after(_READ_TIMEOUT):
            try:
                node_uid = await api.node_uid(node_name)
            except KubeApiError:
                node_uid = ""
            await api.create_event(
                NodeEvent(node_name, node_uid, CHECKPOINT_CORRUPTED, message, "Warning", driver)
            )
    except (KubeApiError, TimeoutError) as exc:
        log.warning(
            "DRA %s: cannot record the %s Event on node %s: %s",
            driver,
            CHECKPOINT_CORRUPTED,
            node_name,
            exc,
        )
        return False
    return True
