"""What the generic backend finds on the host: each group's glob matches (in step, or joined by
the PCI card their nodes belong to), USB devices by port, and the device IDs, stable for the
plugin's lifetime. Everything seen stays known, so that a device that goes away is reported
Unhealthy rather than forgotten.
"""

from __future__ import annotations

import glob
import hashlib
import logging
import os
import posixpath
import re
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from devplugin_sdk import allocation
from devplugin_sdk.api import constants
from devplugin_sdk.backends import _generic_host as host
from devplugin_sdk.backends import _sysfs
from devplugin_sdk.backends.generic.groups import Group, PathSpec
from devplugin_sdk.backends.generic.health import _device, _Member, _state, _Unit
from devplugin_sdk.types import Device, Health, replicate

__all__ = ["Scanner"]

# The backend's logger, whichever of its modules logs (the name is in every JSON log line).
log = logging.getLogger("devplugin_sdk.backends.generic")

# Device IDs stay within 63 characters, the convention the SDK documents for Device.id.
MAX_ID_LENGTH = 63
_NOT_ID_CHAR = re.compile(r"[^A-Za-z0-9._:-]+")


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


class Scanner:
    """What a plugin has seen of the host, kept for its lifetime: each group's matches, PCI cards
    and USB devices, the device IDs given out, and the latest view. Blocking: ``scan`` runs in a
    worker thread, under a lock (``discover()`` and ``watch()`` may scan at once).

    Args:
        resource_name: The plugin's resource, for IDs' and warnings' messages.
        groups: The plugin's groups.
        root: Re-roots every path onto this tree (see ``GenericPlugin``), or None.
        sysfs_root: Where sysfs is read.
        dev_root: Where paths under /dev are read.
        count_keys: The key of each group's count in the configuration, for errors.
    """

    def __init__(
        self,
        resource_name: str,
        groups: tuple[Group, ...],
        root: Path | None,
        sysfs_root: Path,
        dev_root: Path,
        *,
        count_keys: tuple[str, ...],
    ) -> None:
        self.resource_name = resource_name
        self.groups = groups
        self.count_keys = count_keys
        self.root = root
        self.sysfs_root = sysfs_root
        self.dev_root = dev_root
        self.patterns: dict[tuple[int, str, int], _Pattern] = {
            (g, kind, k): self._pattern(spec.path)
            for g, group in enumerate(groups)
            for kind, specs in (("paths", group.paths), ("shared", group.shared))
            for k, spec in enumerate(specs)
        }
        # In-step devices are named after their lead path, relative to the common directory of
        # the lead patterns' fixed parts.
        leads = [g.paths[g.lead].path for g in groups if g.paths and g.group_by is None]
        self._id_base = posixpath.commonpath([_anchor(p) for p in leads]) if leads else "/dev"
        longest = max(group.count for group in groups)
        # Room for the "::N" suffix of the last share.
        self._max_id = MAX_ID_LENGTH - (len(f"::{longest - 1}") if longest > 1 else 0)
        self.usb_groups = any(group.usb for group in groups)
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
        # The latest scan's view (swapped whole), read by the watch's fast path.
        self.view = _View()

    def scan(self) -> _Snapshot:
        """Read the host, learn what is new, and state every device (in a worker thread).

        Raises:
            ConfigError: the shares of what is found would make a list the kubelet refuses
                (on the count's key, with the size); nothing is built.
        """
        with self._lock:
            plugged = host.usb_devices(self.sysfs_root) if self.usb_groups else []
            found: list[list[_Unit]] = []
            for g, group in enumerate(self.groups):
                shared, missing = self._scan_shared(g, group)
                if group.usb:
                    found.append(self._scan_usb(g, group, plugged, shared, missing))
                elif group.group_by is not None:
                    found.append(self._scan_cards(g, group, shared, missing))
                else:
                    found.append(self._scan_steps(g, group, shared, missing))
            self._check_list_size(found)
            units = [unit for units_of_group in found for unit in units_of_group]
            units.sort(key=lambda unit: host.natural_key(unit.id))
            view = _build_view(units, frozenset(self._node_dirs))
            self.view = view
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

    def _check_list_size(self, found: Sequence[Sequence[_Unit]]) -> None:
        """Refuse shares whose list would pass the kubelet's 4 MiB limit, before building it:
        the count whose devices weigh most is named, with the most that would fit."""
        by_key: dict[str, list[_Unit]] = {}
        rest: list[_Unit] = []
        for key, units in zip(self.count_keys, found, strict=True):
            shared = [u for u in units if u.count > 1]
            by_key.setdefault(key, []).extend(shared)
            rest += [u for u in units if u.count == 1]
        sizes = {key: _shares_bytes(units) for key, units in by_key.items() if units}
        fixed = _shares_bytes(rest)
        if not sizes or fixed + sum(sizes.values()) <= constants.MAX_MESSAGE_BYTES:
            return
        key = max(sizes, key=lambda k: sizes[k])
        units = by_key[key]
        others = fixed + sum(size for k, size in sizes.items() if k != key)
        count = units[0].count

        def size_of(n: int) -> int:
            return others + _shares_bytes(units, n)

        if size_of(1) > constants.MAX_MESSAGE_BYTES:
            return  # too many devices even unshared: not this count's doing (the SDK logs it)
        where = self._where(len(units), [g for g, k in enumerate(self.count_keys) if k == key])
        allocation.check_list_size(
            key,
            size_of(count),
            f"{count:,} shares",
            f"at most {allocation.most_that_fit(size_of, count):,} fit",
            where=f"here ({sum(u.count for u in units):,} devices of {where})",
        )

    def _where(self, matched: int, groups: Sequence[int]) -> str:
        """``16 matches`` (the shorthand) or ``3 grouped devices``, for messages."""
        if all(len(self.groups[g].paths) == 1 and not self.groups[g].shared for g in groups):
            return f"{matched:,} match{'es' if matched != 1 else ''}"
        return f"{matched:,} grouped device{'s' if matched != 1 else ''}"

    def _scan_steps(
        self, g: int, group: Group, shared: list[_Member], missing: list[str]
    ) -> list[_Unit]:
        """Paths joined in step: the n-th match of each path (as first seen) is device n."""
        seen: list[list[_Member]] = []
        for k, spec in enumerate(group.paths):
            members = self._steps.setdefault((g, k), [])
            known = {member.read for member in members}
            pattern = self.patterns[(g, "paths", k)]
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
            pattern = self.patterns[(g, "paths", k)]
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
                    {"pciAddress": address, **_sysfs.numa_attribute(card.numa_nodes)},
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
            pattern = self.patterns[(g, "shared", k)]
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


def _shares_bytes(units: Sequence[_Unit], count: int | None = None) -> int:
    """The ListAndWatch bytes of ``units`` shared ``count`` ways each (their own count if
    None), every device Unhealthy (the largest the list gets)."""
    size = 0
    for unit in units:
        n = unit.count if count is None else count
        if n == 1:
            size += allocation.list_entry_bytes(unit.id, unit.numa_nodes, Health.UNHEALTHY)
        else:
            size += allocation.numbered_list_bytes(f"{unit.id}::", n, unit.numa_nodes)
    return size


def _build_view(units: Sequence[_Unit], include_dirs: frozenset[Path]) -> _View:
    index: dict[str, tuple[int, ...]] = {}
    optional: dict[str, str] = {}
    for position, unit in enumerate(units):
        for member in unit.members:
            index[member.read] = (*index.get(member.read, ()), position)
            if member.optional:
                optional[member.host] = member.read
    return _View(tuple(units), index, optional, frozenset(optional.values()), include_dirs)


def _path_attribute(path: str) -> dict[str, str]:
    """``{"path": path}``, or nothing when the path is longer than a DRA attribute may be (64
    bytes): the device nodes still carry it."""
    return {"path": path} if len(path.encode()) <= 64 else {}


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
