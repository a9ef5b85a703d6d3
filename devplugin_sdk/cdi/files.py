"""Spec files on disk: atomic writes, reads that never block or run long, and the lock through
which one live plugin owns a spec path.

A runtime sees the old spec or the new one, never a partial file; what sits at a spec path and
was not written by us is never opened unless it is a regular file of the right size. Directory
and file rules were learned from pkg/cdi/spec-dirs.go and writer.go of
cncf-tags/container-device-interface.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import stat
from pathlib import Path

from devplugin_sdk import _files
from devplugin_sdk._files import file_kind
from devplugin_sdk.cdi.names import spec_file_name
from devplugin_sdk.cdi.spec import CdiSpec

__all__ = ["DEFAULT_SPEC_DIR", "remove_spec", "write_spec"]

log = logging.getLogger("devplugin_sdk")

#: Where generated (as opposed to installed) specs go; runtimes also read /etc/cdi.
DEFAULT_SPEC_DIR = Path("/var/run/cdi")

# Runtimes load only *.json and *.yaml files from a spec directory (pkg/cdi/spec-dirs.go); the
# temporary files of a write end in .tmp and are never read half-written.
_SPEC_SUFFIXES = (".json", ".yaml")
_FILE_MODE = 0o644

#: What a spec path's identity is: device, inode, size and modification time. A file replaced by
#: another writer (a rename: new inode) or rewritten in place (new size or mtime) is not ours.
_Identity = tuple[int, int, int, int]


def _identity(st: os.stat_result) -> _Identity:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _target(spec: CdiSpec, directory: Path, name: str | None) -> Path:
    if name is None:
        name = spec_file_name(spec.kind)
    elif not name.endswith(_SPEC_SUFFIXES):
        name += ".json"
    if name.endswith(".yaml"):
        raise ValueError(f"CDI spec file {name!r}: this module writes JSON; use a .json name")
    if "/" in name or name.startswith(".") or "\0" in name:
        # Runtimes skip subdirectories; a leading dot would hide it from people, not runtimes.
        raise ValueError(f"CDI spec file name {name!r} must be a bare name not starting with '.'")
    return Path(directory) / name


def _holds(path: Path, data: bytes) -> _Identity | None:
    """The identity of ``path`` if it is a regular file holding exactly ``data``, else None.

    Never blocks and never reads more than ``len(data)`` bytes: anything but a regular file is
    not opened at all (a FIFO would block the open, ``/dev/zero`` never ends, a device's open
    may have side effects), a symlink is not followed, and a file of another size differs
    without a read.

    Raises:
        OSError: the path cannot be examined (e.g. the directory is not searchable).
    """
    try:
        before = os.lstat(path)
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(before.st_mode):
        log.warning(
            "CDI spec path %s is %s, not a regular file: not reading it; the spec replaces it",
            path,
            file_kind(before.st_mode),
        )
        return None
    if before.st_size != len(data):
        return None
    try:
        # Swapped for something else since the lstat: no-follow fails on a symlink (ELOOP),
        # non-blocking opens a FIFO without waiting, and the fstat below refuses it.
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size != len(data):
            return None
        chunks: list[bytes] = []
        left = len(data)
        while left > 0:
            chunk = os.read(fd, left)
            if not chunk:
                return None
            chunks.append(chunk)
            left -= len(chunk)
        return _identity(st) if b"".join(chunks) == data else None
    finally:
        os.close(fd)


def _replace(path: Path, data: bytes) -> _Identity:
    """Atomically and durably replace whatever is at ``path`` with a regular file holding
    ``data`` (``_files.write_atomically``: the rename replaces the directory entry itself, a
    symlink, a FIFO or a device, never writing through it).

    Returns:
        The new file's identity.

    Raises:
        OSError: nothing changed at ``path`` and no temporary file is left.
    """
    path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    return _identity(_files.write_atomically(path, data, mode=_FILE_MODE))


def _write_if_changed(data: bytes, path: Path) -> bool:
    """Atomically replace ``path`` with ``data`` unless it already holds exactly that."""
    if _holds(path, data) is not None:
        return False
    _replace(path, data)
    return True


def write_spec(spec: CdiSpec, directory: Path = DEFAULT_SPEC_DIR, name: str | None = None) -> Path:
    """Write ``spec`` atomically into ``directory``; blocking (use a thread from async code).

    The bytes go to a temporary ``.<name>.*.tmp`` file in the same directory (runtimes only
    read ``*.json`` and ``*.yaml``), are fsynced, then renamed over the target, so a runtime sees
    the old spec or the new one, never a partial file. An unchanged spec is not rewritten. The
    existing file is only read when it is a regular file of the new spec's size; anything else
    at the path (a symlink, a FIFO, a device) is replaced without being opened.

    This function takes no lock: ``use_cdi`` plugins also make sure that one live process owns
    each spec file (see ``CdiPlugin``).

    Args:
        spec: The spec; it must have at least one device.
        directory: The CDI spec directory, created if missing.
        name: File name; ``<vendor>-<class>.json`` by default; ``.json`` is appended when the
            name has no ``.json`` suffix.

    Returns:
        The spec file's path.

    Raises:
        ValueError: an empty spec (CDI requires a device; use ``remove_spec``) or a bad name.
        OSError: the file could not be written; the previous file is left as it was.
    """
    if not spec.devices:
        raise ValueError(f"CDI spec {spec.kind} has no devices; remove the file instead")
    path = _target(spec, Path(directory), name)
    _write_if_changed(spec.to_json(), path)
    return path


def remove_spec(path: Path) -> bool:
    """Remove a spec file written by ``write_spec``, whoever wrote it.

    Returns:
        Whether a file was removed (False if it was already gone).
    """
    try:
        Path(path).unlink()
    except FileNotFoundError:
        return False
    return True


class _SpecBusyError(OSError):
    """Another live process (or another plugin in this one) owns the spec file."""


class _SpecFile:
    """One spec path as a plugin owns it: its lock, the file it wrote, its temporary files.

    Blocking; ``CdiPlugin`` calls it from a worker thread. Ownership is a ``flock`` on a hidden
    ``.<name>.lock`` beside the spec (runtimes read only ``*.json`` and ``*.yaml``), which the
    kernel releases when the process dies, however it dies. Only the holder writes the spec,
    removes stale temporary files, or removes the spec, and it removes only the file it wrote
    or found holding its own bytes (same inode, size and mtime): a second instance started
    beside a running one touches nothing, and a file another writer put there since is left
    alone.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lock_path = path.with_name(f".{path.name}.lock")
        self._fd: int | None = None
        self._mine: _Identity | None = None

    @property
    def held(self) -> bool:
        """Whether this process holds the spec's lock."""
        return self._fd is not None

    def claim(self) -> int:
        """Take the lock if not held yet; then remove temporary files left by earlier runs.

        Returns:
            How many stale temporary files were removed.

        Raises:
            _SpecBusyError: another holder has the lock.
            OSError: the lock file cannot be created or is not a regular file.
        """
        if self._fd is not None:
            if self._still_ours(self._fd):
                return 0
            # Someone removed or replaced the lock file: another process may take a new one,
            # so this one guards nothing any more. Take the one there now, or give way.
            fd, self._fd, self._mine = self._fd, None, None
            os.close(fd)
        self.path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        for _ in range(3):
            with contextlib.suppress(FileNotFoundError):
                before = os.lstat(self.lock_path)
                if not stat.S_ISREG(before.st_mode):  # never open a FIFO or a device
                    raise OSError(
                        errno.EINVAL,
                        f"{file_kind(before.st_mode)}, not a regular file, is in the way of the "
                        "CDI spec's lock file",
                        str(self.lock_path),
                    )
            flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
            fd = os.open(self.lock_path, flags, _FILE_MODE)
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    raise OSError(errno.EINVAL, "not a regular file", str(self.lock_path))
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    raise _SpecBusyError(
                        errno.EWOULDBLOCK,
                        f"CDI spec {self.path} is owned by another live plugin (it holds "
                        f"{self.lock_path.name}); a second instance of this plugin?",
                    ) from None
                # The previous holder unlinks the lock file as it stops: a lock on a file no
                # longer at lock_path guards nothing, so take the one there now.
                if self._still_ours(fd):
                    self._fd, fd = fd, -1
                    return self._remove_stale_temps()
            finally:
                if fd >= 0:
                    os.close(fd)
        raise _SpecBusyError(
            errno.EWOULDBLOCK, f"CDI spec {self.path}: its lock file keeps being replaced"
        )

    def _still_ours(self, fd: int) -> bool:
        """Whether the file at ``lock_path`` is the one ``fd`` has open."""
        try:
            now = os.lstat(self.lock_path)
        except FileNotFoundError:
            return False
        st = os.fstat(fd)
        return (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino)

    def _remove_stale_temps(self) -> int:
        """Temporary files of this spec left by a process killed mid-write (we hold the lock,
        so no live writer has one open), including those of earlier versions, which named them
        after the spec's stem (``.<stem>.<random>.tmp``)."""
        return _files.remove_temporaries(self.path, former=(self.path.stem,))

    def publish(self, data: bytes) -> tuple[bool, int]:
        """Own the spec path and make it hold ``data``.

        Returns:
            Whether the file was (re)written, and how many stale temporary files were removed.

        Raises:
            _SpecBusyError: another live plugin owns the path.
            OSError: the spec could not be written; the file there is unchanged.
        """
        try:
            stale = self.claim()
            held = _holds(self.path, data)
            if held is not None:
                self._mine = held  # our bytes, left by an earlier run of ours: ours now
                return False, stale
            self._mine = _replace(self.path, data)
        except OSError:
            if not self._intact():
                self._mine = None
            raise
        return True, stale

    @property
    def written(self) -> bool:
        """Whether the spec path still holds the file this process last wrote (or adopted),
        as far as the last ``publish`` saw."""
        return self._mine is not None

    def _intact(self) -> bool:
        if self._mine is None:
            return False
        try:
            return _identity(os.lstat(self.path)) == self._mine
        except OSError:
            return False

    def remove(self) -> str:
        """Remove the spec if it is still the file this process wrote.

        Returns:
            ``"removed"``, ``"gone"`` (nothing there), ``"replaced"`` (another writer's file
            is there now: left alone) or ``"not ours"`` (this process wrote none).
        """
        if self._mine is None:
            return "not ours"
        mine, self._mine = self._mine, None
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return "gone"
        if _identity(st) != mine:
            return "replaced"
        os.unlink(self.path)
        _files.fsync_directory(self.path.parent)
        return "removed"

    def release(self) -> None:
        """Give the lock back (removing the lock file while still holding it)."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        self._mine = None
        try:
            with contextlib.suppress(OSError):
                if self._still_ours(fd):
                    os.unlink(self.lock_path)
        finally:
            os.close(fd)
