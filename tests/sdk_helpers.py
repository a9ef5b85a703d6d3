"""Small helpers shared by the SDK's own tests (importable thanks to pytest's pythonpath)."""

from __future__ import annotations

from devplugin_sdk import Device, DeviceNode

RESOURCE = "acme.com/widget"


def widgets(count: int = 4, **kwargs: object) -> list[Device]:
    """``count`` devices w0..wN, each with its own device node."""
    return [
        Device(f"w{i}", device_nodes=(DeviceNode(f"/dev/widget{i}"),), **kwargs)  # type: ignore[arg-type]
        for i in range(count)
    ]
