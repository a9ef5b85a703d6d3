"""Generic backend: every file matching a path glob is one device, handed to the container as-is.

Owns its configuration keys (``from_config``), glob discovery, path-derived device IDs and
path-following health through ``fswatch.changes`` (Unhealthy within milliseconds of a match
going away, Healthy when it returns). For USB serial, FUSE, TUN or video nodes; the SDK's
default.
Learned from squat/generic-device-plugin ``deviceplugin/path.go``; device host paths from
containerd ``pkg/oci/utils_unix.go``, ``internal/cri/opts/spec_linux.go``, CRI-O
``server/container_create_linux.go``.
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
import stat
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio

from devplugin_sdk import fswatch
from devplugin_sdk.config import ConfigReader, shown
from devplugin_sdk.errors import ConfigError
from devplugin_sdk.plugin import DevicePlugin
from devplugin_sdk.types import Device, DeviceNode, Health, HealthEvent, RescanEvent, replicate

__all__ = ["GenericPlugin", "from_config"]

log = logging.getLogger(__name__)

# Device IDs stay within 63 characters, the convention the SDK documents for Device.id.
MAX_ID_LENGTH = 63
# Seconds between full rescans (re-glob, re-stat every known match) under the inotify watch.
DEFAULT_HEALTH_INTERVAL = 2.0
_NOT_ID_CHAR = re.compile(r"[^A-Za-z0-9._:-]+")
_NATURAL = re.compile(r"(\d+)")


@dataclass(frozen=True, slots=True)
class _Pattern:
    """A configured glob, re-rooted.

    Attributes:
        glob: The re-rooted pattern for ``glob.glob`` (root escaped).
        parts: Components of ``glob``, for ``fnmatch`` one level at a time.
        first_wild: Index in ``parts`` of the first wildcard component (the last component
            for a literal path).
        anchor: The real directory before that component: the one to watch.
    """

    glob: str
    parts: tuple[str, ...]
    first_wild: int
    anchor: Path

    @classmethod
    def make(cls, configured: str, root: Path | None) -> _Pattern:
        own = Path(configured).parts
        first = _first_wild(own)
        if root is None:
            return cls(configured, own, first, Path(*own[:first]))
        # Escape the root so that glob characters in a temporary directory's name stay literal.
        base = Path(glob.escape(str(root))).parts
        offset = len(base) - 1
        rooted = (*base, *own[1:])
        return cls(str(Path(*rooted)), rooted, first + offset, root.joinpath(*own[1:first]))


@dataclass(frozen=True, slots=True)
class _Match:
    """A path we have seen match: its device ID and where the container gets it."""

    id: str
    host_path: str
    container_path: str


class GenericPlugin(DevicePlugin):
    """One extended resource whose devices are the files matching some path globs.

    Each existing match of ``paths`` is one device: allocation gives the container that path as
    a device node, at the same path, with ``rw`` access. A match that disappears stays listed,
    Unhealthy, until it returns; a new match is a new device. ``watch()`` follows the globs'
    directories with ``fswatch.changes`` (inotify, plus a full rescan every
    ``health_interval``).

    Directories never count as matches (containerd would give the container every device node
    beneath one), and ``*`` does not match names starting with ``.``, as in the shell. A
    symlink match (``/dev/serial/by-id/*``) is handed over as the link: containerd and CRI-O
    resolve device host paths themselves; a dangling link counts as gone.

    Args:
        resource_name: Extended resource name, e.g. ``"example.com/widget"``.
        paths: Absolute glob patterns (``*``, ``?``, ``[...]``), e.g. ``["/dev/ttyUSB*"]``.
        share: How many containers may use one match at once; above 1 each match becomes
            ``share`` devices ``<id>::<n>`` (see ``devplugin_sdk.types.replicate``).
        root: Re-roots the patterns onto a directory tree (``devplugin demo``, benchmarks):
            ``/dev/widget*`` is looked up as ``<root>/dev/widget*``. Device nodes then carry the
            real file under ``root`` as ``host_path`` and the configured path (without
            ``root``) as ``container_path``. None means the host's ``/``. Not a configuration
            key: a configuration names the real paths.
        health_interval: Seconds between full rescans in ``watch()``: re-glob the patterns and
            re-state every known match's health (the safety net under inotify, and the only
            mechanism without it).

    Raises:
        ValueError: on a bad resource name, an empty or relative pattern, ``share`` < 1 or
            ``health_interval`` <= 0.

    Device IDs are the matched path relative to the patterns' common directory, with ``/``
    replaced by ``_`` (``/dev/ttyUSB0`` -> ``ttyUSB0``; ``/dev/serial/by-id/x`` with a second
    pattern in ``/dev`` -> ``serial_by-id_x``). An ID that would be longer than 63 characters,
    hold characters other than ``[A-Za-z0-9._:-]``, or repeat another match's ID is shortened
    and suffixed with a hash of the path. IDs are kept for the plugin's lifetime.
    """

    def __init__(
        self,
        resource_name: str,
        paths: Sequence[str],
        share: int = 1,
        *,
        root: Path | str | None = None,
        health_interval: float = DEFAULT_HEALTH_INTERVAL,
    ) -> None:
        super().__init__(resource_name=resource_name)
        if isinstance(paths, str) or not paths:
            raise ValueError(f"{resource_name}: paths must be a non-empty list of glob patterns")
        patterns: list[str] = []
        for pattern in paths:
            problem = _pattern_problem(pattern)
            if problem is not None:
                raise ValueError(f"{resource_name}: path {pattern!r}: {problem}")
            patterns.append(_normalise(pattern))
        if isinstance(share, bool) or not isinstance(share, int) or share < 1:
            raise ValueError(f"{resource_name}: share must be an integer >= 1, got {share!r}")
        if not health_interval > 0:
            raise ValueError(f"{resource_name}: health_interval must be > 0, got {health_interval}")
        self.patterns: tuple[str, ...] = tuple(patterns)
        self.share = share
        self.root = Path(root).resolve() if root is not None else None
        # DevicePlugin.health_interval: this backend's health is watched, and re-stated by a
        # full rescan this often; it never polls check_health.
        self.health_interval: float = float(health_interval)
        # IDs are relative to the common directory of every pattern's fixed part.
        self._id_base = posixpath.commonpath([_anchor(p) for p in self.patterns])
        self._patterns = tuple(_Pattern.make(p, self.root) for p in self.patterns)
        self._seen: dict[str, _Match] = {}  # by host path; never shrinks
        self._ids: set[str] = set()
        # Room for the "::N" suffix of the last share.
        self._max_id = MAX_ID_LENGTH - (len(f"::{share - 1}") if share > 1 else 0)

    def __repr__(self) -> str:
        return f"GenericPlugin({self.resource_name!r}, {list(self.patterns)!r}, share={self.share})"

    # ------------------------------------------------------------------ hooks

    async def discover(self) -> Sequence[Device]:
        """Glob the patterns; every match seen so far is a device, Unhealthy while it is gone.

        Returns:
            The devices, ordered by ID (numbers in natural order), with ``::N`` shares when
            ``share`` > 1.
        """
        found = await self._scan()
        self._learn(found)
        devices = [
            Device(
                id=match.id,
                health=Health.HEALTHY if found.get(match.host_path, False) else Health.UNHEALTHY,
                device_nodes=(DeviceNode(match.host_path, match.container_path, "rw"),),
                attributes={"path": match.container_path},
            )
            for match in sorted(self._seen.values(), key=lambda m: _natural_key(m.id))
        ]
        return replicate(devices, self.share)

    async def watch(self) -> AsyncIterator[HealthEvent | RescanEvent]:
        """Follow the patterns' directories: push health at once, ask for rescans of new paths.

        A change to a known match yields a ``HealthEvent`` for its ID (the shares' parent)
        straight from the file-system notification, without a thread hop. A full rescan (right
        after the watch is armed, then every ``health_interval``) and a change to a path that
        could be a new match re-glob the patterns in a worker thread: every known match's
        health is stated again (the SDK ignores a report equal to the latest one) and a new
        match yields a ``RescanEvent``, after which ``discover()`` lists it.
        """
        # A function when a wildcard level can add directories (/dev/bus/usb/*/*): fswatch calls
        # it in a thread after each change. Otherwise the list, and no thread hop per change.
        directories: list[Path] | Callable[[], list[Path]] = (
            self._watch_dirs
            if any(p.first_wild < len(p.parts) - 1 for p in self._patterns)
            else [p.anchor for p in self._patterns]
        )
        stream = fswatch.changes(directories, self.health_interval, relevant=self._relevant)
        async with contextlib.aclosing(stream) as batches:
            async for changed in batches:
                unknown = not changed  # an empty batch: the full rescan
                for path in changed:
                    match = self._seen.get(str(path))
                    if match is None:
                        unknown = True
                        continue
                    # Fast path: a stat of a /dev node (devtmpfs, in memory) does not block.
                    if _usable(match.host_path):
                        yield HealthEvent(match.id, Health.HEALTHY, f"{path} is back")
                    else:
                        yield HealthEvent(match.id, Health.UNHEALTHY, f"{path} disappeared")
                if unknown:
                    for event in self._reconcile(await self._scan()):
                        yield event

    # ------------------------------------------------------------------ matching

    def _container_path(self, host_path: str) -> str:
        if self.root is None:
            return host_path
        return "/" + Path(host_path).relative_to(self.root).as_posix()

    async def _scan(self) -> dict[str, bool]:
        """Every current match and every known path, with whether it exists."""
        # The thread gets a copy: discover() and watch() may learn paths meanwhile.
        return await anyio.to_thread.run_sync(self._scan_blocking, tuple(self._seen))

    def _scan_blocking(self, known: Sequence[str]) -> dict[str, bool]:
        found: dict[str, bool] = {}
        for pattern in self._patterns:
            for match in glob.glob(pattern.glob):
                path = str(Path(match))
                if os.path.isdir(path):
                    # containerd would hand over every device beneath a directory host path
                    # (oci.WithDevices walks it), far more than one match.
                    continue
                # glob lists dangling symlinks too; those count as gone.
                found[path] = _usable(path)
        for path in known:
            if path not in found:
                found[path] = _usable(path)
        return found

    def _watch_dirs(self) -> list[Path]:
        """The fixed directory of each pattern, plus existing directories at wildcard levels."""
        directories: dict[Path, None] = {}
        for pattern in self._patterns:
            directories[pattern.anchor] = None
            # /dev/bus/usb/*/* needs /dev/bus/usb/001 and friends watched as well.
            for level in range(pattern.first_wild + 1, len(pattern.parts)):
                for match in sorted(glob.glob(str(Path(*pattern.parts[:level])))):
                    if os.path.isdir(match):
                        directories[Path(match)] = None
        return list(directories)

    def _relevant(self, changed: Path) -> bool:
        """Whether a changed path is a known match or could be one (or one of its directories)."""
        return str(changed) in self._seen or self._could_match(changed.parts)

    def _could_match(self, parts: tuple[str, ...]) -> bool:
        """Whether a path matches a pattern or one of its leading directories."""
        for pattern in self._patterns:
            if len(parts) <= len(pattern.parts) and all(
                fnmatch.fnmatchcase(part, pattern_part)
                for part, pattern_part in zip(parts, pattern.parts, strict=False)
            ):
                return True
        return False

    # ------------------------------------------------------------------ state

    def _learn(self, found: Mapping[str, bool]) -> None:
        """Give every new path an ID, in natural order (so IDs are reproducible)."""
        for path in sorted((p for p in found if p not in self._seen), key=_natural_key):
            container = self._container_path(path)
            device_id = self._make_id(container)
            self._seen[path] = _Match(device_id, path, container)
            self._ids.add(device_id)

    def _make_id(self, container_path: str) -> str:
        relative = posixpath.relpath(container_path, self._id_base)
        natural = relative.replace("/", "_")
        if (
            len(natural) <= self._max_id
            and not _NOT_ID_CHAR.search(natural)
            and natural not in self._ids
        ):
            return natural
        digest = hashlib.sha256(os.fsencode(container_path)).hexdigest()[:12]
        readable = _NOT_ID_CHAR.sub("_", natural)[: self._max_id - len(digest) - 1]
        device_id = f"{readable}-{digest}"
        if device_id in self._ids:  # pragma: no cover - needs a SHA-256 prefix collision
            raise ValueError(f"{self.resource_name}: cannot make a unique ID for {container_path}")
        log.info(
            "%s: %s gets device ID %s (%r is too long, not plain or taken)",
            self.resource_name,
            container_path,
            device_id,
            natural,
            extra={"resource": self.resource_name, "device": device_id},
        )
        return device_id

    def _reconcile(self, found: Mapping[str, bool]) -> list[HealthEvent | RescanEvent]:
        """Health of every known match in ``found``, plus a rescan if it holds a new match."""
        events: list[HealthEvent | RescanEvent] = []
        new: list[str] = []
        for path, exists in found.items():
            # Read _seen now, not before the scan: discover() may have learnt paths meanwhile.
            match = self._seen.get(path)
            if match is None:
                new.append(path)
            elif exists:
                events.append(HealthEvent(match.id, Health.HEALTHY, f"{path} is present"))
            else:
                events.append(HealthEvent(match.id, Health.UNHEALTHY, f"{path} is missing"))
        if new:
            shown_paths = ", ".join(sorted(new, key=_natural_key)[:5])
            more = f" and {len(new) - 5} more" if len(new) > 5 else ""
            events.append(RescanEvent(f"{self.resource_name}: new matches {shown_paths}{more}"))
        return events


# ====================================================================== configuration


def from_config(config: Mapping[str, Any]) -> list[DevicePlugin]:
    """One ``GenericPlugin`` per entry of ``resources`` (the backend contract of ``devplugin run``).

    The keys::

        healthInterval: 2                   # optional: seconds between full rescans
        resources:
          - resourceName: example.com/widget  # extended resource name, unique in the file
            paths: ["/dev/widget*"]           # absolute globs; each existing match is one device
            share: 1                          # optional: containers per match (IDs get ::N)

    Args:
        config: The backend's part of the configuration file (its top-level keys less the
            SDK's own).

    Returns:
        The plugins, in configuration order.

    Raises:
        ConfigError: naming the dotted key (``resources[1].share``) and what is wrong with it.
    """
    reader = ConfigReader(config)
    reader.known("resources", "healthInterval")
    interval = reader.interval("healthInterval", DEFAULT_HEALTH_INTERVAL)
    plugins: list[DevicePlugin] = []
    first_seen: dict[str, str] = {}
    for entry in reader.sections("resources", required=True):
        entry.known(
            "resourceName",
            "paths",
            "share",
            hint={"name": "renamed to resourceName (the key every backend uses)"},
        )
        name = entry.resource_name("resourceName")
        if name in first_seen:
            raise ConfigError(
                entry.key("resourceName"), f"duplicate of {first_seen[name]} ({shown(name)})"
            )
        first_seen[name] = entry.key("resourceName")
        paths = entry.strings("paths", required=True)
        for number, pattern in enumerate(paths):
            problem = _pattern_problem(pattern)
            if problem is not None:
                raise ConfigError(
                    f"{entry.key('paths')}[{number}]", f"{problem}, got {shown(pattern)}"
                )
        share = entry.integer("share", 1, minimum=1)
        plugins.append(GenericPlugin(name, paths, share, health_interval=interval))
    return plugins


# ====================================================================== helpers


def _pattern_problem(pattern: Any) -> str | None:
    if not isinstance(pattern, str) or not pattern:
        return "must be a non-empty string"
    if not pattern.startswith("/"):
        return "must be an absolute path"
    if "\0" in pattern:
        return "must not contain NUL"
    if _normalise(pattern) == "/":
        return "must name files, not /"
    return None


def _normalise(pattern: str) -> str:
    # normpath keeps a leading "//" (POSIX leaves it implementation-defined); we do not.
    return "/" + posixpath.normpath(pattern).lstrip("/")


def _usable(path: str) -> bool:
    """Whether ``path`` exists, following symlinks, and is not a directory (one stat)."""
    try:
        return not stat.S_ISDIR(os.stat(path).st_mode)
    except OSError:
        return False


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


def _natural_key(text: str) -> list[Any]:
    return [int(piece) if piece.isdigit() else piece for piece in _NATURAL.split(text)]
