"""What a generic device is made of: ``PathSpec`` (a glob and how a container gets its
matches), ``UsbSpec`` (USB devices by ID) and ``Group`` (paths or USB devices, joined in step or by
PCI card, with what every device shares), each checked when it is made.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from devplugin_sdk.backends import _generic_host as host
from devplugin_sdk.config import shown

__all__ = ["GROUP_BY", "USB_CLASSES", "Group", "PathSpec", "UsbSpec"]

#: The one way to group matches by hardware: the PCI function each node belongs to.
GROUP_BY = ("pciDevice",)

#: Classes of nodes a USB device's interfaces may carry, for ``UsbSpec.include``.
USB_CLASSES = ("hidraw", "input", "sound", "tty", "usbmisc", "video4linux")
_HEX_ID = re.compile(r"^[0-9a-fA-F]{1,4}$")
PathType = Literal["Device", "Mount"]


@dataclass(frozen=True, slots=True)
class PathSpec:
    """One configured path of a group: an absolute glob and how a container gets its matches.

    Args:
        path: Absolute glob pattern (``*``, ``?``, ``[...]``) of host paths, e.g.
            ``/dev/dri/renderD*``. Under /dev it is looked up under the plugin's ``dev_root``.
        mount_path: Where the container gets it; None: at ``path``. Ending in ``/``: in that
            directory, under the match's own name (for globs).
        type: ``"Device"``: a device node (a cgroup rule plus the node; directories never
            match). ``"Mount"``: a bind mount of a file or directory (``/dev/snd``, a vendor
            library directory).
        read_only: For a ``Mount``: mount it read-only.
        permissions: For a ``Device``: the cgroup access, made of ``r``, ``w`` and ``m``.
        optional: The device is Healthy without it (it is handed over while present).

    Raises:
        ValueError: a bad path, mount path, type or permissions string, or an option of the
            other type.
    """

    path: str
    mount_path: str | None = None
    type: PathType = "Device"
    read_only: bool = False
    permissions: str = "rw"
    optional: bool = False

    def __post_init__(self) -> None:
        problem = _pattern_problem(self.path)
        if problem is not None:
            raise ValueError(f"path {self.path!r}: {problem}")
        object.__setattr__(self, "path", _normalise(self.path))
        if self.mount_path is not None:
            problem = _mount_path_problem(self.mount_path)
            if problem is not None:
                raise ValueError(f"mount_path {self.mount_path!r}: {problem}")
            object.__setattr__(self, "mount_path", _normalise_target(self.mount_path))
        if self.type not in ("Device", "Mount"):
            raise ValueError(f"type must be 'Device' or 'Mount', got {self.type!r}")
        problem = _permissions_problem(self.permissions)
        if problem is not None:
            raise ValueError(f"permissions {problem}")
        if self.type == "Device" and self.read_only:
            raise ValueError("read_only is for a Mount; a device node's access is its permissions")

    @property
    def mount(self) -> bool:
        """Whether matches are bind-mounted rather than handed over as device nodes."""
        return self.type == "Mount"


@dataclass(frozen=True, slots=True)
class UsbSpec:
    """USB devices to serve: each one plugged in that matches is one device.

    The container gets its usbfs node ``/dev/bus/usb/BBB/DDD`` and the nodes of the classes in
    ``include`` found on its interfaces (``tty``: ``/dev/ttyUSB0``, ``/dev/ttyACM0``;
    ``hidraw``: ``/dev/hidraw0``).

    Args:
        vendor: ``idVendor``, hex (``"20a0"``).
        product: ``idProduct``, hex (``"41e5"``).
        serial: Only the device with this ``serial``; None: any.
        include: Node classes to hand over as well (``USB_CLASSES``).

    Raises:
        ValueError: an ID that is not 1 to 4 hex digits, an empty serial, an unknown class.
    """

    vendor: str
    product: str
    serial: str | None = None
    include: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("vendor", "product"):
            value = getattr(self, name)
            if not isinstance(value, str) or not _HEX_ID.match(value):
                raise ValueError(f"{name} must be 1 to 4 hex digits, got {value!r}")
            object.__setattr__(self, name, value.lower().zfill(4))
        if self.serial is not None and not self.serial:
            raise ValueError("serial must not be empty (None matches any)")
        object.__setattr__(self, "include", tuple(self.include))
        unknown = [name for name in self.include if name not in USB_CLASSES]
        if unknown:
            raise ValueError(f"include: unknown class {unknown[0]!r}; one of {USB_CLASSES}")

    def matches(self, device: host.UsbDevice) -> bool:
        """Whether a plugged-in USB device is one of these."""
        return (
            device.vendor == self.vendor
            and device.product == self.product
            and (self.serial is None or device.serial == self.serial)
        )

    def __str__(self) -> str:
        serial = f" serial {self.serial}" if self.serial is not None else ""
        return f"{self.vendor}:{self.product}{serial}"


@dataclass(frozen=True, slots=True)
class Group:
    """Devices made of paths or of USB devices, with what every one of them shares.

    With ``paths``, the first non-optional path (the *lead*) says which devices exist: each of
    its matches is one device. The other paths join them: without ``group_by``, in step (the
    first match of each path makes the first device, the second the second, in natural order);
    with ``group_by="pciDevice"``, by hardware (the matches whose sysfs device is the same PCI
    function make one device, with that function's NUMA node, and its address as ID).
    With ``usb``, each USB device plugged in that matches one of the specs is one device.

    Args:
        paths: The paths each device is made of.
        usb: USB devices, instead of paths.
        shared: Paths added to every device of the group (``/dev/kfd`` for every GPU).
        group_by: ``"pciDevice"``, or None to join the paths in step.
        pci_vendors: With ``group_by``, only PCI functions of these vendors (hex, ``"1002"``).
        count: How many containers may hold one device at once; above 1 each device is
            advertised ``count`` times as ``<id>::<n>``.

    Raises:
        ValueError: neither or both of paths and usb, a ``group_by`` on something that has no
            sysfs device, ``count`` < 1.
    """

    paths: tuple[PathSpec, ...] = ()
    usb: tuple[UsbSpec, ...] = ()
    shared: tuple[PathSpec, ...] = ()
    group_by: str | None = None
    pci_vendors: tuple[str, ...] = ()
    count: int = 1

    def __post_init__(self) -> None:
        for name in ("paths", "usb", "shared", "pci_vendors"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        if bool(self.paths) == bool(self.usb):
            raise ValueError("a group needs paths or usb (not both)")
        if self.group_by is not None:
            problem = _group_by_problem(self.group_by, self.paths)
            if problem is not None:
                raise ValueError(f"group_by: {problem}")
        if self.pci_vendors and self.group_by is None:
            raise ValueError("pci_vendors needs group_by='pciDevice'")
        for vendor in self.pci_vendors:
            if not isinstance(vendor, str) or not _HEX_ID.match(vendor):
                raise ValueError(f"pci_vendors: {vendor!r} is not 1 to 4 hex digits")
        object.__setattr__(self, "pci_vendors", tuple(v.lower().zfill(4) for v in self.pci_vendors))
        if isinstance(self.count, bool) or not isinstance(self.count, int) or self.count < 1:
            raise ValueError(f"count must be an integer >= 1, got {self.count!r}")

    @property
    def lead(self) -> int:
        """Index of the path whose matches say which devices exist."""
        return next((i for i, spec in enumerate(self.paths) if not spec.optional), 0)


def _pattern_problem(pattern: Any) -> str | None:
    return _absolute_path_problem(pattern, "must name files, not /")


def _mount_path_problem(path: Any) -> str | None:
    return _absolute_path_problem(path, "must not be /")


def _absolute_path_problem(value: Any, when_root: str) -> str | None:
    """Why ``value`` is not an absolute path naming something below ``/``, or None."""
    if not isinstance(value, str) or not value:
        return "must be a non-empty string"
    if not value.startswith("/"):
        return "must be an absolute path"
    if "\0" in value:
        return "must not contain NUL"
    if _normalise(value) == "/":
        return when_root
    return None


def _permissions_problem(value: Any) -> str | None:
    if (
        not isinstance(value, str)
        or not value
        or set(value) - set("rwm")
        or len(set(value)) != len(value)
    ):
        return f"must be made of r, w and m, each at most once (r, rw, rwm), got {shown(value)}"
    return None


def _group_by_problem(group_by: str, paths: Sequence[PathSpec]) -> str | None:
    if group_by not in GROUP_BY:
        return f"must be one of {', '.join(GROUP_BY)}, got {shown(group_by)}"
    for spec in paths:
        if spec.mount:
            return "groupBy: pciDevice groups device nodes; a Mount has no sysfs device"
        if not spec.path.startswith("/dev/"):
            return (
                f"groupBy: pciDevice needs device nodes under /dev (their sysfs device is "
                f"looked up), got {shown(spec.path)}"
            )
    return None


def _normalise(pattern: str) -> str:
    # normpath keeps a leading "//" (POSIX leaves it implementation-defined); we do not.
    return "/" + posixpath.normpath(pattern).lstrip("/")


def _normalise_target(path: str) -> str:
    """A mount path, normalised; a trailing ``/`` (a directory to put matches in) is kept."""
    normal = _normalise(path)
    return f"{normal}/" if path.endswith("/") else normal
