"""Generic backend: devices made of files, the way squat's generic-device-plugin makes them.

Owns its configuration keys (``from_config``), discovery (path globs read under ``devRoot``,
groups of paths, USB devices and the PCI card behind /dev nodes read from ``sysfsRoot``),
stable device IDs, and path-following health through ``fswatch.changes``: a device is Healthy
while every non-optional path of it is present, pushed Unhealthy within milliseconds of one
going away. Learned from squat/generic-device-plugin ``deviceplugin/{path,usb}.go``; device host
paths from containerd ``pkg/oci/utils_unix.go`` and CRI-O ``server/container_create_linux.go``.
"""

from __future__ import annotations

import contextlib
import fnmatch
import glob
import hashlib
import logging
import os
import posixpath
import re
import threading
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import anyio

from devplugin_sdk import fswatch
from devplugin_sdk.backends import _generic_host as host
from devplugin_sdk.config import ConfigReader, shown
from devplugin_sdk.errors import ConfigError
from devplugin_sdk.plugin import DevicePlugin
from devplugin_sdk.types import (
    Allocation,
    Device,
    DeviceNode,
    Health,
    HealthEvent,
    Mount,
    RescanEvent,
    replicate,
)

__all__ = [
    "GROUP_BY",
    "USB_CLASSES",
    "GenericPlugin",
    "Group",
    "PathSpec",
    "UsbSpec",
    "from_config",
]

log = logging.getLogger(__name__)

# Device IDs stay within 63 characters, the convention the SDK documents for Device.id.
MAX_ID_LENGTH = 63
# Seconds between full rescans (re-glob, re-read sysfs, re-stat every known path).
DEFAULT_HEALTH_INTERVAL = 2.0
#: The one way to group matches by hardware: the PCI function each node belongs to.
GROUP_BY = ("pciDevice",)
#: Classes of nodes a USB device's interfaces may carry, for ``UsbSpec.include``.
USB_CLASSES = ("hidraw", "input", "sound", "tty", "usbmisc", "video4linux")
_NOT_ID_CHAR = re.compile(r"[^A-Za-z0-9._:-]+")
_HEX_ID = re.compile(r"^[0-9a-fA-F]{1,4}$")
PathType = Literal["Device", "Mount"]


# ====================================================================== what a group is made of


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


# ====================================================================== the plugin's view


@dataclass(frozen=True, slots=True)
class _Pattern:
    """A configured glob and where it is read.

    Attributes:
        configured: The configured path (a host path).
        glob: The pattern ``glob.glob`` reads (the base escaped).
        parts: Components of ``glob``, for ``fnmatch`` one level at a time.
        first_wild: Index in ``parts`` of the first wildcard component (the last component
            for a literal path).
        anchor: The real directory before that component: the one to watch.
        base: The directory it is read under (``dev_root``, or ``root``), None: as written.
        prefix: What ``base`` stands for in the configured path (``/dev``, ``/``).
        read_as: The pattern as read, unescaped (for messages).
    """

    configured: str
    glob: str
    parts: tuple[str, ...]
    first_wild: int
    anchor: Path
    base: Path | None
    prefix: str
    read_as: str

    @classmethod
    def make(cls, configured: str, base: Path | None, skip: int) -> _Pattern:
        own = Path(configured).parts
        first = _first_wild(own)
        if base is None:
            anchor = Path(*own[:first])
            return cls(configured, configured, own, first, anchor, None, "/", configured)
        # Escape the base so that glob characters in a temporary directory's name stay literal.
        escaped = Path(glob.escape(str(base))).parts
        rooted = (*escaped, *own[skip:])
        first_read = len(escaped) + first - skip
        anchor = base.joinpath(*own[skip:first]) if first >= skip else base.parent
        prefix = "/" + "/".join(own[1:skip])
        read_as = str(base.joinpath(*own[skip:]))
        return cls(
            configured,
            str(Path(*rooted)),
            rooted,
            max(first_read, 0),
            anchor,
            base,
            prefix,
            read_as,
        )

    def configured_path(self, read: str) -> str:
        """The configured-form (host) path of a match read at ``read``."""
        if self.base is None:
            return read
        relative = os.path.relpath(read, self.base)
        return self.prefix if relative == "." else posixpath.join(self.prefix, relative)

    @property
    def where(self) -> str:
        """`` (read as <path>)`` when it is read elsewhere than configured, else nothing."""
        return "" if self.read_as == self.configured else f" (read as {self.read_as})"


@dataclass(frozen=True, slots=True)
class _Member:
    """A path of a device: where the plugin reads it and what the container gets."""

    read: str
    host: str
    container: str
    name: str
    mount: bool = False
    permissions: str = "rw"
    read_only: bool = False
    optional: bool = False

    def usable(self) -> bool:
        return host.usable(self.read, directory_ok=self.mount)


@dataclass(frozen=True, slots=True)
class _Unit:
    """One device before sharing (``count``): its paths and what else decides its health."""

    id: str
    members: tuple[_Member, ...]
    problems: tuple[str, ...]
    count: int
    numa_nodes: tuple[int, ...] = ()
    attributes: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class _View:
    """The devices as of the latest scan, read by the watch's fast path without a thread hop.

    Attributes:
        units: Every device (before sharing).
        index: Positions in ``units`` of the devices each read path belongs to.
        optional: Read path of each optional member, by host path (checked at Allocate).
        optional_reads: The read paths of optional members.
        include_dirs: Directories of nodes found on USB devices' interfaces.
    """

    units: tuple[_Unit, ...] = ()
    index: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    optional: Mapping[str, str] = field(default_factory=dict)
    optional_reads: frozenset[str] = frozenset()
    include_dirs: frozenset[Path] = frozenset()


@dataclass(frozen=True, slots=True)
class _Snapshot:
    """A scan's outcome: the view, the devices it lists, each device's health and reason."""

    view: _View
    devices: tuple[Device, ...]
    health: Mapping[str, tuple[Health, str]]
    signature: tuple[Any, ...]


@dataclass(slots=True)
class _PciCard:
    members: dict[int, list[_Member]]
    numa_nodes: tuple[int, ...] = ()


@dataclass(slots=True)
class _UsbPlug:
    members: list[_Member]
    described: str


class GenericPlugin(DevicePlugin):
    """One extended resource whose devices are made of files: glob matches, groups of paths,
    USB devices, or the nodes of one PCI card.

    ``GenericPlugin(name, paths, share)`` is the shorthand: each existing match of each glob is
    one device, handed to the container as a device node at the same path with ``rw`` access
    (one ``Group`` of one ``PathSpec`` per glob, ``count=share``). ``groups`` says more (see
    ``Group``). A device stays listed once seen; it is Healthy while every non-optional path of
    it is present (and, for a USB device, while it is plugged in), Unhealthy meanwhile, and a
    new match is a new device. ``watch()`` follows the paths' directories with
    ``fswatch.changes`` (inotify, plus a full rescan every ``health_interval``).

    ``*`` does not match names starting with ``.``, as in the shell. A symlink match
    (``/dev/serial/by-id/*``) is handed over as the link (containerd and CRI-O resolve device
    host paths themselves); a dangling link counts as gone.

    Args:
        resource_name: Extended resource name, e.g. ``"example.com/widget"``.
        paths: The shorthand: absolute glob patterns, e.g. ``["/dev/ttyUSB*"]``.
        share: With ``paths``: how many containers may use one match at once; above 1 each
            match becomes ``share`` devices ``<id>::<n>`` (see ``devplugin_sdk.types.replicate``).
        groups: Instead of ``paths``: the groups of this resource.
        sysfs_root: Where sysfs is read (USB devices, PCI functions); default ``/sys``.
        dev_root: Where paths under ``/dev`` are read; default ``/dev``. The paths handed to
            the kubelet stay ``/dev/...``: they are host paths.
        root: Re-roots every path onto a directory tree (``devplugin demo``, benchmarks):
            ``/dev/widget*`` is read as ``<root>/dev/widget*``, and device nodes carry that real
            file as ``host_path`` and the configured path as ``container_path``. ``dev_root`` and
            ``sysfs_root`` default to ``<root>/dev`` and ``<root>/sys``. Not a configuration key.
        health_interval: Seconds between full rescans in ``watch()``: re-glob the paths,
            re-read USB devices and re-state every device's health (the safety net under
            inotify, and the only mechanism without it).

    Raises:
        ValueError: on a bad resource name, no paths and no groups (or both), a bad pattern,
            ``share`` < 1, or ``health_interval`` <= 0.

    Device IDs: a path device is named after its (lead) path relative to the lead patterns'
    common directory, ``/`` replaced by ``_`` (``/dev/ttyUSB0`` -> ``ttyUSB0``;
    ``/dev/serial/by-id/x`` with a second pattern in ``/dev`` -> ``serial_by-id_x``); a
    ``pciDevice`` group's device is named after its PCI address (``0000:03:00.0``), a USB device
    after its port (``1-1.4``). An ID that would be longer than 63 characters, hold characters
    other than ``[A-Za-z0-9._:-]``, or repeat another device's ID is shortened and suffixed with
    a hash. IDs are kept for the plugin's lifetime.
    """

    def __init__(
        self,
        resource_name: str,
        paths: Sequence[str] = (),
        share: int = 1,
        *,
        groups: Sequence[Group] = (),
        sysfs_root: Path | str | None = None,
        dev_root: Path | str | None = None,
        root: Path | str | None = None,
        health_interval: float = DEFAULT_HEALTH_INTERVAL,
    ) -> None:
        super().__init__(resource_name=resource_name)
        if not health_interval > 0:
            raise ValueError(f"{resource_name}: health_interval must be > 0, got {health_interval}")
        self.groups: tuple[Group, ...] = _groups(resource_name, paths, share, groups)
        self.share = share
        self.root = Path(root).resolve() if root is not None else None
        self.sysfs_root = Path(sysfs_root) if sysfs_root is not None else _under(self.root, "sys")
        self.dev_root = Path(dev_root) if dev_root is not None else _under(self.root, "dev")
        # DevicePlugin.health_interval: this backend's health is watched, and re-stated by a
        # full rescan this often; it never polls check_health.
        self.health_interval: float = float(health_interval)
        self.patterns: tuple[str, ...] = tuple(
            spec.path for group in self.groups for spec in (*group.paths, *group.shared)
        )
        self._patterns: dict[tuple[int, str, int], _Pattern] = {
            (g, kind, k): self._pattern(spec.path)
            for g, group in enumerate(self.groups)
            for kind, specs in (("paths", group.paths), ("shared", group.shared))
            for k, spec in enumerate(specs)
        }
        # In-step devices are named after their lead path, relative to the common directory of
        # the lead patterns' fixed parts.
        leads = [g.paths[g.lead].path for g in self.groups if g.paths and g.group_by is None]
        self._id_base = posixpath.commonpath([_anchor(p) for p in leads]) if leads else "/dev"
        longest = max(group.count for group in self.groups)
        # Room for the "::N" suffix of the last share.
        self._max_id = MAX_ID_LENGTH - (len(f"::{longest - 1}") if longest > 1 else 0)
        self._usb_groups = any(group.usb for group in self.groups)
        self._includes = any(spec.include for group in self.groups for spec in group.usb)
        self._dynamic = self._usb_groups or any(
            p.first_wild < len(p.parts) - 1 for p in self._patterns.values()
        )
        # What has been seen, kept for the plugin's lifetime, changed only under _lock (scans
        # run in worker threads; discover() and watch() may scan at once).
        self._lock = threading.Lock()
        self._steps: dict[tuple[int, int], list[_Member]] = {}  # in-step groups, per path
        self._shared: dict[tuple[int, int], list[_Member]] = {}
        self._cards: dict[int, dict[str, _PciCard]] = {}  # pciDevice groups, by address
        self._plugs: dict[int, dict[str, _UsbPlug]] = {}  # usb groups, by port
        self._claimed: dict[str, tuple[int, str]] = {}  # read path -> the group that took it
        self._node_dirs: set[Path] = set()  # directories of nodes found on USB interfaces
        self._unit_ids: dict[tuple[Any, ...], str] = {}
        self._ids: set[str] = set()
        self._warned: set[str] = set()
        # The latest scan's view (swapped whole), and what discover() last listed.
        self._view = _View()
        self._listed: frozenset[str] = frozenset()
        self._listed_signature: tuple[Any, ...] | None = None

    def __repr__(self) -> str:
        if all(len(g.paths) == 1 and not g.shared and g.group_by is None for g in self.groups):
            return (
                f"GenericPlugin({self.resource_name!r}, {list(self.patterns)!r}, "
                f"share={self.share})"
            )
        return f"GenericPlugin({self.resource_name!r}, groups={list(self.groups)!r})"

    # ------------------------------------------------------------------ hooks

    async def discover(self) -> Sequence[Device]:
        """Glob the paths and read USB devices; every device seen so far is listed.

        Returns:
            The devices, ordered by ID (numbers in natural order), each group's with its
            ``::N`` shares when its ``count`` is above 1.
        """
        snapshot = await self._scan()
        self._listed = frozenset(unit.id for unit in snapshot.view.units)
        self._listed_signature = snapshot.signature
        return list(snapshot.devices)

    async def watch(self) -> AsyncIterator[HealthEvent | RescanEvent]:
        """Follow the paths' directories: push health at once, ask for rescans of new devices.

        A change to a known path yields a ``HealthEvent`` for each device it belongs to (the
        shares' parent), straight from the file-system notification, without a thread hop.
        A full rescan (right after the watch is armed, then every ``health_interval``) and a
        change that could be a new match re-scan in a worker thread: every listed device's
        health is stated again (the SDK ignores a report equal to the latest one), and a new
        device, or a device whose paths changed, yields a ``RescanEvent``, after which
        ``discover()`` lists it.
        """
        # A function when the set can grow (wildcard directory levels, USB bus directories):
        # fswatch calls it in a thread after each change. Otherwise a list, and no thread hop.
        directories: list[Path] | Callable[[], list[Path]] = (
            self._watch_dirs if self._dynamic else self._fixed_dirs()
        )
        stream = fswatch.changes(directories, self.health_interval, relevant=self._relevant)
        async with contextlib.aclosing(stream) as batches:
            async for changed in batches:
                unknown = not changed  # an empty batch: the full rescan
                view = self._view
                for path in changed:
                    text = str(path)
                    positions = view.index.get(text)
                    if positions is None:
                        unknown = True
                        continue
                    # An optional path changes what a device hands over: list it again.
                    unknown = unknown or text in view.optional_reads
                    for position in positions:
                        unit = view.units[position]
                        if unit.id not in self._listed:
                            unknown = True
                            continue
                        # Fast path: a stat of a /dev node (devtmpfs, in memory) does not block.
                        health, reason = _pushed(unit, text)
                        yield HealthEvent(unit.id, health, reason)
                if unknown:
                    for event in self._reconcile(await self._scan()):
                        yield event

    async def allocate(self, devices: Sequence[Device]) -> Allocation:
        """Merge the devices' nodes and mounts, less the optional paths that are gone now.

        The runtime fails to create a container whose device or mount host path is missing;
        an optional path may go at any moment, so it is checked here, not only at discovery.
        """
        allocation = Allocation.merge(devices)
        optional = self._view.optional
        if not optional:
            return allocation
        nodes = tuple(
            node
            for node in allocation.device_nodes
            if node.host_path not in optional or host.usable(optional[node.host_path])
        )
        mounts = tuple(
            mount
            for mount in allocation.mounts
            if mount.host_path not in optional or host.usable(optional[mount.host_path], True)
        )
        return replace(allocation, device_nodes=nodes, mounts=mounts)

    # ------------------------------------------------------------------ scanning

    async def _scan(self) -> _Snapshot:
        return await anyio.to_thread.run_sync(self._scan_blocking)

    def _scan_blocking(self) -> _Snapshot:
        """Read the host, learn what is new, and state every device (in a worker thread)."""
        with self._lock:
            plugged = host.usb_devices(self.sysfs_root) if self._usb_groups else []
            units: list[_Unit] = []
            for g, group in enumerate(self.groups):
                shared, missing = self._scan_shared(g, group)
                if group.usb:
                    units += self._scan_usb(g, group, plugged, shared, missing)
                elif group.group_by is not None:
                    units += self._scan_cards(g, group, shared, missing)
                else:
                    units += self._scan_steps(g, group, shared, missing)
            units.sort(key=lambda unit: host.natural_key(unit.id))
            view = _build_view(units, frozenset(self._node_dirs))
            self._view = view
        devices: list[Device] = []
        health: dict[str, tuple[Health, str]] = {}
        for unit in units:
            state, reason, absent = _state(unit)
            health[unit.id] = (state, reason)
            devices += replicate([_device(unit, state, absent)], unit.count)
        signature = tuple(
            (d.id, d.numa_nodes, d.device_nodes, d.mounts, tuple(sorted(d.attributes.items())))
            for d in devices
        )
        return _Snapshot(view, tuple(devices), health, signature)

    def _scan_steps(
        self, g: int, group: Group, shared: list[_Member], missing: list[str]
    ) -> list[_Unit]:
        """Paths joined in step: the n-th match of each path (as first seen) is device n."""
        seen: list[list[_Member]] = []
        for k, spec in enumerate(group.paths):
            members = self._steps.setdefault((g, k), [])
            known = {member.read for member in members}
            pattern = self._patterns[(g, "paths", k)]
            reads = host.matches(pattern.glob, directories=spec.mount)
            for read in reads:
                if read in known or self._claimed.setdefault(read, (g, "paths")) != (g, "paths"):
                    continue  # a file another group took is not a second device
                members.append(self._member(spec, pattern, read))
            if not reads and not members and not spec.optional:
                self._warn_empty(f"{g}.paths.{k}", pattern)
            seen.append(members)
        units: list[_Unit] = []
        for n, lead in enumerate(seen[group.lead]):
            natural = posixpath.relpath(lead.name, self._id_base).replace("/", "_")
            unit_id = self._unit_id(("step", g, lead.read), natural, lead.name)
            members = [paths[n] for paths in seen if n < len(paths)]
            problems = [
                f"{spec.path} has no match #{n + 1}"
                for k, spec in enumerate(group.paths)
                if n >= len(seen[k]) and not spec.optional
            ]
            units.append(
                _Unit(
                    unit_id,
                    (*members, *shared),
                    (*problems, *missing),
                    group.count,
                    attributes=_path_attribute(lead.container),
                )
            )
        return units

    def _scan_cards(
        self, g: int, group: Group, shared: list[_Member], missing: list[str]
    ) -> list[_Unit]:
        """Paths joined by the PCI function their nodes belong to: one device per card."""
        found: dict[str, dict[int, list[_Member]]] = {}
        functions: dict[str, host.PciDevice] = {}
        for k, spec in enumerate(group.paths):
            pattern = self._patterns[(g, "paths", k)]
            reads = host.matches(pattern.glob, directories=False)
            if not reads and not spec.optional:
                self._warn_empty(f"{g}.paths.{k}", pattern)
            for read in reads:
                if self._claimed.get(read, (g, "cards")) != (g, "cards"):
                    continue
                member = self._member(spec, pattern, read)
                devname = posixpath.relpath(pattern.configured_path(read), "/dev")
                function = host.pci_device(self.sysfs_root, read, devname)
                if function is None:
                    self._warn_once(
                        f"nopci:{read}",
                        "%s belongs to no PCI device in %s; left out",
                        read,
                        self.sysfs_root,
                    )
                    continue
                if group.pci_vendors and function.vendor not in group.pci_vendors:
                    continue
                self._claimed[read] = (g, "cards")
                functions[function.address] = function
                found.setdefault(function.address, {}).setdefault(k, []).append(member)
        cards = self._cards.setdefault(g, {})
        for address, per_path in found.items():
            card = cards.get(address)
            if card is None:
                if group.lead not in per_path:
                    continue  # not one of this group's cards (e.g. a BMC's display-only card0)
                card = cards[address] = _PciCard({})
            # What the card's nodes resolve to now wins (a node renumbered after a driver
            # reload); a path that resolves to nothing now keeps its last nodes, now missing.
            card.members.update(per_path)
            card.numa_nodes = functions[address].numa_nodes
        units: list[_Unit] = []
        for address, card in cards.items():
            unit_id = self._unit_id(("card", g, address), address, f"pci:{address}")
            members = [m for k in sorted(card.members) for m in card.members[k]]
            problems = [
                f"{spec.path} has no match on {address}"
                for k, spec in enumerate(group.paths)
                if not card.members.get(k) and not spec.optional
            ]
            units.append(
                _Unit(
                    unit_id,
                    (*members, *shared),
                    (*problems, *missing),
                    group.count,
                    card.numa_nodes,
                    {"pciAddress": address},
                )
            )
        return units

    def _scan_usb(
        self,
        g: int,
        group: Group,
        plugged: Sequence[host.UsbDevice],
        shared: list[_Member],
        missing: list[str],
    ) -> list[_Unit]:
        """USB devices matching the group's specs: one device per port they are plugged in."""
        plugs = self._plugs.setdefault(g, {})
        present: set[str] = set()
        for j, spec in enumerate(group.usb):
            hits = [device for device in plugged if spec.matches(device)]
            if not hits:
                self._warn_once(
                    f"{g}.usb.{j}",
                    "no USB device %s is plugged in (read %s); no device from it until one is",
                    spec,
                    self.sysfs_root / "bus" / "usb" / "devices",
                )
            for device in hits:
                owner = self._claimed.setdefault(str(self.dev_root / device.devname), (g, "usb"))
                if device.name in present or owner != (g, "usb"):
                    continue  # matched by an earlier spec, or taken by another group
                present.add(device.name)
                nodes = [self._node(device.devname)]
                nodes += [self._node(name) for name in host.usb_class_nodes(device, spec.include)]
                self._node_dirs.update(Path(node.read).parent for node in nodes[1:])
                plugs[device.name] = _UsbPlug(nodes, str(spec))
        units: list[_Unit] = []
        for port, plug in plugs.items():
            unit_id = self._unit_id(("usb", g, port), port, f"usb:{port}")
            gone = [] if port in present else [f"USB device {plug.described} at {port} is gone"]
            units.append(
                _Unit(
                    unit_id,
                    (*plug.members, *shared),
                    (*gone, *missing),
                    group.count,
                    attributes={"usbPort": port, "usbId": plug.described},
                )
            )
        return units

    def _scan_shared(self, g: int, group: Group) -> tuple[list[_Member], list[str]]:
        """The group's shared paths as seen so far, and those never seen."""
        members: list[_Member] = []
        missing: list[str] = []
        for k, spec in enumerate(group.shared):
            seen = self._shared.setdefault((g, k), [])
            known = {member.read for member in seen}
            pattern = self._patterns[(g, "shared", k)]
            for read in host.matches(pattern.glob, directories=spec.mount):
                if read not in known:
                    seen.append(self._member(spec, pattern, read))
            if not seen and not spec.optional:
                self._warn_empty(f"{g}.shared.{k}", pattern)
                missing.append(f"{spec.path} matches nothing")
            members += seen
        return members, missing

    # ------------------------------------------------------------------ paths and IDs

    def _pattern(self, configured: str) -> _Pattern:
        if self.root is not None:
            return _Pattern.make(configured, self.root, 1)
        if configured == "/dev" or configured.startswith("/dev/"):
            return _Pattern.make(configured, self.dev_root, 2)
        return _Pattern.make(configured, None, 0)

    def _member(self, spec: PathSpec, pattern: _Pattern, read: str) -> _Member:
        configured = pattern.configured_path(read)
        container = spec.mount_path or configured
        if container.endswith("/"):
            container += posixpath.basename(configured)
        # The runtime opens host_path on the host: the host's path, not where we read it.
        return _Member(
            read=read,
            host=read if self.root is not None else configured,
            container=container,
            name=configured,
            mount=spec.mount,
            permissions=spec.permissions,
            read_only=spec.read_only,
            optional=spec.optional,
        )

    def _node(self, devname: str) -> _Member:
        """A node found in sysfs, ``/dev/<devname>`` on the host."""
        read = str(self.dev_root / devname)
        configured = f"/dev/{devname}"
        host_path = read if self.root is not None else configured
        return _Member(read, host_path, configured, configured)

    def _unit_id(self, key: tuple[Any, ...], natural: str, source: str) -> str:
        unit_id = self._unit_ids.get(key)
        if unit_id is None:
            unit_id = self._make_id(natural, source)
            self._unit_ids[key] = unit_id
            self._ids.add(unit_id)
        return unit_id

    def _make_id(self, natural: str, source: str) -> str:
        if (
            len(natural) <= self._max_id
            and not _NOT_ID_CHAR.search(natural)
            and natural not in self._ids
        ):
            return natural
        digest = hashlib.sha256(os.fsencode(source)).hexdigest()[:12]
        readable = _NOT_ID_CHAR.sub("_", natural)[: self._max_id - len(digest) - 1]
        device_id = f"{readable}-{digest}"
        if device_id in self._ids:  # pragma: no cover - needs a SHA-256 prefix collision
            raise ValueError(f"{self.resource_name}: cannot make a unique ID for {source}")
        log.info(
            "%s: %s gets device ID %s (%r is too long, not plain or taken)",
            self.resource_name,
            source,
            device_id,
            natural,
            extra={"resource": self.resource_name, "device": device_id},
        )
        return device_id

    def _warn_empty(self, key: str, pattern: _Pattern) -> None:
        self._warn_once(
            key,
            "%s matches nothing%s; no device from it until a match appears",
            pattern.configured,
            pattern.where,
        )

    def _warn_once(self, key: str, message: str, *args: object) -> None:
        """Log a warning the first time only: a rescan every few seconds must not repeat it."""
        if key in self._warned:
            return
        self._warned.add(key)
        log.warning(
            f"%s: {message}", self.resource_name, *args, extra={"resource": self.resource_name}
        )

    # ------------------------------------------------------------------ watching

    def _fixed_dirs(self) -> list[Path]:
        """The fixed directory of every pattern."""
        return list(dict.fromkeys(pattern.anchor for pattern in self._patterns.values()))

    def _watch_dirs(self) -> list[Path]:
        """The fixed directories, existing directories at wildcard levels, USB bus directories
        and the directories of nodes found on USB devices (blocking: fswatch runs it in a
        thread)."""
        directories: dict[Path, None] = dict.fromkeys(self._fixed_dirs())
        for pattern in self._patterns.values():
            # /dev/bus/usb/*/* needs /dev/bus/usb/001 and friends watched as well.
            for level in range(pattern.first_wild + 1, len(pattern.parts)):
                for match in host.matches(str(Path(*pattern.parts[:level])), directories=True):
                    if os.path.isdir(match):
                        directories[Path(match)] = None
        if self._usb_groups:
            # A plugged device's usbfs node appears in /dev/bus/usb/BBB (udev or devtmpfs).
            bus = self.dev_root / "bus" / "usb"
            directories[bus] = None
            for match in host.matches(f"{glob.escape(str(bus))}/*", directories=True):
                if os.path.isdir(match):
                    directories[Path(match)] = None
        if self._includes:
            directories[self.dev_root] = None
            directories.update(dict.fromkeys(sorted(self._view.include_dirs)))
        return list(directories)

    def _relevant(self, changed: Path) -> bool:
        """Whether a changed path is a known path, could be a match (or one of its
        directories), or is about USB devices."""
        if str(changed) in self._view.index or self._could_match(changed.parts):
            return True
        if not self._usb_groups:
            return False
        bus = self.dev_root / "bus" / "usb"
        if changed == bus or bus in changed.parents:
            return True
        return self._includes and (
            changed.parent == self.dev_root or changed.parent in self._view.include_dirs
        )

    def _could_match(self, parts: tuple[str, ...]) -> bool:
        """Whether a path matches a pattern or one of its leading directories."""
        for pattern in self._patterns.values():
            if len(parts) <= len(pattern.parts) and all(
                fnmatch.fnmatchcase(part, pattern_part)
                for part, pattern_part in zip(parts, pattern.parts, strict=False)
            ):
                return True
        return False

    def _reconcile(self, snapshot: _Snapshot) -> list[HealthEvent | RescanEvent]:
        """Health of every listed device, plus a rescan if the devices are not those listed."""
        events: list[HealthEvent | RescanEvent] = []
        if snapshot.signature != self._listed_signature:
            # First: the SDK rediscovers before it takes the next event, so a device whose
            # paths changed (a USB device plugged back) is listed with them before it is
            # stated Healthy.
            new = [unit.id for unit in snapshot.view.units if unit.id not in self._listed]
            what = f"new devices {host.first_of(new, 5)}" if new else "devices changed"
            events.append(RescanEvent(f"{self.resource_name}: {what}"))
        events += [
            HealthEvent(device_id, state, reason)
            for device_id, (state, reason) in snapshot.health.items()
            if device_id in self._listed
        ]
        return events


# ====================================================================== configuration


def from_config(config: Mapping[str, Any]) -> list[DevicePlugin]:
    """One ``GenericPlugin`` per entry of ``resources`` (the backend contract of ``devplugin run``).

    The keys::

        healthInterval: 2                   # optional: seconds between full rescans
        sysfsRoot: /sys                     # optional: where sysfs is read
        devRoot: /dev                       # optional: where paths under /dev are read
        resources:
          - resourceName: example.com/widget  # extended resource name, unique in the file
            paths: ["/dev/widget*"]           # the shorthand: each existing match is one device
            share: 1                          # optional: containers per match (IDs get ::N)
          - resourceName: amd.com/gpu
            groups:                           # or groups: see docs/configuration.md
              - groupBy: pciDevice
                pciVendors: ["1002"]
                paths: [{path: "/dev/dri/renderD*"}, {path: "/dev/dri/card*"}]
                shared: [{path: /dev/kfd}]

    Args:
        config: The backend's part of the configuration file (its top-level keys less the
            SDK's own).

    Returns:
        The plugins, in configuration order.

    Raises:
        ConfigError: naming the dotted key (``resources[1].groups[0].paths[2].type``) and what
            is wrong with it.
    """
    reader = ConfigReader(config)
    reader.known("resources", "healthInterval", "sysfsRoot", "devRoot")
    interval = reader.interval("healthInterval", DEFAULT_HEALTH_INTERVAL)
    sysfs_root = reader.path("sysfsRoot", "/sys")
    dev_root = reader.path("devRoot", "/dev")
    plugins: list[DevicePlugin] = []
    first_seen: dict[str, str] = {}
    for entry in reader.sections("resources", required=True):
        entry.known(
            "resourceName",
            "paths",
            "share",
            "groups",
            hint={"name": "renamed to resourceName (the key every backend uses)"},
        )
        name = entry.resource_name("resourceName")
        if name in first_seen:
            raise ConfigError(
                entry.key("resourceName"), f"duplicate of {first_seen[name]} ({shown(name)})"
            )
        first_seen[name] = entry.key("resourceName")
        if entry.has("groups"):
            for key, why in (
                ("paths", "give either paths (one device per match) or groups, not both"),
                ("share", "is for paths; with groups, give each group a count"),
            ):
                if entry.has(key):
                    raise ConfigError(entry.key(key), why)
            groups = [_group(group) for group in entry.sections("groups", required=True)]
            plugins.append(
                GenericPlugin(
                    name,
                    groups=groups,
                    sysfs_root=sysfs_root,
                    dev_root=dev_root,
                    health_interval=interval,
                )
            )
            continue
        if not entry.has("paths"):
            raise ConfigError(
                entry.key("paths"), "is required: a non-empty list of path globs (or give groups)"
            )
        paths = entry.strings("paths", required=True)
        for number, pattern in enumerate(paths):
            problem = _pattern_problem(pattern)
            if problem is not None:
                raise ConfigError(
                    f"{entry.key('paths')}[{number}]", f"{problem}, got {shown(pattern)}"
                )
        share = entry.integer("share", 1, minimum=1)
        plugins.append(
            GenericPlugin(
                name,
                paths,
                share,
                sysfs_root=sysfs_root,
                dev_root=dev_root,
                health_interval=interval,
            )
        )
    return plugins


def _group(reader: ConfigReader) -> Group:
    reader.known("paths", "usb", "shared", "groupBy", "pciVendors", "count")
    paths = tuple(_path_spec(item) for item in reader.sections("paths"))
    usb = tuple(_usb_spec(item) for item in reader.sections("usb"))
    shared = tuple(_path_spec(item) for item in reader.sections("shared"))
    if paths and usb:
        raise ConfigError(reader.key("usb"), "a group has paths or usb, not both")
    if not paths and not usb:
        raise ConfigError(
            reader.key("paths"), "a group needs paths (a non-empty list) or usb: it has no device"
        )
    group_by: str | None = None
    if reader.has("groupBy"):
        group_by = reader.choice("groupBy", GROUP_BY)
        if usb:
            raise ConfigError(reader.key("groupBy"), "groups paths; a usb group has none")
        for k, spec in enumerate(paths):
            problem = _group_by_problem(group_by, (spec,))
            if problem is not None:
                key = "type" if spec.mount else "path"
                raise ConfigError(f"{reader.key('paths')}[{k}].{key}", problem)
    pci_vendors: tuple[str, ...] = ()
    if reader.has("pciVendors"):
        if group_by is None:
            raise ConfigError(reader.key("pciVendors"), "needs groupBy: pciDevice")
        pci_vendors = reader.strings("pciVendors", required=True)
        for i, vendor in enumerate(pci_vendors):
            if not _HEX_ID.match(vendor):
                raise ConfigError(
                    f"{reader.key('pciVendors')}[{i}]",
                    f"must be a PCI vendor ID of 1 to 4 hex digits, got {shown(vendor)}",
                )
    count = reader.integer("count", 1, minimum=1)
    return Group(paths, usb, shared, group_by, pci_vendors, count)


def _path_spec(reader: ConfigReader) -> PathSpec:
    reader.known("path", "mountPath", "type", "readOnly", "permissions", "optional")
    path = reader.string("path")
    problem = _pattern_problem(path)
    if problem is not None:
        raise ConfigError(reader.key("path"), f"{problem}, got {shown(path)}")
    mount_path = reader.optional_string("mountPath")
    if mount_path is not None:
        problem = _mount_path_problem(mount_path)
        if problem is not None:
            raise ConfigError(reader.key("mountPath"), f"{problem}, got {shown(mount_path)}")
    kind: PathType = (
        "Mount" if reader.choice("type", ("Device", "Mount"), "Device") == "Mount" else "Device"
    )
    read_only = reader.boolean("readOnly", False)
    if "readOnly" in reader.data and kind == "Device":
        raise ConfigError(
            reader.key("readOnly"),
            "is for type: Mount; a device node's access is its permissions (r, rw, rwm)",
        )
    permissions = "rw"
    if "permissions" in reader.data:
        if kind == "Mount":
            raise ConfigError(
                reader.key("permissions"), "is for type: Device; a mount has readOnly"
            )
        value = reader.data["permissions"]
        problem = _permissions_problem(value)
        if problem is not None:
            raise ConfigError(reader.key("permissions"), problem)
        permissions = value
    optional = reader.boolean("optional", False)
    return PathSpec(path, mount_path, kind, read_only, permissions, optional)


def _usb_spec(reader: ConfigReader) -> UsbSpec:
    reader.known("vendor", "product", "serial", "include")
    ids: dict[str, str] = {}
    for name in ("vendor", "product"):
        value = reader.data.get(name)
        if value is None:
            raise ConfigError(reader.key(name), 'is required: a hex ID in quotes, e.g. "0403"')
        if not isinstance(value, str):
            # YAML reads 0403 as the octal number 259 and 1209 as a decimal: IDs are text.
            raise ConfigError(
                reader.key(name),
                f'must be a hex ID in quotes, e.g. "0403" (YAML read a {type(value).__name__}: '
                f"{shown(value)})",
            )
        if not _HEX_ID.match(value):
            raise ConfigError(reader.key(name), f"must be 1 to 4 hex digits, got {shown(value)}")
        ids[name] = value
    serial = reader.optional_string("serial")
    include = reader.choices("include", USB_CLASSES, ()) if reader.has("include") else ()
    return UsbSpec(ids["vendor"], ids["product"], serial, include)


# ====================================================================== helpers


def _groups(
    resource_name: str, paths: Sequence[str], share: int, groups: Sequence[Group]
) -> tuple[Group, ...]:
    """The groups of a plugin: ``groups``, or one group per path of the shorthand."""
    if isinstance(share, bool) or not isinstance(share, int) or share < 1:
        raise ValueError(f"{resource_name}: share must be an integer >= 1, got {share!r}")
    if isinstance(paths, str):
        message = f"{resource_name}: paths must be a list of glob patterns, not a str"
        raise ValueError(message)  # noqa: TRY004 - misuse is a ValueError in the whole SDK
    if paths and groups:
        raise ValueError(f"{resource_name}: give paths (the shorthand) or groups, not both")
    if paths:
        specs: list[PathSpec] = []
        for pattern in paths:
            problem = _pattern_problem(pattern)
            if problem is not None:
                raise ValueError(f"{resource_name}: path {pattern!r}: {problem}")
            specs.append(PathSpec(pattern))
        return tuple(Group(paths=(spec,), count=share) for spec in specs)
    if not groups:
        raise ValueError(f"{resource_name}: paths must be a non-empty list of glob patterns")
    if share != 1:
        raise ValueError(f"{resource_name}: share is for paths; give each Group a count")
    if not all(isinstance(group, Group) for group in groups):
        raise ValueError(f"{resource_name}: groups must be Group objects")
    return tuple(groups)


def _build_view(units: Sequence[_Unit], include_dirs: frozenset[Path]) -> _View:
    index: dict[str, tuple[int, ...]] = {}
    optional: dict[str, str] = {}
    for position, unit in enumerate(units):
        for member in unit.members:
            index[member.read] = (*index.get(member.read, ()), position)
            if member.optional:
                optional[member.host] = member.read
    return _View(tuple(units), index, optional, frozenset(optional.values()), include_dirs)


def _state(unit: _Unit) -> tuple[Health, str, frozenset[str]]:
    """A device's health and why, and its optional paths that are gone (one stat per path)."""
    missing: list[str] = []
    absent: set[str] = set()
    for member in unit.members:
        if member.usable():
            continue
        if member.optional:
            absent.add(member.read)
        else:
            missing.append(member.read)
    reasons = list(unit.problems)
    if missing:
        reasons.append(f"{host.first_of(missing)} {_is_are(missing)} missing")
    if reasons:
        return Health.UNHEALTHY, "; ".join(reasons), frozenset(absent)
    required = [m.read for m in unit.members if not m.optional] or [m.read for m in unit.members]
    return (
        Health.HEALTHY,
        f"{host.first_of(required)} {_is_are(required)} present",
        frozenset(absent),
    )


def _pushed(unit: _Unit, changed: str) -> tuple[Health, str]:
    """A device's health after ``changed`` (one of its paths) came or went."""
    missing: list[str] = []
    what = f"{changed} is back"
    for member in unit.members:
        if member.usable():
            continue
        if member.read == changed:
            what = f"{changed} disappeared" + (" (optional)" if member.optional else "")
        if not member.optional:
            missing.append(member.read)
    if changed in missing:
        return Health.UNHEALTHY, what
    problems = list(unit.problems)
    if missing:
        problems.append(f"{host.first_of(missing)} {_is_are(missing)} missing")
    if not problems:
        return Health.HEALTHY, what
    return Health.UNHEALTHY, f"{what}; {'; '.join(problems)}"


def _device(unit: _Unit, health: Health, absent: frozenset[str]) -> Device:
    """The SDK device of a unit; optional paths that are gone are left out."""
    kept = [member for member in unit.members if member.read not in absent]
    return Device(
        id=unit.id,
        health=health,
        numa_nodes=unit.numa_nodes,
        device_nodes=tuple(
            DeviceNode(m.host, m.container, m.permissions) for m in kept if not m.mount
        ),
        mounts=tuple(Mount(m.host, m.container, m.read_only) for m in kept if m.mount),
        attributes=unit.attributes,
    )


def _path_attribute(path: str) -> dict[str, str]:
    """``{"path": path}``, or nothing when the path is longer than a DRA attribute may be (64
    bytes): the device nodes still carry it."""
    return {"path": path} if len(path.encode()) <= 64 else {}


def _is_are(items: Sequence[str]) -> str:
    return "is" if len(items) == 1 else "are"


def _under(root: Path | None, name: str) -> Path:
    return root / name if root is not None else Path("/") / name


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


def _is_wild(part: str) -> bool:
    return any(char in part for char in "*?[")


def _first_wild(parts: Sequence[str]) -> int:
    """Index of the first wildcard component; a literal path counts from its last one."""
    for index, part in enumerate(parts):
        if _is_wild(part):
            return index
    return len(parts) - 1


def _anchor(pattern: str) -> str:
    """The directory before a pattern's first wildcard component (its parent if none)."""
    parts = Path(pattern).parts
    return str(Path(*parts[: _first_wild(parts)]))
