"""Watches the kubelet's directories for the signs of a restart or a lost socket, once per process.

The kubelet deletes every file in the device-plugin directory when it starts (our socket among
them) and then creates a new kubelet.sock. Plugins ask for the inode of kubelet.sock and of their
own socket and wait for the next change; inotify makes that sub-millisecond, polling is the
safety net. The runner watches the directory its registration strategy serves in; a DRA driver
adds its own (``add``) before the watch starts. Each plugin waits on a ``view`` of it: a change
in the directories wakes every view, a plugin's own events (its streams opening and ending) only
its own, so N plugins recovering together are not each woken N times per stream.
"""

from __future__ import annotations

import logging
import weakref
from pathlib import Path

import anyio

from devplugin_sdk import fswatch

log = logging.getLogger("devplugin_sdk")

__all__ = ["DirectoryWatcher"]


class DirectoryWatcher:
    """Broadcasts "something changed in the directories" to every plugin of the process."""

    def __init__(self, directories: list[Path], poll_interval: float) -> None:
        self.directories = list(directories)
        self.poll_interval = poll_interval
        self.generation = 0
        self._changed = anyio.Event()
        self._running = False
        self._parent: DirectoryWatcher | None = None
        self._views: weakref.WeakSet[DirectoryWatcher] = weakref.WeakSet()

    def view(self) -> DirectoryWatcher:
        """A watcher of the same directories for one plugin: woken by every change in them and
        by its own ``notify``, which wakes no other view (never ``run`` it)."""
        view = DirectoryWatcher(self.directories, self.poll_interval)
        view._parent = self
        self._views.add(view)
        return view

    def add(self, *directories: Path) -> None:
        """Watch ``directories`` too.

        Raises:
            RuntimeError: the watch has started (it watches the directories it started with).
        """
        if self._parent is not None:
            self._parent.add(*directories)
            return
        if self._running:
            raise RuntimeError("DirectoryWatcher.add() after run() started")
        self.directories.extend(d for d in directories if d not in self.directories)

    async def run(self) -> None:
        """Watch until cancelled."""
        self._running = True
        async for _changed in fswatch.watch(self.directories, poll_interval=self.poll_interval):
            self.notify()

    def notify(self) -> None:
        """Wake every waiter, and every view's (also used by the lifecycle for its own events)."""
        self.generation += 1
        self._changed.set()
        self._changed = anyio.Event()
        for view in list(self._views):
            view.notify()

    async def wait(self, generation: int) -> int:
        """Wait until the generation moves past ``generation``; return the new generation."""
        while self.generation == generation:
            await self._changed.wait()
        return self.generation
