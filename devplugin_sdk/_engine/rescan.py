"""Periodic rediscovery: one plugin's ``discover()`` again every ``rescan_interval`` seconds.

A task of its own beside the device feed (``feed.py`` owns what a rescan does: the list is
replaced only when it changed, a failed ``discover()`` keeps the previous one and is logged),
so a plugin whose devices come and go is current without a ``watch()`` of its own.
"""

from __future__ import annotations

import math

import anyio

from devplugin_sdk._engine.feed import DeviceFeed
from devplugin_sdk._intervals import LOOP_FLOOR
from devplugin_sdk.plugin import DevicePlugin
from devplugin_sdk.settings import Settings

__all__ = ["rescan_every", "rescan_interval"]


def rescan_interval(plugin: DevicePlugin, settings: Settings) -> float:
    """Seconds between this plugin's rescans (its own attribute wins); 0 for none.

    Raises:
        ValueError: the plugin's ``rescan_interval`` is not a finite number, negative, or
            under ``LOOP_FLOOR`` (a busy loop).
    """
    own = plugin.rescan_interval
    if own is None:
        return settings.rescan_interval
    if isinstance(own, bool) or not isinstance(own, (int, float)) or not math.isfinite(own):
        raise ValueError(f"{plugin.resource_name}: rescan_interval must be a number, got {own!r}")
    if own < 0:
        raise ValueError(f"{plugin.resource_name}: rescan_interval must be >= 0, got {own}")
    if 0 < own < LOOP_FLOOR:
        raise ValueError(
            f"{plugin.resource_name}: rescan_interval must be 0 (off) or at least "
            f"{LOOP_FLOOR} s, got {own}"
        )
    return float(own)


async def rescan_every(feed: DeviceFeed, interval: float) -> None:
    """Rescan through ``feed`` every ``interval`` seconds (after the first discovery) until
    cancelled. The period runs from the end of one rescan, so a slow ``discover()`` never
    overlaps itself."""
    while True:
        await anyio.sleep(interval)
        await feed.rescan("periodic")
