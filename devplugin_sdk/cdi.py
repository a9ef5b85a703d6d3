"""CDI (Container Device Interface) support: spec files, qualified names, and ``use_cdi``.

Owns the JSON a container runtime reads from ``/var/run/cdi`` (written atomically, owned by one
live plugin through a lock beside it, removed on shutdown only by the plugin that wrote it) and
the wrapper that lets any ``DevicePlugin`` hand out CDI names instead of raw nodes, mounts and env,
advertising a device only once its name resolves. Format, name rules and version features were
learned from the CDI spec and its Go producer (cncf-tags/container-device-interface: SPEC.md,
specs-go/version.go, api/producer/identifiers.go, validator-default.go, writer.go,
pkg/cdi/spec-dirs.go).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import json
import logging
import os
import re
import secrets
import stat
import time
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
from anyio.streams.memory import MemoryObjectSendStream

from devplugin_sdk.errors import BackendError
from devplugin_sdk.plugin import DevicePlugin
from devplugin_sdk.types import Allocation, Device, Health, HealthEvent, RescanEvent

__all__ = [
    "DEFAULT_SPEC_DIR",
    "CdiPlugin",
    "CdiSpec",
    "cdi_name",
    "remove_spec",
    "spec_file_name",
    "use_cdi",
    "validate_device_name",
    "validate_kind",
    "write_spec",
]

log = logging.getLogger("devplugin_sdk")

#: Where generated (as opposed to installed) specs go; runtimes also read /etc/cdi.
DEFAULT_SPEC_DIR = Path("/var/run/cdi")

# Runtimes load only *.json and *.yaml files from a spec directory (pkg/cdi/spec-dirs.go), so a
# temporary file with another suffix is never read half-written.
_SPEC_SUFFIXES = (".json", ".yaml")
_TMP_SUFFIX = ".tmp"
_FILE_MODE = 0o644
# A failed spec write is retried after 0.25 s, then twice as long each time, up to every 10 s:
# a small file, cheap to try, and the devices it covers wait for it.
_RETRY_FIRST = 0.25
_RETRY_MAX = 10.0
# The same failure is logged again after this many seconds (a new reason at once).
_LOG_AGAIN_AFTER = 60.0


# --------------------------------------------------------------------------------- names


def _is_alnum(c: str) -> bool:
    return c.isascii() and c.isalnum()


def _check_vendor_or_class(what: str, name: str, kind: str) -> None:
    # Vendor and class: start with a letter, end with a letter or digit, and in between
    # letters, digits, '_', '-' and '.' (api/producer/identifiers.go).
    if not name:
        raise ValueError(f"CDI kind {kind!r}: the {what} is empty")
    if not (name[0].isascii() and name[0].isalpha()):
        raise ValueError(f"CDI kind {kind!r}: the {what} {name!r} must start with a letter")
    if not _is_alnum(name[-1]):
        raise ValueError(f"CDI kind {kind!r}: the {what} {name!r} must end with a letter or digit")
    bad = sorted({c for c in name if not (_is_alnum(c) or c in "_-.")})
    if bad:
        raise ValueError(
            f"CDI kind {kind!r}: the {what} {name!r} may only contain letters, digits, "
            f"'_', '-' and '.', not {''.join(bad)!r}"
        )


def validate_kind(kind: str) -> tuple[str, str]:
    """Check a CDI kind (``vendor.com/class``) with the CDI rules.

    Returns:
        The vendor and the class.

    Raises:
        ValueError: naming the rule that is broken.
    """
    vendor, slash, klass = kind.partition("/")
    if not slash or not vendor or not klass:
        raise ValueError(f"CDI kind {kind!r} must look like 'vendor.com/class'")
    _check_vendor_or_class("vendor", vendor, kind)
    _check_vendor_or_class("class", klass, kind)
    return vendor, klass


def validate_device_name(name: str) -> None:
    """Check a CDI device name: letters, digits, ``_ - . :``, starting and ending alphanumeric.

    Raises:
        ValueError: naming the rule that is broken.
    """
    # Device names may start with a digit since CDI 0.5.0 (specs-go/version.go, requiresV050).
    if not name:
        raise ValueError("CDI device name must not be empty")
    if not (_is_alnum(name[0]) and _is_alnum(name[-1])):
        raise ValueError(f"CDI device name {name!r} must start and end with a letter or digit")
    bad = sorted({c for c in name if not (_is_alnum(c) or c in "_-.:")})
    if bad:
        raise ValueError(
            f"CDI device name {name!r} may only contain letters, digits, '_', '-', '.' and ':', "
            f"not {''.join(bad)!r}"
        )


def cdi_name(kind: str, device: str) -> str:
    """The fully qualified CDI name ``vendor.com/class=device`` that Allocate returns.

    Raises:
        ValueError: if the kind or the device name breaks the CDI rules.
    """
    validate_kind(kind)
    validate_device_name(device)
    return f"{kind}={device}"


def spec_file_name(kind: str) -> str:
    """The default spec file name for ``kind``: ``<vendor>-<class>.json``, as the CDI producer
    names them (api/producer/spec-names.go).

    Raises:
        ValueError: if the kind breaks the CDI rules.
    """
    vendor, klass = validate_kind(kind)
    return f"{vendor}-{klass}.json"


# --------------------------------------------------------------------------------- the spec


def _check_edits(where: str, edits: Allocation) -> None:
    if edits.annotations or edits.cdi_devices:
        raise ValueError(
            f"{where}: CDI container edits carry device nodes, mounts and env only; "
            "annotations and CDI names belong in the Allocate response"
        )
    for key in edits.env:
        # The runtime splits "K=V" at the first '=' (pkg/cdi/container-edits.go, ValidateEnv).
        if not key or "=" in key or "\0" in key:
            raise ValueError(f"{where}: invalid environment variable name {key!r}")
        if "\0" in edits.env[key]:
            raise ValueError(f"{where}: environment variable {key} contains a NUL byte")


def _edits_empty(edits: Allocation) -> bool:
    return not (edits.device_nodes or edits.mounts or edits.env)


def _edits_json(edits: Allocation, *, env: bool = True) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if env and edits.env:
        out["env"] = [f"{k}={v}" for k, v in edits.env.items()]
    if edits.device_nodes:
        nodes = []
        for node in edits.device_nodes:
            entry: dict[str, Any] = {"path": node.container_path}
            if node.host_path != node.container_path:
                entry["hostPath"] = node.host_path  # a CDI 0.5.0 field; "path" when absent
            # An empty permissions string would mean "rwm" to the runtime; always be explicit.
            entry["permissions"] = node.permissions
            nodes.append(entry)
        out["deviceNodes"] = nodes
    if edits.mounts:
        # Bind mounts need "bind" or "rbind" in the OCI options; rbind is what CRI mounts use.
        out["mounts"] = [
            {
                "hostPath": m.host_path,
                "containerPath": m.container_path,
                "options": ["rbind", "ro"] if m.read_only else ["rbind"],
            }
            for m in edits.mounts
        ]
    return out


@dataclass(frozen=True)
class CdiSpec:
    """One CDI spec: a kind and the container edits of each of its devices.

    Each device's edits are an ``Allocation`` holding device nodes, mounts and env (the runtime
    applies them when a container asks for that device by its CDI name). ``common`` edits are
    applied once whenever any device of the spec is used.

    ``cdi_version`` is the oldest CDI version that has every feature the spec uses, so that older
    runtimes (containerd 1.7 ships an older CDI library) accept it: 0.3.0 by default; 0.5.0 when a
    device node's host path differs from its container path (``hostPath``) or a device name
    starts with a digit; 0.6.0 when the class contains a dot (specs-go/version.go).

    Args:
        kind: ``vendor.com/class``.
        devices: Container edits by CDI device name, in the order to write them.
        common: Edits applied whenever any device of this spec is requested.

    Raises:
        ValueError: a bad kind or device name, a device with no edits (CDI rejects those), or
            edits with annotations or CDI names.
    """

    kind: str
    devices: Mapping[str, Allocation] = field(default_factory=dict)
    common: Allocation = field(default_factory=Allocation)

    def __post_init__(self) -> None:
        validate_kind(self.kind)
        for name, edits in self.devices.items():
            validate_device_name(name)
            if not isinstance(edits, Allocation):
                raise TypeError(f"CDI device {name!r}: edits must be an Allocation")
            if _edits_empty(edits):
                # The CDI validator rejects a device without edits ("empty container edits").
                raise ValueError(f"CDI device {name!r} has no device nodes, mounts or env")
            _check_edits(f"CDI device {name!r}", edits)
        _check_edits("CDI common edits", self.common)
        object.__setattr__(self, "devices", dict(self.devices))

    @classmethod
    def from_devices(
        cls,
        kind: str,
        devices: Iterable[Device],
        *,
        env: bool = True,
        common: Allocation | None = None,
    ) -> CdiSpec:
        """Build a spec from SDK devices: each device's nodes, mounts and env become its edits.

        The CDI device name is the device ID. Devices that declare no nodes, mounts or env (with
        ``env=False``: no nodes or mounts) are left out, as CDI forbids empty devices.

        Args:
            kind: ``vendor.com/class``.
            devices: The devices, e.g. what ``discover()`` returned.
            env: Put each device's env in the spec; False leaves env out of the spec.
            common: Edits applied whenever any device of the spec is requested.

        Raises:
            ValueError: a bad kind, or a device ID that is not a valid CDI device name.
        """
        edits: dict[str, Allocation] = {}
        for device in devices:
            one = Allocation(
                device_nodes=device.device_nodes,
                mounts=device.mounts,
                env=dict(device.env) if env else {},
            )
            if not _edits_empty(one):
                try:
                    validate_device_name(device.id)
                except ValueError as exc:
                    raise ValueError(
                        f"device {device.id!r} cannot be a CDI device: {exc}"
                    ) from None
                edits[device.id] = one
        return cls(kind, edits, common or Allocation())

    @property
    def cdi_version(self) -> str:
        """The oldest CDI version that supports everything this spec uses."""
        _, klass = validate_kind(self.kind)
        if "." in klass:
            return "0.6.0"
        edits = [*self.devices.values(), self.common]
        if any(not name[0].isalpha() for name in self.devices) or any(
            n.host_path != n.container_path for e in edits for n in e.device_nodes
        ):
            return "0.5.0"
        return "0.3.0"

    def qualified(self, name: str) -> str:
        """The fully qualified CDI name of device ``name``.

        Raises:
            KeyError: the spec has no such device.
        """
        if name not in self.devices:
            raise KeyError(f"CDI spec {self.kind} has no device {name!r}")
        return f"{self.kind}={name}"

    def to_dict(self) -> dict[str, Any]:
        """The spec as the JSON object runtimes read."""
        out: dict[str, Any] = {
            "cdiVersion": self.cdi_version,
            "kind": self.kind,
            "devices": [
                {"name": name, "containerEdits": _edits_json(edits)}
                for name, edits in self.devices.items()
            ],
        }
        common = _edits_json(self.common)
        if common:
            out["containerEdits"] = common
        return out

    def to_json(self) -> bytes:
        """The spec file's bytes (UTF-8 JSON, indented, newline-terminated)."""
        return (json.dumps(self.to_dict(), indent=2) + "\n").encode()


# --------------------------------------------------------------------------------- files

#: What a spec path's identity is: device, inode, size and modification time. A file replaced by
#: another writer (a rename: new inode) or rewritten in place (new size or mtime) is not ours.
_Identity = tuple[int, int, int, int]


def _identity(st: os.stat_result) -> _Identity:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _what(mode: int) -> str:
    """A file type in words, for messages about what sits at a spec path."""
    kinds = (
        (stat.S_ISLNK, "a symlink"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISDIR, "a directory"),
    )
    return next((name for test, name in kinds if test(mode)), "not a regular file")


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


def _temp_names(path: Path) -> re.Pattern[str]:
    """Names of ``path``'s temporary files: ``.<stem>.<8 random characters>.tmp`` (ours are
    hex; earlier versions used ``tempfile.mkstemp``'s lowercase, digits and ``_``). The random
    part has no dot, so another spec's temporary files never match."""
    return re.compile(rf"\.{re.escape(path.stem)}\.[a-z0-9_]{{8}}{re.escape(_TMP_SUFFIX)}")


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
            _what(before.st_mode),
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


def _fsync_dir(directory: Path) -> None:
    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(dir_fd)  # make a rename or unlink in it durable
    finally:
        os.close(dir_fd)


def _create_temp(path: Path) -> tuple[int, Path]:
    """A new, empty, private temporary file beside ``path``."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    for _ in range(100):
        tmp = path.with_name(f".{path.stem}.{secrets.token_hex(4)}{_TMP_SUFFIX}")
        try:
            return os.open(tmp, flags, 0o600), tmp
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no free temporary file name", str(path.parent))


def _replace(path: Path, data: bytes) -> _Identity:
    """Atomically replace whatever is at ``path`` with a regular file holding ``data``.

    Returns:
        The new file's identity.

    Raises:
        OSError: nothing changed at ``path`` and no temporary file is left.
    """
    path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    fd, tmp = _create_temp(path)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fchmod(f.fileno(), _FILE_MODE)
            os.fsync(f.fileno())
            written = _identity(os.fstat(f.fileno()))
        # rename replaces the directory entry itself, whatever it is (a symlink, a FIFO, a
        # device), never writing through it; atomic within one filesystem: a runtime reading
        # the directory sees the old spec or the new one, never a partial file.
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)
    return written


def _write_if_changed(data: bytes, path: Path) -> bool:
    """Atomically replace ``path`` with ``data`` unless it already holds exactly that."""
    if _holds(path, data) is not None:
        return False
    _replace(path, data)
    return True


def write_spec(spec: CdiSpec, directory: Path = DEFAULT_SPEC_DIR, name: str | None = None) -> Path:
    """Write ``spec`` atomically into ``directory``; blocking (use a thread from async code).

    The bytes go to a temporary ``.<stem>.*.tmp`` file in the same directory (runtimes only
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
                        f"{_what(before.st_mode)}, not a regular file, is in the way of the "
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
        so no live writer has one open)."""
        names = _temp_names(self.path)
        removed = 0
        with os.scandir(self.path.parent) as entries:
            for entry in entries:
                if names.fullmatch(entry.name) and entry.is_file(follow_symlinks=False):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(entry.path)
                        removed += 1
        return removed

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
        _fsync_dir(self.path.parent)
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


# --------------------------------------------------------------------------------- the wrapper


class _Retry:
    """Backoff for a spec write that failed: what waits, when to try again, what to log."""

    def __init__(self) -> None:
        self.pending: CdiSpec | None = None
        self.attempts = 0  # failed attempts at the pending write
        self._since = 0.0
        self._delay = _RETRY_FIRST
        self._reason = ""
        self._logged = 0.0
        self._wake: anyio.Event | None = None

    def failed(self, spec: CdiSpec, reason: str) -> bool:
        """Record a failed write of ``spec``; whether to log it (a new reason, or a while
        since the last log)."""
        now = time.monotonic()
        if self.pending is None:
            self.attempts, self._since, self._delay, self._reason = 0, now, _RETRY_FIRST, ""
        self.pending = spec
        self.attempts += 1
        if self._wake is not None:
            self._wake.set()
        if reason != self._reason or now - self._logged >= _LOG_AGAIN_AFTER:
            self._reason, self._logged = reason, now
            return True
        return False

    def succeeded(self) -> tuple[int, float] | None:
        """Clear the pending write; the failed attempts and the seconds they took, if any."""
        if self.pending is None:
            return None
        self.pending = None
        return self.attempts, time.monotonic() - self._since

    def cancel(self) -> None:
        """Nothing to write any more (no device has edits, or serving stops)."""
        self.pending = None

    async def next_delay(self) -> float:
        """Wait until a write is pending; then the delay before the next attempt."""
        while self.pending is None:
            self._wake = anyio.Event()
            await self._wake.wait()
        delay = self._delay
        self._delay = min(delay * 2, _RETRY_MAX)
        return delay


class CdiPlugin(DevicePlugin):
    """Serve another plugin through CDI: its devices' nodes, mounts and env go into a spec file,
    and Allocate answers with CDI names. Create it with ``use_cdi``.

    * ``discover()`` calls the wrapped plugin's and writes the spec before returning, so every
      device the kubelet can hand out already resolves (rewritten only when it changed, removed
      when no device has edits);
    * a spec that cannot be written (a full disk, another live instance owning the file) does
      not fail discovery: the devices it would name are held back, the write is retried with
      backoff, and a rescan advertises them once it succeeds. The kubelet is never told of a
      device whose CDI name does not resolve to its edits;
    * ``allocate()`` calls the wrapped plugin's and returns the allocated devices' CDI names, its
      annotations and whatever its allocation adds beyond the devices' declared nodes, mounts and
      env (an allocation-wide variable such as a joined device list);
    * health, preferred allocation and pre-start hooks are the wrapped plugin's; the kubelet
      options follow what it overrides. ``watch()`` is the wrapped plugin's events plus the
      rescan that follows a retried write;
    * one live plugin owns a spec file (a lock beside it); it removes temporary files that a
      killed writer left, and when serving stops it removes the spec (``remove_on_exit``) only
      if the file there is still the one it wrote.

    Attributes:
        plugin: The wrapped plugin.
        kind: The CDI kind.
        spec_path: Where the spec is written.
        spec_env: Whether devices' env goes in the spec (else through Allocate).
    """

    def __init__(
        self,
        plugin: DevicePlugin,
        kind: str | None = None,
        *,
        directory: Path = DEFAULT_SPEC_DIR,
        spec_name: str | None = None,
        spec_env: bool | None = None,
        remove_on_exit: bool = True,
    ) -> None:
        """See ``use_cdi``."""
        if isinstance(plugin, CdiPlugin):
            raise TypeError(f"{plugin.resource_name}: the plugin already uses CDI")
        super().__init__(resource_name=plugin.resource_name, socket_name=plugin.socket_name)
        self.plugin = plugin
        self.health_interval = plugin.health_interval
        self.kind = kind if kind is not None else plugin.resource_name
        self.spec_path = _target(CdiSpec(self.kind), Path(directory), spec_name)
        # A plugin with its own allocate() may compute env over the whole allocation (a joined
        # device list), which per-device edits cannot express: its env then goes via Allocate.
        self.spec_env = not plugin.overrides("allocate") if spec_env is None else spec_env
        self.remove_on_exit = remove_on_exit
        self._file = _SpecFile(self.spec_path)
        self._written: CdiSpec | None = None  # what the spec file holds, as this process wrote it
        self._names: dict[str, str] = {}
        self._warned: set[str] = set()
        self._lock = anyio.Lock()
        self._retry = _Retry()
        self._extra = {"resource": self.resource_name}

    def overrides(self, hook: str) -> bool:
        """The wrapped plugin's hooks decide the kubelet options and what runs; ``watch`` always
        runs (it retries failed spec writes)."""
        return hook == "watch" or self.plugin.overrides(hook)

    @property
    def allocate_is_merge(self) -> bool:
        """False: ``allocate`` answers CDI names, whatever the wrapped plugin's is."""
        return False

    def fingerprint(self) -> str:
        """The wrapped plugin's fingerprint and the CDI settings: a configuration reload
        restarts the resource only when one of them changed."""
        cdi = f"{self.kind}|{self.spec_path}|{self.spec_env}|{self.remove_on_exit}"
        return f"cdi({cdi})|{self.plugin.fingerprint()}"

    @property
    def names(self) -> Mapping[str, str]:
        """CDI name by device ID for the devices in the spec file this plugin wrote."""
        return dict(self._names)

    async def discover(self) -> Sequence[Device]:
        """Discover through the wrapped plugin, then publish the spec.

        Returns:
            The wrapped plugin's devices, less those whose edits are not in the spec file yet
            (its write failed: they are advertised after a retry succeeds).

        Raises:
            BackendError: a device ID is not a valid CDI name.
        """
        devices = await self.plugin.discover()
        try:
            spec = CdiSpec.from_devices(self.kind, devices, env=self.spec_env)
        except ValueError as exc:
            raise BackendError(f"{self.resource_name}: {exc}") from None
        async with self._lock:
            if spec.devices:
                await self._publish(spec)
            else:
                await self._withdraw()
            return self._resolvable(devices, spec)

    def _resolvable(self, devices: Sequence[Device], spec: CdiSpec) -> list[Device]:
        """The devices the kubelet may see: no CDI edits, or their edits are in the file."""
        written = self._written.devices if self._written is not None else {}
        shown = [d for d in devices if spec.devices.get(d.id) in (None, written.get(d.id))]
        if len(shown) < len(devices):
            log.warning(
                "%s: devices held back until the CDI spec %s is written: %d of %d",
                self.resource_name,
                self.spec_path,
                len(devices) - len(shown),
                len(devices),
                extra=self._extra,
            )
        return shown

    async def _publish(self, spec: CdiSpec) -> bool:
        """Write ``spec`` (holding ``_lock``); on failure schedule a retry. Whether it worked."""
        try:
            changed, stale = await anyio.to_thread.run_sync(self._file.publish, spec.to_json())
        except OSError as exc:
            self._failed(spec, exc)
            return False
        if stale:
            log.info(
                "%s: removed %d temporary files an interrupted write left beside %s",
                self.resource_name,
                stale,
                self.spec_path,
                extra=self._extra,
            )
        self._written = spec
        self._names = {name: spec.qualified(name) for name in spec.devices}
        recovered = self._retry.succeeded()
        if recovered is not None:
            attempts, seconds = recovered
            log.info(
                "%s: CDI spec %s written after %d failed attempts over %.1fs (%d devices)",
                self.resource_name,
                self.spec_path,
                attempts,
                seconds,
                len(spec.devices),
                extra=self._extra,
            )
        elif changed:
            log.info(
                "%s: CDI spec %s written (%d devices)",
                self.resource_name,
                self.spec_path,
                len(spec.devices),
                extra=self._extra,
            )
        return True

    def _failed(self, spec: CdiSpec, exc: OSError) -> None:
        if not self._file.written:
            # Not the file this process wrote any more (another writer's, or gone): its
            # names may not resolve, so no device with edits is advertised until a write.
            self._written = None
            self._names = {}
        written = self._written.devices if self._written is not None else {}
        waiting = sum(1 for name, edits in spec.devices.items() if written.get(name) != edits)
        # The temporary file's name changes with every attempt: keep it out of the message.
        reason = exc.strerror or str(exc)
        level = logging.ERROR if self._retry.failed(spec, reason) else logging.DEBUG
        log.log(
            level,
            "%s: cannot write CDI spec %s: %s (devices waiting for it: %d; attempt %d); retrying",
            self.resource_name,
            self.spec_path,
            reason,
            waiting,
            self._retry.attempts,
            extra=self._extra,
        )

    async def _withdraw(self) -> None:
        """No device has edits: remove the spec this process wrote (CDI forbids empty specs)."""
        self._retry.cancel()
        self._written = None
        self._names = {}
        try:
            outcome = await anyio.to_thread.run_sync(self._file.remove)
        except OSError as exc:
            log.warning(
                "%s: cannot remove CDI spec %s: %s",
                self.resource_name,
                self.spec_path,
                exc,
                extra=self._extra,
            )
            return
        if outcome == "removed":
            log.info(
                "%s: CDI spec %s removed (no device has container edits)",
                self.resource_name,
                self.spec_path,
                extra=self._extra,
            )

    async def check_health(self, devices: Sequence[Device]) -> Mapping[str, Health]:
        return await self.plugin.check_health(devices)

    async def watch(self) -> AsyncIterator[HealthEvent | RescanEvent]:
        """The wrapped plugin's events, and a rescan after a failed spec write succeeds."""
        send, receive = anyio.create_memory_object_stream[HealthEvent | RescanEvent | Exception]()
        # anyio forbids holding a task group across a yield in an async generator (the SDK
        # closes it inside a shielded scope of its own), so the two sources run in one task of
        # their own, created and awaited by this generator (the SDK runs on asyncio: grpc.aio).
        sources = asyncio.ensure_future(self._sources(send))
        error: BaseException | None = None
        try:
            async with receive:
                async for item in receive:
                    if isinstance(item, Exception):
                        raise item  # the wrapped watch() failed: the SDK restarts this one
                    yield item
        finally:
            sources.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.wait({sources})
            if not sources.cancelled():
                error = sources.exception()
        if error is not None:  # the stream only ends when the sources themselves failed
            raise error

    async def _sources(
        self, send: MemoryObjectSendStream[HealthEvent | RescanEvent | Exception]
    ) -> None:
        async with send, anyio.create_task_group() as tg:
            tg.start_soon(self._retry_writes, send.clone())
            if self.plugin.overrides("watch"):
                tg.start_soon(self._forward, send.clone())

    async def _forward(
        self, send: MemoryObjectSendStream[HealthEvent | RescanEvent | Exception]
    ) -> None:
        """The wrapped plugin's events, then its error if it fails."""
        async with send:
            try:
                events = self.plugin.watch()
                try:
                    async for event in events:
                        await send.send(event)
                finally:
                    aclose = getattr(events, "aclose", None)
                    if aclose is not None:
                        with anyio.CancelScope(shield=True):
                            await aclose()
            except anyio.BrokenResourceError:
                pass
            except Exception as exc:  # reported through watch(), where the SDK logs it
                with contextlib.suppress(anyio.BrokenResourceError):
                    await send.send(exc)

    async def _retry_writes(
        self, send: MemoryObjectSendStream[HealthEvent | RescanEvent | Exception]
    ) -> None:
        """Retry a failed spec write with backoff; ask for a rescan once it is written."""
        async with send:
            while True:
                delay = await self._retry.next_delay()
                await anyio.sleep(delay)
                async with self._lock:
                    spec = self._retry.pending
                    done = spec is not None and await self._publish(spec)
                if done:
                    reason = f"CDI spec {self.spec_path} written: advertising its devices"
                    with contextlib.suppress(anyio.BrokenResourceError):
                        await send.send(RescanEvent(reason))

    async def on_stop(self) -> None:
        """Remove the spec if still ours (``remove_on_exit``), release it, then let the
        wrapped plugin clean up."""
        try:
            async with self._lock:
                self._retry.cancel()
                outcome = await anyio.to_thread.run_sync(self._stop_blocking)
            if outcome == "removed":
                log.info(
                    "%s: CDI spec %s removed", self.resource_name, self.spec_path, extra=self._extra
                )
            elif outcome == "replaced":
                log.info(
                    "%s: CDI spec %s was replaced by another writer; left in place",
                    self.resource_name,
                    self.spec_path,
                    extra=self._extra,
                )
        finally:
            await self.plugin.on_stop()

    def _stop_blocking(self) -> str:
        try:
            return self._file.remove() if self.remove_on_exit else "kept"
        except OSError as exc:
            log.warning(
                "%s: cannot remove CDI spec %s: %s",
                self.resource_name,
                self.spec_path,
                exc,
                extra=self._extra,
            )
            return "failed"
        finally:
            self._file.release()

    async def allocate(self, devices: Sequence[Device]) -> Allocation:
        """CDI names for the devices, plus what the wrapped allocation adds beyond the spec.

        Raises:
            AllocationError: from the wrapped plugin.
        """
        inner = await self.plugin.allocate(devices)
        named = [d for d in devices if d.id in self._names]
        nodes = {n.container_path for d in named for n in d.device_nodes}
        mounts = {m.container_path for d in named for m in d.mounts}
        declared: dict[str, str] = {}
        if self.spec_env:
            for d in named:
                declared.update(d.env)
        env: dict[str, str] = {}
        for key, value in inner.env.items():
            if key not in declared:
                env[key] = value
            elif declared[key] != value and key not in self._warned:
                self._warned.add(key)
                log.warning(
                    "%s: allocate() sets %s to a value that differs from the devices' env in the "
                    "CDI spec; the spec's value is used. Use use_cdi(..., spec_env=False) for "
                    "variables computed over the whole allocation",
                    self.resource_name,
                    key,
                    extra={"resource": self.resource_name},
                )
        cdi = [self._names[d.id] for d in named]
        return Allocation(
            device_nodes=tuple(n for n in inner.device_nodes if n.container_path not in nodes),
            mounts=tuple(m for m in inner.mounts if m.container_path not in mounts),
            env=env,
            annotations=dict(inner.annotations),
            cdi_devices=tuple(dict.fromkeys([*cdi, *inner.cdi_devices])),
        )

    async def preferred_allocation(
        self, available: Sequence[Device], must_include: Sequence[Device], size: int
    ) -> Sequence[str]:
        return await self.plugin.preferred_allocation(available, must_include, size)

    async def pre_start_container(self, devices: Sequence[Device]) -> None:
        await self.plugin.pre_start_container(devices)


def use_cdi(
    plugin: DevicePlugin,
    kind: str | None = None,
    *,
    directory: Path = DEFAULT_SPEC_DIR,
    spec_name: str | None = None,
    spec_env: bool | None = None,
    remove_on_exit: bool = True,
) -> CdiPlugin:
    """Serve ``plugin`` through CDI (see ``CdiPlugin``)::

        plugins = [use_cdi(p) for p in generic.from_config(config)]
        devplugin_sdk.run(*plugins)

    Args:
        plugin: Any plugin, e.g. one a backend's ``from_config`` returned.
        kind: The CDI kind ``vendor.com/class``; the resource name by default.
        directory: The CDI spec directory the container runtime reads.
        spec_name: The spec file name; ``<vendor>-<class>.json`` by default. Give each plugin
            its own kind or file name: one file is one spec.
        spec_env: True puts each device's env in the spec; False leaves env out of the spec
            and returns the plugin's allocation env from Allocate instead, which is right when
            ``allocate()`` computes variables over all the allocated devices (the nvidia and
            rdma backends do). None (the default): False when the plugin overrides
            ``allocate()``, True otherwise.
        remove_on_exit: Remove the spec when serving stops. Running containers are not affected
            (the runtime resolves CDI names when it creates a container), but a container that
            restarts while no plugin serves cannot resolve its names until the spec is back.

    Returns:
        The wrapping plugin, to serve in place of ``plugin``.

    Raises:
        ValueError: a bad kind or file name.
        TypeError: ``plugin`` is already a ``CdiPlugin``.
    """
    return CdiPlugin(
        plugin,
        kind,
        directory=directory,
        spec_name=spec_name,
        spec_env=spec_env,
        remove_on_exit=remove_on_exit,
    )
