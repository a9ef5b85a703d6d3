"""Claim device status (KEP-4817): what the plugins say about each prepared device, in the
ResourceClaim's ``status.devices[]``.

A plugin overriding ``DevicePlugin.device_status`` is asked once per prepared device; its answer
is checked against the API server's limits (k8s.io/api resource/v1 types.go: at most 8
conditions, ``data`` at most 10 KiB, ``networkData`` with an interface name of at most 256
characters, at most 16 IPs in CIDR form, a hardware address of at most 128 characters), and an
answer out of them is dropped with one warning naming the claim and the device, never sent to
be refused whole. The driver writes the entries by server-side apply with its name as the field
manager (so it owns only its own entries), after the kubelet has its answer; a refusal is
logged and does not fail the prepare. Since Kubernetes 1.36 the writer needs the
``resourceclaims/driver`` permission (deploy/dra/rbac.yaml).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import anyio

from devplugin_sdk._logging import printable
from devplugin_sdk.dra import _validation
from devplugin_sdk.dra._pool.pool import Found
from devplugin_sdk.dra.resources import (
    AllocatedDevice,
    ClaimDeviceStatus,
    ResourceApi,
    ResourceClaim,
)
from devplugin_sdk.errors import KubeApiError
from devplugin_sdk.types import DeviceStatus

__all__ = ["StatusWriter", "device_statuses", "status_problem"]

log = logging.getLogger("devplugin_sdk")


def status_problem(status: DeviceStatus) -> str | None:
    """Why the API server would refuse ``status``, or None."""
    problems = _validation.device_status_problems(status)
    return problems[0] if problems else None


async def device_statuses(
    driver: str,
    members: Sequence[tuple[AllocatedDevice, Found]],
    claim: str,
    hook_timeout: float,
) -> dict[str, ClaimDeviceStatus]:
    """Each device's status from its plugin's ``device_status`` (when overridden), by device
    name; an answer the API server would refuse, or an error, is left out with a warning that
    names ``claim`` (as logs show it) and the device."""
    out: dict[str, ClaimDeviceStatus] = {}
    for result, found in members:
        if not found.plugin.overrides("device_status"):
            continue
        try:
            with anyio.fail_after(hook_timeout):
                status = await found.plugin.device_status(found.device)
        except Exception as exc:
            log.warning(
                "DRA %s: claim %s: device_status(%s) failed: %s",
                driver,
                claim,
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
                driver,
                claim,
                printable(result.device),
                printable(problem),
            )
            continue
        out[result.device] = ClaimDeviceStatus(driver, result.pool, result.device, status)
    return out


class StatusWriter:
    """Writes the device status of prepared claims for one driver.

    Args:
        driver: The driver name (the field manager).
        api: Where claims are written.
    """

    def __init__(self, driver: str, api: ResourceApi) -> None:
        self.driver = driver
        self.api = api
        self.written = 0
        self.failed = 0
        self._claims: set[str] = set()  # UIDs whose status this process wrote

    async def write(self, claim: ResourceClaim, entries: list[ClaimDeviceStatus]) -> None:
        """Apply ``entries`` (nothing when empty); a refusal is logged, never raised."""
        if not entries:
            return
        try:
            with anyio.fail_after(10):
                await self.api.apply_claim_status(claim, self.driver, entries)
        except (KubeApiError, TimeoutError) as exc:
            self.failed += 1
            log.warning(
                "DRA %s: cannot write the device status of claim %s: %s",
                self.driver,
                printable(f"{claim.namespace}/{claim.name}"),
                printable(str(exc) or "timed out"),
            )
            return
        self.written += 1
        self._claims.add(claim.uid)

    async def clear(self, claim: ResourceClaim) -> None:
        """Remove this driver's entries from a claim it wrote them to (best effort: the claim
        is usually on its way out)."""
        if claim.uid not in self._claims:
            return
        self._claims.discard(claim.uid)
        try:
            with anyio.fail_after(10):
                await self.api.apply_claim_status(claim, self.driver, [])
        except (KubeApiError, TimeoutError) as exc:
            log.debug(
                "DRA %s: device status of %s left: %s",
                self.driver,
                printable(claim.uid),
                printable(str(exc) or "timed out"),
            )
