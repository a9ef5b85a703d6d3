"""Prepare and unprepare serialized across the instances of one driver on a node.

During a rolling upgrade two instances (pods) of the driver run side by side, and the kubelet
may prepare a claim through one and unprepare it through the other (it calls the most recent
connected plugin, pkg/kubelet/cm/dra/plugin). As Kubernetes' kubeletplugin helper does with
``RollingUpdate``, every call then holds an exclusive ``flock`` on ``serialize.lock`` in the
driver's private directory, and starts from the state on disk: the prepared claims are read
again from the checkpoint when another process wrote it since this one last looked. Without a
pod UID there is one instance, and only the in-process lock applies.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
from collections.abc import AsyncIterator
from pathlib import Path

import anyio

from devplugin_sdk.dra._claims.checkpoint import Checkpoint, Entry

__all__ = ["LOCK_NAME", "SharedState"]

log = logging.getLogger("devplugin_sdk")

#: The lock file's name, as the kubeletplugin helper names it.
LOCK_NAME = "serialize.lock"

_Stamp = tuple[int, int, int, int]


class SharedState:
    """The prepared claims as every instance of the driver on this node sees them.

    Args:
        checkpoint: The driver's checkpoint (shared by the instances).
        lock_path: The lock file; None when this is the only instance (nothing is locked, and
            nothing is read again).
    """

    def __init__(self, checkpoint: Checkpoint, lock_path: Path | None) -> None:
        self.checkpoint = checkpoint
        self.lock_path = lock_path
        self._seen: _Stamp | None = None
        #: How many times another instance's writes were read in.
        self.reloads = 0

    @contextlib.asynccontextmanager
    async def held(self, prepared: dict[str, Entry]) -> AsyncIterator[None]:
        """Hold the lock; ``prepared`` is brought up to date with the checkpoint on entry.

        Raises:
            OSError: the lock file cannot be opened or locked (the call fails, nothing changes).
        """
        if self.lock_path is None:
            yield
            return
        # Shielded: a lock the worker thread takes after a cancellation would never be released.
        # The other instance holds it for one call at most.
        with anyio.CancelScope(shield=True):
            fd = await anyio.to_thread.run_sync(_lock, self.lock_path)
        try:
            stamp = await anyio.to_thread.run_sync(self._stamp)
            if stamp != self._seen:
                await self._reload(prepared)
            yield
        finally:
            with anyio.CancelScope(shield=True):
                self._seen = await anyio.to_thread.run_sync(self._stamp)
                os.close(fd)  # releases the flock

    async def _reload(self, prepared: dict[str, Entry]) -> None:
        loaded = await anyio.to_thread.run_sync(self.checkpoint.load)
        if loaded.problem is not None:
            # Moved aside by load(); our own view is written back by the next change.
            log.error(
                "DRA: the checkpoint %s written by another instance cannot be used: %s; "
                "keeping this instance's %d prepared claims",
                self.checkpoint.path,
                loaded.problem,
                len(prepared),
            )
            return
        if self._seen is not None:
            self.reloads += 1
        prepared.clear()
        prepared.update(loaded.entries)

    def _stamp(self) -> _Stamp | None:
        try:
            st = os.stat(self.checkpoint.path)
        except FileNotFoundError:
            return None
        # The checkpoint is replaced by a rename on every save: a new inode each time.
        return (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)


def _lock(path: Path) -> int:
    """Open ``path`` (created 0600) and wait for its exclusive flock; the descriptor."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except BaseException:
        os.close(fd)
        raise
    return fd
