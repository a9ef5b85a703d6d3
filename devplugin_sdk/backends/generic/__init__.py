"""Generic backend: devices made of files, the way squat's generic-device-plugin makes them.

Owns its configuration keys (``from_config``), discovery (path globs read under ``devRoot``,
groups of paths, USB devices and the PCI card behind /dev nodes read from ``sysfsRoot``),
stable device IDs, and path-following health through ``fswatch.changes``: a device is Healthy
while every non-optional path of it is present, pushed Unhealthy within milliseconds of one
going away. Learned from squat/generic-device-plugin ``deviceplugin/{path,usb}.go``; device host
paths from containerd ``pkg/oci/utils_unix.go`` and CRI-O ``server/container_create_linux.go``.

The modules, one piece each: ``groups`` (what a device is made of), ``config`` (the keys
``from_config`` reads), ``discovery`` (what the host has, and stable IDs), ``health`` (a device's
state from its paths) and ``plugin`` (the hooks, and the watch that pushes health).
"""

from __future__ import annotations

from devplugin_sdk.backends.generic.config import from_config
from devplugin_sdk.backends.generic.groups import GROUP_BY, USB_CLASSES, Group, PathSpec, UsbSpec
from devplugin_sdk.backends.generic.plugin import GenericPlugin

__all__ = [
    "GROUP_BY",
    "USB_CLASSES",
    "GenericPlugin",
    "Group",
    "PathSpec",
    "UsbSpec",
    "from_config",
]
