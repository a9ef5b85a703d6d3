"""What the pool publishes, device by device: ``Found`` is one published device with the plugin
that serves it, as the claims side looks it up by its name in the slices.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from devplugin_sdk.types import Device, Health

if TYPE_CHECKING:
    from devplugin_sdk.plugin import DevicePlugin

__all__ = ["Found"]


@dataclass(frozen=True, slots=True)
class Found:
    """A published device: the plugin that serves it, the device and its health now; for a
    shared device its shares, for a whole device the names of its partitions, for a partition
    the name of its whole device (``dra/_pool/shares.py``)."""

    resource: str
    plugin: DevicePlugin
    device: Device
    health: Health
    shares: tuple[Device, ...] = ()
    parts: tuple[str, ...] = ()
    whole: str | None = None
