"""Files on disk, read and written one way: ``read_file`` for every file the process did not write
itself (bounded, regular files only, never blocking on a FIFO) and the durable atomic write
(``stage`` a fsynced temporary file beside the target, ``commit`` it by rename and fsync the
directory) for every file that must survive a crash: CDI specs, the DRA checkpoint, metadata
files and the fake kubelet's checkpoint. A reader sees the old file or the new one, never a part.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
import stat
from collections.abc import Iterable
from pathlib import Path

from devplugin_sdk.errors import ConfigError

__all__ = [
    "MAX_FILE_BYTES",
    "commit",
    "discard",
    "file_kind",
    "fsync_directory",
    "inside",
    "read_file",
    "remove_temporaries",
    "stage",
    "temporary_names",
    "write_atomically",
]

#: The largest configuration file read, in bytes (1 MiB): real ones take a few KiB, and parsing
#: a mebibyte of YAML already takes about a second.
MAX_FILE_BYTES = 1 << 20
#: What a temporary file's name ends with. Runtimes load only ``*.json`` and ``*.yaml`` from a CDI
#: directory (pkg/cdi/spec-dirs.go), so a half-written temporary file is never read as a spec.
_TMP_SUFFIX = ".tmp"


def read_file(path: str | os.PathLike[str], limit: int = MAX_FILE_BYTES) -> bytes:
    """The bytes of a file the SDK reads (a configuration, a checkpoint, a sysfs attribute), read
    safely.

    Symlinks are followed (a Kubernetes ConfigMap's files are symlinks), but the file itself
    must be a regular file of at most ``limit`` bytes: a FIFO, a device (``/dev/zero``), a
    directory or a bigger file is refused without being read, and opening never blocks.

    Raises:
        ConfigError: keyed by the path, saying what the file is or why it cannot be read.
    """
    name = os.fspath(path)
    try:
        # Checked before opening: opening a FIFO waits for a writer, and opening some devices
        # has effects.
        _check_regular(name, os.stat(name), limit)
        fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as exc:
        raise ConfigError(name, f"cannot read: {exc.strerror or exc}") from None
    try:
        _check_regular(name, os.fstat(fd), limit)  # it may have been swapped since the stat
        chunks: list[bytes] = []
        size = 0
        while size <= limit:  # the file may grow after the fstat: never read past the limit
            chunk = os.read(fd, min(1 << 16, limit + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError as exc:
        raise ConfigError(name, f"cannot read: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    if size > limit:
        raise ConfigError(name, f"grew larger than the {limit} bytes read of such a file")
    return b"".join(chunks)


def _check_regular(name: str, st: os.stat_result, limit: int) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(name, f"not a regular file but {file_kind(st.st_mode)}")
    if st.st_size > limit:
        raise ConfigError(
            name, f"{st.st_size} bytes is larger than the {limit} bytes read of such a file"
        )


def file_kind(mode: int) -> str:
    """What a file that is not a regular file is, in words (``a FIFO``)."""
    kinds = (
        (stat.S_ISLNK, "a symlink"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    )
    return next((what for test, what in kinds if test(mode)), "a special file")


def temporary_names(path: Path, *, former: Iterable[str] = ()) -> re.Pattern[str]:
    """The names of ``path``'s temporary files: ``.<name>.<8 random characters>.tmp``.

    Ours are hex; the class also takes ``tempfile.mkstemp``'s (lowercase letters, digits and
    ``_``), which earlier writers used. The random part has no dot, so another file's temporary
    files never match.

    Args:
        path: The file written.
        former: Names that earlier writers of ``path`` put in place of its own
            (``.<former>.<random>.tmp``), to recognise the temporary files they left.
    """
    names = "|".join(re.escape(name) for name in (path.name, *former))
    return re.compile(rf"\.(?:{names})\.[a-z0-9_]{{8}}{re.escape(_TMP_SUFFIX)}")


def stage(path: Path, data: bytes, *, mode: int = 0o644) -> Path:
    """Write ``data`` to a new temporary file beside ``path`` with ``mode`` (whatever the
    umask), fsynced, and return it: ``commit`` makes it ``path``, ``discard`` removes it.

    Raises:
        OSError: it could not be written; no temporary file is left.
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    for _ in range(100):
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}{_TMP_SUFFIX}")
        try:
            fd = os.open(tmp, flags, 0o600)
            break
        except FileExistsError:
            continue
    else:
        raise FileExistsError(errno.EEXIST, "no free temporary file name", str(path.parent))
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fchmod(f.fileno(), mode)
            os.fsync(f.fileno())
    except BaseException:
        discard(tmp)
        raise
    return tmp


def commit(staged: Path, path: Path) -> None:
    """Rename a ``stage``d file over ``path`` and fsync the directory, so the rename itself
    survives a crash. The rename replaces the directory entry, whatever it is (a symlink, a FIFO),
    never writing through it.

    Raises:
        OSError: it could not be renamed (the staged file is removed; ``path`` is unchanged) or
            the directory not fsynced.
    """
    try:
        os.replace(staged, path)
    except BaseException:
        discard(staged)
        raise
    fsync_directory(path.parent)


def discard(staged: Path) -> None:
    """Remove a ``stage``d file that will not be committed."""
    with contextlib.suppress(OSError):
        os.unlink(staged)


def write_atomically(path: Path, data: bytes, *, mode: int = 0o644) -> os.stat_result:
    """Replace ``path`` with a regular file holding ``data``, durably: ``stage`` then
    ``commit`` (one fsync for the file, one for its directory).

    Returns:
        The new file's status, taken before the rename (its device, inode, size and time).

    Raises:
        OSError: nothing changed at ``path`` and no temporary file is left.
    """
    staged = stage(path, data, mode=mode)
    try:
        written = os.stat(staged)
    except BaseException:
        discard(staged)
        raise
    commit(staged, path)
    return written


def fsync_directory(directory: Path) -> None:
    """Make a rename or an unlink in ``directory`` durable."""
    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def remove_temporaries(path: Path, *, former: Iterable[str] = ()) -> int:
    """Remove the temporary files that a killed writer of ``path`` left; how many.

    Only regular files whose names ``temporary_names(path, former=former)`` matches are
    removed: another file's temporary files, a directory or a symlink of such a name are left.
    The caller makes sure that no live writer of ``path`` has one open (it holds the lock, or it
    is the only writer). A directory that cannot be listed removes nothing.
    """
    removed = 0
    names = temporary_names(path, former=former)
    with contextlib.suppress(OSError), os.scandir(path.parent) as entries:
        for entry in entries:
            if names.fullmatch(entry.name) and entry.is_file(follow_symlinks=False):
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)
                    removed += 1
    return removed


def inside(directory: Path, *names: str) -> Path:
    """``directory`` joined with ``names``, each one path component that came from outside (a
    claim's UID, a request name): the one way such a name becomes a path.

    A name that is empty, ``.`` or ``..``, or holds a ``/`` or a NUL is refused, and so is a
    result that would not lie inside ``directory`` (compared without resolving symlinks: the
    directories this joins into are the process's own, which no one else can write).

    Raises:
        ValueError: a name that would not stay inside ``directory``.
    """
    path = directory
    for name in names:
        if name in ("", ".", "..") or "/" in name or "\0" in name:
            raise ValueError(f"{name!r} cannot name a file inside {directory}")
        path = path / name
    base = os.path.normpath(directory)
    if not os.path.normpath(path).startswith(base.rstrip(os.sep) + os.sep):
        raise ValueError(f"{os.fspath(path)!r} is not inside {directory}")
    return path
