"""Undoing a claim's configuration at unprepare: each ``Configurable`` plugin's
``release_configured`` with the claim's devices and those that other prepared claims still hold.
A claim's configuration can change the hardware (NVIDIA's time slice), which outlives the claim
unless undone. The claim is unprepared whatever the plugins answer (its record is already gone):
a failure or a hang is logged and bounded, as a prepare's hooks are.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import anyio

from devplugin_sdk._logging import printable
from devplugin_sdk.dra import config as claim_config
from devplugin_sdk.dra._claims.checkpoint import Entry
from devplugin_sdk.dra._pool.pool import Found

if TYPE_CHECKING:
    from devplugin_sdk.plugin import DevicePlugin
    from devplugin_sdk.types import Device

__all__ = ["release_configured"]

log = logging.getLogger("devplugin_sdk.dra")


def _by_plugin(
    names: Iterable[str], lookup: Callable[[str], Found | None]
) -> dict[str, tuple[DevicePlugin, dict[str, Device]]]:
    """The published devices of ``names`` by resource, with their plugin (configurable ones)."""
    out: dict[str, tuple[DevicePlugin, dict[str, Device]]] = {}
    for name in names:
        found = lookup(name)
        if found is None or not isinstance(found.plugin, claim_config.Configurable):
            continue
        out.setdefault(found.resource, (found.plugin, {}))[1][found.device.id] = found.device
    return out


async def release_configured(
    entry: Entry,
    others: Iterable[Entry],
    lookup: Callable[[str], Found | None],
    timeout: float,
) -> None:
    """Call each configurable plugin's ``release_configured`` for ``entry``'s devices."""
    mine = _by_plugin((d.device for d in entry.devices), lookup)
    if not mine:
        return
    held = _by_plugin((d.device for e in others for d in e.devices), lookup)
    for resource, (plugin, devices) in mine.items():
        assert isinstance(plugin, claim_config.Configurable)
        still = list(held.get(resource, (plugin, {}))[1].values())
        try:
            with anyio.fail_after(timeout):
                await plugin.release_configured(list(devices.values()), still)
        except Exception as exc:  # a plugin's failure must not keep the claim: logged
            reason = "did not finish in time" if isinstance(exc, TimeoutError) else str(exc)
            log.warning(
                "DRA: claim %s/%s: %s: release_configured() failed: %s",
                entry.claim.namespace,
                entry.claim.name,
                resource,
                printable(reason),
            )
