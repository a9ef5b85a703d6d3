"""Small helpers shared by the SDK's own tests (importable thanks to pytest's pythonpath)."""

from __future__ import annotations

import anyio

from devplugin_sdk import Device, DeviceNode, HealthEvent
from devplugin_sdk.testing import WatchedEvents

RESOURCE = "acme.com/widget"


def widgets(count: int = 4, **kwargs: object) -> list[Device]:
    """``count`` devices w0..wN, each with its own device node."""
    return [
        Device(f"w{i}", device_nodes=(DeviceNode(f"/dev/widget{i}"),), **kwargs)  # type: ignore[arg-type]
        for i in range(count)
    ]


async def first_rescan(events: WatchedEvents, count: int) -> None:
    """Take the ``count`` health statements of a watch's first rescan; return once the watch
    waits for the next change."""
    for event in await events.take(count):
        assert isinstance(event, HealthEvent), event
    await anyio.wait_all_tasks_blocked()
