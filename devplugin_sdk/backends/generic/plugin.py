"""``GenericPlugin``: the hooks of a resource whose devices are made of files. Discovery is a
scan in a worker thread (``discovery``); ``watch()`` follows the paths' directories with
``fswatch.changes`` and pushes a device's health the moment one of its paths comes or goes
(``health``), straight from the notification.
"""

from __future__ import annotations

import contextlib
import fnmatch
import glob
import os
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread

from devplugin_sdk import fswatch
from devplugin_sdk.backends import _generic_host as host
from devplugin_sdk.backends.generic.discovery import Scanner, _Snapshot, log
from devplugin_sdk.backends.generic.groups import Group, PathSpec, _pattern_problem
from devplugin_sdk.backends.generic.health import _pushed
from devplugin_sdk.errors import ConfigError
from devplugin_sdk.plugin import DevicePlugin
from devplugin_sdk.types import Allocation, Device, HealthEvent, RescanEvent

__all__ = ["DEFAULT_HEALTH_INTERVAL", "GenericPlugin"]

# Seconds between full rescans (re-glob, re-read sysfs, re-stat every known path).
DEFAULT_HEALTH_INTERVAL = 2.0


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
        config_key: Where the resource is in a configuration file (``resources[0]``), to name
            ``share`` or a group's ``count`` in errors; ``from_config`` sets it.

    Discovery refuses (``ConfigError`` on ``share`` or the group's ``count``, with the size)
    shares whose ListAndWatch list would pass the kubelet's 4 MiB limit, before building a
    device; a rescan that finds that many keeps the devices listed and says so once.

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

    rescan_interval = 0.0  # watch() rescans on its own (inotify and a full rescan per interval)

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
        config_key: str | None = None,
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
        where = f"{config_key}." if config_key is not None else f"{resource_name}: "
        count_keys = tuple(
            f"{where}share" if paths else f"{where}groups[{g}].count"
            for g in range(len(self.groups))
        )
        self._scanner = Scanner(
            resource_name,
            self.groups,
            self.root,
            self.sysfs_root,
            self.dev_root,
            count_keys=count_keys,
        )
        self._patterns = self._scanner.patterns
        self._usb_groups = self._scanner.usb_groups
        self._includes = any(spec.include for group in self.groups for spec in group.usb)
        self._dynamic = self._usb_groups or any(
            p.first_wild < len(p.parts) - 1 for p in self._patterns.values()
        )
        # What discover() last listed.
        self._listed: frozenset[str] = frozenset()
        self._listed_signature: tuple[Any, ...] | None = None
        self._oversized: str | None = None  # the list-size refusal last logged

    def __repr__(self) -> str:
        if all(len(g.paths) == 1 and not g.shared and g.group_by is None for g in self.groups):
            return (
                f"GenericPlugin({self.resource_name!r}, {list(self.patterns)!r}, "
                f"share={self.share})"
            )
        return f"GenericPlugin({self.resource_name!r}, groups={list(self.groups)!r})"

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
                view = self._scanner.view
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
                    try:
                        snapshot = await self._scan()
                    except ConfigError as exc:
                        self._too_many(exc)
                        continue
                    self._oversized = None
                    for event in self._reconcile(snapshot):
                        yield event

    async def allocate(self, devices: Sequence[Device]) -> Allocation:
        """Merge the devices' nodes and mounts, less the optional paths that are gone now.

        The runtime fails to create a container whose device or mount host path is missing;
        an optional path may go at any moment, so it is checked here, not only at discovery.
        """
        allocation = Allocation.merge(devices)
        optional = self._scanner.view.optional
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

    async def _scan(self) -> _Snapshot:
        return await anyio.to_thread.run_sync(self._scanner.scan)

    def _too_many(self, error: ConfigError) -> None:
        """A rescan found more shares than a list can carry: keep the listed devices, say so
        once (each rescan would find the same)."""
        if str(error) == self._oversized:
            return
        self._oversized = str(error)
        log.error(
            "%s: %s; keeping the devices already listed",
            self.resource_name,
            error,
            extra={"resource": self.resource_name},
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
            directories.update(dict.fromkeys(sorted(self._scanner.view.include_dirs)))
        return list(directories)

    def _relevant(self, changed: Path) -> bool:
        """Whether a changed path is a known path, could be a match (or one of its
        directories), or is about USB devices."""
        if str(changed) in self._scanner.view.index or self._could_match(changed.parts):
            return True
        if not self._usb_groups:
            return False
        bus = self.dev_root / "bus" / "usb"
        if changed == bus or bus in changed.parents:
            return True
        return self._includes and (
            changed.parent == self.dev_root or changed.parent in self._scanner.view.include_dirs
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


def _under(root: Path | None, name: str) -> Path:
    return root / name if root is not None else Path("/") / name
