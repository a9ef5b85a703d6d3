"""The lock a DRA driver's instances on one node share (``serialize.lock``, an exclusive flock),
taken without ever blocking the process.

Another instance may hold the lock for as long as it likes (stuck in a call, or not ours at
all), so the wait polls a non-blocking ``flock``: it can be cancelled at any moment (SIGTERM is
honoured while it waits), it is bounded (the caller's error names the lock file and its
holder), and a wait past a few seconds is logged once. The process holds the lock while any of
its calls needs it: the first user takes it, the last releases it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import stat
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import anyio

from devplugin_sdk.errors import DevicePluginError

__all__ = ["InstanceLock", "LockError"]

log = logging.getLogger("devplugin_sdk")

#: A wait longer than this is logged (once per wait).
SAY_AFTER = 2.0
# Polling steps: prompt when the holder finishes one call, cheap while it holds on.
_FIRST_POLL = 0.002
_MAX_POLL = 0.05


class LockError(DevicePluginError):
    """The instances' lock could not be taken: the message names the file and why (what is at
    the path, or who held it for how long)."""


class InstanceLock:
    """``serialize.lock`` at ``path``, held by this process while any user needs it.

    Args:
        path: The lock file (created 0600, never followed when it is a symbolic link).
        timeout: The longest wait for another process to release it, seconds.
    """

    def __init__(self, path: Path, timeout: float) -> None:
        self.path = path
        self.timeout = timeout
        self._users = 0
        self._fd: int | None = None
        self._taking = anyio.Lock()

    @contextlib.asynccontextmanager
    async def held(self, fresh: Callable[[], Awaitable[None]]) -> AsyncIterator[None]:
        """Hold the lock for the body; ``fresh`` runs when this process has just taken it
        (before any user's body: another process may have changed what it guards).

        Raises:
            LockError: the path holds no usable lock file, or another process held the lock
                past ``timeout``.
        """
        started = time.monotonic()
        # The bound covers the whole wait: behind this process's other callers too.
        acquired = False
        with anyio.move_on_after(self.timeout):
            await self._taking.acquire()
            acquired = True
        if not acquired:
            raise self._late(_holder(self.path))
        try:
            if self._users == 0:
                fd = await self._take(started)
                try:
                    await fresh()
                except BaseException:
                    os.close(fd)
                    raise
                self._fd = fd
            self._users += 1
        finally:
            self._taking.release()
        try:
            yield
        finally:
            self._users -= 1
            if self._users == 0 and self._fd is not None:
                fd, self._fd = self._fd, None
                os.close(fd)  # releases the flock

    def _late(self, holder: str) -> LockError:
        return LockError(
            f"the instances' lock {self.path} was not free within {self.timeout:g}s: {holder}"
        )

    async def _take(self, started: float) -> int:
        fd = _open(self.path)
        try:
            await self._wait(fd, started)
        except BaseException:
            os.close(fd)
            raise
        return fd

    async def _wait(self, fd: int, started: float) -> None:
        """Poll ``fd``'s flock until it is ours, saying so once when it takes a while.

        Raises:
            LockError: ``timeout`` has passed since ``started``.
        """
        step, said, waited = _FIRST_POLL, False, 0.0
        while not _try_lock(fd):
            waited = time.monotonic() - started
            if waited >= self.timeout:
                raise self._late(_holder(self.path))
            if not said and waited >= min(SAY_AFTER, self.timeout / 2):
                said = True
                log.warning(
                    "DRA: waiting for the instances' lock %s for %.1fs: %s",
                    self.path,
                    waited,
                    _holder(self.path),
                )
            await anyio.sleep(step)
            step = min(step * 2, _MAX_POLL)
        if said:
            log.info("DRA: took the instances' lock %s after %.1fs", self.path, waited)


def _open(path: Path) -> int:
    """The lock file's descriptor (created 0600; a link is never followed)."""
    try:
        # O_NONBLOCK: a FIFO put there must not block the open; it is refused below.
        fd = os.open(
            path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK, 0o600
        )
    except OSError as exc:
        raise LockError(f"cannot use the instances' lock {path}: {_what(path, exc)}") from None
    kind = stat.S_IFMT(os.fstat(fd).st_mode)
    if kind != stat.S_IFREG:
        os.close(fd)
        raise LockError(f"cannot use the instances' lock {path}: it is not a regular file")
    return fd


def _what(path: Path, exc: OSError) -> str:
    """What is at ``path``, as the operator should hear it."""
    if os.path.islink(path):
        return f"it is a symbolic link (to {os.readlink(path)!r}), which is not followed"
    if exc.errno == errno.EISDIR or os.path.isdir(path):
        return "it is a directory"
    return exc.strerror or str(exc)


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _holder(path: Path) -> str:
    """Who holds the flock on ``path``, as far as ``/proc/locks`` shows it (a process in
    another PID namespace, another pod without hostPID, shows as pid 0 or not at all)."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return "held by another process"
    inode = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open("/proc/locks", encoding="ascii", errors="replace") as f:
            lines = f.read(1 << 20).splitlines()
    except OSError:
        lines = []
    for line in lines:
        fields = line.split()
        # "1: FLOCK  ADVISORY  WRITE 12345 08:01:1234567 0 EOF"; blocked waiters start "->".
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == inode:
            pid = fields[4]
            if pid.isdigit() and pid != "0":
                return f"held by pid {pid}{_command(pid)}"
    return "held by a process this one cannot see (another PID namespace)"


def _command(pid: str) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()[:200]
    except OSError:
        return ""
    words = raw.replace(b"\0", b" ").decode(errors="replace").strip()
    return f" ({''.join(c if c.isprintable() else '?' for c in words)})" if words else ""
