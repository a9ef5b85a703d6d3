"""Watch directories for entries appearing, disappearing or changing, with low latency.

Used by the kubelet-restart watcher (the kubelet deletes and recreates sockets in its directory)
and by backends for hot-plug (/dev entries). inotify through ctypes gives sub-millisecond
notification; a directory listing compared every ``poll_interval`` catches anything inotify
missed (queue overflow, watch limits) and is the only mechanism where inotify is unavailable.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import logging
import os
import struct
import sys
import time
from collections.abc import AsyncGenerator, Callable, Iterable
from pathlib import Path

import anyio

from devplugin_sdk.types import RescanEvent

__all__ = ["changes", "watch", "watch_or_rescan"]

log = logging.getLogger(__name__)

# <sys/inotify.h>
IN_MODIFY = 0x002
IN_ATTRIB = 0x004
IN_MOVED_FROM = 0x040
IN_MOVED_TO = 0x080
IN_CREATE = 0x100
IN_DELETE = 0x200
IN_DELETE_SELF = 0x400
IN_MOVE_SELF = 0x800
IN_Q_OVERFLOW = 0x4000
IN_IGNORED = 0x8000
IN_ONLYDIR = 0x01000000
IN_NONBLOCK = 0o4000
IN_CLOEXEC = 0o2000000

# Entries appearing, going or changing attributes; not writes (a write to /dev/null would wake
# every watcher of /dev).
_DIR_MASK = (
    IN_CREATE | IN_DELETE | IN_MOVED_FROM | IN_MOVED_TO | IN_ATTRIB | IN_DELETE_SELF | IN_MOVE_SELF
) | IN_ONLYDIR
# A watched directory's parent only tells us about the directory itself coming or going.
_PARENT_MASK = IN_CREATE | IN_DELETE | IN_MOVED_FROM | IN_MOVED_TO | IN_ONLYDIR
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len

Snapshot = dict[str, tuple[int, int, int]]


@functools.cache
def _libc() -> ctypes.CDLL:
    """The C library's symbols, from what the interpreter already has loaded (glibc or musl).

    Not ``ctypes.util.find_library``: on Linux it runs ``ldconfig -p`` in a subprocess each
    time (about 2 ms, on every watcher's start).
    """
    return ctypes.CDLL(None, use_errno=True)


class _Inotify:
    """A non-blocking inotify instance (Linux only)."""

    def __init__(self) -> None:
        if not sys.platform.startswith("linux"):
            raise OSError(errno.ENOSYS, "inotify is Linux-only")
        libc = _libc()
        self._add = libc.inotify_add_watch
        self._add.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
        self._rm = libc.inotify_rm_watch
        self._rm.argtypes = [ctypes.c_int, ctypes.c_int]
        fd = libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
        self.fd: int = fd

    def add_watch(self, path: Path, mask: int) -> int:
        wd = int(self._add(self.fd, os.fsencode(path), mask))
        if wd < 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err), str(path))
        return wd

    def remove_watch(self, wd: int) -> None:
        self._rm(self.fd, wd)

    def read(self) -> list[tuple[int, int, str]]:
        """Read every queued event as (wd, mask, name)."""
        events: list[tuple[int, int, str]] = []
        while True:
            try:
                data = os.read(self.fd, 64 * 1024)
            except BlockingIOError:
                return events
            offset = 0
            while offset + _EVENT.size <= len(data):
                wd, mask, _cookie, length = _EVENT.unpack_from(data, offset)
                raw = data[offset + _EVENT.size : offset + _EVENT.size + length]
                events.append((wd, mask, os.fsdecode(raw.rstrip(b"\0"))))
                offset += _EVENT.size + length

    def close(self) -> None:
        os.close(self.fd)


def _snapshot(directory: Path) -> Snapshot | None:
    """Entries of ``directory`` with (inode, ctime_ns, mtime_ns), or None if it is missing."""
    try:
        with os.scandir(directory) as entries:
            out: Snapshot = {}
            for entry in entries:
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                out[entry.name] = (st.st_ino, st.st_ctime_ns, st.st_mtime_ns)
            return out
    except OSError:
        return None


def _diff(directory: Path, old: Snapshot | None, new: Snapshot | None) -> set[Path]:
    if old == new:
        return set()
    if old is None or new is None:
        return {directory} | {directory / name for name in (old or new or {})}
    changed = set(old.keys() ^ new.keys())
    changed |= {name for name in old.keys() & new.keys() if old[name] != new[name]}
    return {directory / name for name in changed}


class _Watcher:
    """State of one ``watch()`` call: inotify watches plus the polling snapshots."""

    def __init__(self, directories: list[Path], use_inotify: bool) -> None:
        self.directories = directories
        self.snapshots: dict[Path, Snapshot | None] = {d: _snapshot(d) for d in directories}
        self.inotify: _Inotify | None = None
        self.wds: dict[int, Path] = {}
        self.watched: dict[Path, int] = {}
        if use_inotify:
            try:
                self.inotify = _Inotify()
            except OSError as exc:
                log.warning("inotify unavailable (%s); falling back to polling", exc)
        self.refresh_watches()

    def refresh_watches(self) -> None:
        """Watch every directory that exists, and the parent of every one that does not."""
        if self.inotify is None:
            return
        wanted: dict[Path, int] = {}
        for directory in self.directories:
            # The parent tells us when the directory itself is created or removed.
            wanted.setdefault(directory.parent, _PARENT_MASK)
        for directory in self.directories:
            wanted[directory] = _DIR_MASK
        for path, mask in wanted.items():
            if path in self.watched:
                continue
            try:
                wd = self.inotify.add_watch(path, mask)
            except OSError as exc:
                if exc.errno not in (errno.ENOENT, errno.ENOTDIR):
                    log.warning("cannot watch %s (%s); relying on polling", path, exc)
                continue
            self.wds[wd] = path
            self.watched[path] = wd

    def handle_events(self) -> set[Path]:
        assert self.inotify is not None
        changed: set[Path] = set()
        overflow = False
        for wd, mask, name in self.inotify.read():
            if mask & IN_Q_OVERFLOW:
                overflow = True
                continue
            path = self.wds.get(wd)
            if path is None:
                continue
            if mask & (IN_IGNORED | IN_DELETE_SELF | IN_MOVE_SELF):
                # The watched directory went away: forget the watch so it is re-added later.
                self.wds.pop(wd, None)
                self.watched.pop(path, None)
                if path in self.snapshots:
                    changed.add(path)
                continue
            target = path / name if name else path
            if path in self.snapshots:
                changed.add(target)
            elif target in self.snapshots:
                # An event in a parent about one of our directories (created, removed, moved).
                changed.add(target)
        if overflow:
            changed |= self.poll(force_all=True)
        else:
            self.refresh_watches()
            self._restat(changed)
        return changed

    def _restat(self, changed: set[Path]) -> None:
        """Keep snapshots current so the next poll does not report the same change twice:
        re-stat only the changed names (re-listing a large /dev costs milliseconds)."""
        for path in changed:
            if path in self.snapshots:
                self.snapshots[path] = _snapshot(path)
                continue
            snapshot = self.snapshots.get(path.parent)
            if snapshot is None:
                continue
            try:
                st = os.lstat(path)
            except OSError:
                snapshot.pop(path.name, None)
            else:
                snapshot[path.name] = (st.st_ino, st.st_ctime_ns, st.st_mtime_ns)

    def poll(self, force_all: bool = False) -> set[Path]:
        changed: set[Path] = set()
        for directory in self.directories:
            new = _snapshot(directory)
            old = self.snapshots[directory]
            if force_all:
                changed |= _diff(directory, None, new) if new is not None else {directory}
            else:
                changed |= _diff(directory, old, new)
            self.snapshots[directory] = new
        self.refresh_watches()
        return changed

    def close(self) -> None:
        if self.inotify is not None:
            self.inotify.close()

    async def next_batch(self, timeout: float) -> set[Path]:
        """Changed paths, or an empty set when ``timeout`` passes with none.

        inotify wakes it at once; when inotify stays quiet for ``timeout`` the directories are
        listed and compared (the safety net), which is also all there is without inotify.
        """
        if self.inotify is not None:
            with anyio.move_on_after(timeout):
                await anyio.wait_readable(self.inotify.fd)
                return self.handle_events()
        else:
            await anyio.sleep(timeout)
        return self.poll()


async def watch(
    directories: Iterable[Path | str], *, poll_interval: float = 2.0, use_inotify: bool = True
) -> AsyncGenerator[set[Path], None]:
    """Yield sets of changed paths in ``directories`` until the caller stops iterating.

    A path is reported when an entry is created, deleted, moved or has its attributes changed
    (writes to a file are not reported); a directory itself is reported when it appears or
    disappears. Missing directories are picked up when they appear.

    Args:
        directories: Directories to watch (not recursive).
        poll_interval: Seconds between listing comparisons (the fallback and safety net).
        use_inotify: Set False to force polling (tests of the fallback).

    Yields:
        Non-empty sets of changed paths.
    """
    if poll_interval <= 0:
        raise ValueError(f"poll_interval must be > 0, got {poll_interval}")
    watcher = _Watcher([Path(d) for d in directories], use_inotify)
    try:
        while True:
            changed = await watcher.next_batch(poll_interval)
            if changed:
                yield changed
    finally:
        watcher.close()


Directories = Iterable[Path | str] | Callable[[], Iterable[Path | str]]


async def changes(
    directories: Directories,
    interval: float,
    *,
    relevant: Callable[[Path], bool] | None = None,
    use_inotify: bool = True,
) -> AsyncGenerator[set[Path], None]:
    """Watch directories, or rescan every interval: the loop behind every hot-plug backend.

    Yields an empty set, meaning "rescan everything", right after the watch is armed (so
    nothing that changes during that rescan is missed) and again every ``interval`` seconds;
    in between it yields the relevant changed paths as soon as inotify reports them (within
    about a millisecond). Where inotify is unavailable the directories are compared every
    ``interval`` and the rescan is the only signal.

    Args:
        directories: Directories to watch, or a function returning them (called in a worker
            thread before each round; a changed answer after a change re-arms the watch).
        interval: Seconds between full rescans.
        relevant: Keeps only the changed paths it returns True for (None: every path).
        use_inotify: Set False to force polling (tests of the fallback).

    Yields:
        ``set()`` for a full rescan, or a non-empty set of relevant changed paths.
    """
    if interval <= 0:
        raise ValueError(f"interval must be > 0, got {interval}")
    dynamic = callable(directories)

    async def current() -> list[Path]:
        if callable(directories):
            found = await anyio.to_thread.run_sync(lambda: list(directories()))
        else:
            found = list(directories)
        return [Path(d) for d in found]

    watched = await current()
    while True:
        watcher = _Watcher(watched, use_inotify)  # armed before the rescan it announces
        try:
            yield set()
            deadline = time.monotonic() + interval
            while (left := deadline - time.monotonic()) > 0:
                batch = await watcher.next_batch(left)
                hits = {p for p in batch if relevant is None or relevant(p)}
                if not hits:
                    continue
                yield hits
                if dynamic and (now := await current()) != watched:
                    watched = now  # e.g. a new directory at a wildcard level
                    break
        finally:
            watcher.close()
        if dynamic:
            watched = await current()


async def watch_or_rescan(
    directories: Directories,
    interval: float,
    *,
    relevant: Callable[[Path], bool] | None = None,
) -> AsyncGenerator[RescanEvent, None]:
    """A ``DevicePlugin.watch()`` that asks for a rescan when the devices may have changed.

    The SDK diffs what ``discover()`` returns, devices and their health alike, so for a
    backend whose devices and health are read from files (sysfs, /dev) a rescan is the whole
    job: return this from ``watch()``::

        def watch(self):
            return fswatch.watch_or_rescan([self.dev_root / "infiniband"], self.interval)

    Args:
        directories: As for ``changes``.
        interval: Seconds between rescans when nothing changes (health read from attributes
            that inotify cannot see, such as sysfs, changes at this pace).
        relevant: Only changes of paths it returns True for ask for an early rescan.

    Yields:
        A ``RescanEvent`` naming what changed, or saying it is the periodic one.
    """
    stream = changes(directories, interval, relevant=relevant)
    async with contextlib.aclosing(stream) as batches:
        async for changed in batches:
            if changed:
                names = sorted(p.name for p in changed)
                more = f" and {len(names) - 5} more" if len(names) > 5 else ""
                yield RescanEvent(f"changed: {', '.join(names[:5])}{more}")
            else:
                yield RescanEvent(f"periodic rescan (every {interval:g}s)")
