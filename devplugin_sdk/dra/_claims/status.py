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

import ipaddress
import json
import logging
import re
from collections.abc import Sequence

import anyio

from devplugin_sdk._logging import printable
from devplugin_sdk.dra._pool.pool import Found
from devplugin_sdk.dra.resources import (
    MAX_DEVICE_CONDITIONS,
    MAX_DEVICE_DATA_BYTES,
    MAX_HARDWARE_ADDRESS,
    MAX_INTERFACE_NAME,
    MAX_IPS,
    AllocatedDevice,
    ClaimDeviceStatus,
    ResourceApi,
    ResourceClaim,
)
from devplugin_sdk.errors import KubeApiError
from devplugin_sdk.types import DeviceCondition, DeviceStatus, NetworkData

__all__ = ["StatusWriter", "device_statuses", "status_problem"]

log = logging.getLogger("devplugin_sdk")

# metav1.Condition: type a qualified name, reason CamelCase (apimachinery validation).
_REASON = re.compile(r"[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?")
_TYPE = re.compile(r"([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")


def status_problem(status: DeviceStatus) -> str | None:
    """Why the API server would refuse ``status``, or None."""
    if len(status.conditions) > MAX_DEVICE_CONDITIONS:
        return f"{len(status.conditions)} conditions; at most {MAX_DEVICE_CONDITIONS}"
    types = [c.type for c in status.conditions]
    if len(set(types)) != len(types):
        return "two conditions of one type"
    for condition in status.conditions:
        problem = _condition_problem(condition)
        if problem is not None:
            return problem
    if status.data is not None:
        try:
            size = len(json.dumps(status.data, separators=(",", ":")).encode())
        except (TypeError, ValueError) as exc:
            return f"data is not JSON: {exc}"
        if size > MAX_DEVICE_DATA_BYTES:
            return f"data is {size} bytes as JSON; at most {MAX_DEVICE_DATA_BYTES}"
    return None if status.network_data is None else _network_problem(status.network_data)


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


def _condition_problem(c: DeviceCondition) -> str | None:
    if not _TYPE.fullmatch(c.type) or len(c.type) > 316:
        return f"condition type {c.type!r} is not a qualified name"
    if c.status not in ("True", "False", "Unknown"):
        return f"condition {c.type}: status must be True, False or Unknown"
    if not _REASON.fullmatch(c.reason) or len(c.reason) > 1024:
        return f"condition {c.type}: reason {c.reason!r} is not CamelCase"
    if len(c.message) > 32768:
        return f"condition {c.type}: message longer than 32768"
    return None


def _network_problem(net: NetworkData) -> str | None:
    if len(net.interface_name) > MAX_INTERFACE_NAME:
        return f"interface name longer than {MAX_INTERFACE_NAME}"
    if len(net.hardware_address) > MAX_HARDWARE_ADDRESS:
        return f"hardware address longer than {MAX_HARDWARE_ADDRESS}"
    if len(net.ips) > MAX_IPS:
        return f"{len(net.ips)} IPs; at most {MAX_IPS}"
    for ip in net.ips:
        try:
            ipaddress.ip_interface(ip)
        except ValueError:
            return f"IP {ip!r} is not in CIDR form"
        if "/" not in ip:
            return f"IP {ip!r} is not in CIDR form (address/prefix)"
    return None


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
            log.debug("DRA %s: device status of %s left: %s", self.driver, claim.uid, exc)
