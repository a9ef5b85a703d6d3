"""The plugins a DRA driver serves: each one's registration strategy, its detach grace and the
bound on the first device lists.

Each served plugin runs ``Plugins.attach`` as its registration strategy (``alongside`` runs the
device-plugin strategy too, for ``api: both``). On every change of an attached plugin's device
state (the engine's one owner of devices and health) the pool is built again (``pool.py``) and
handed to the publisher and the health stream's board; ``find`` answers the claims side with the
plugin that serves a DRA device name.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Sequence

import anyio
import anyio.abc

from devplugin_sdk._engine.handle import PluginHandle, Strategy
from devplugin_sdk._engine.kubelet_watch import DirectoryWatcher
from devplugin_sdk.dra import Dra
from devplugin_sdk.dra._pool.health import HealthBoard
from devplugin_sdk.dra._pool.pool import Found, Member, build
from devplugin_sdk.dra.resources import CounterSet, SliceDevice
from devplugin_sdk.settings import Settings

__all__ = ["DETACH_GRACE", "FIRST_LIST_WAIT", "Plugins"]

log = logging.getLogger("devplugin_sdk")

#: How long the devices of a plugin that stopped stay published: a configuration reload stops a
#: changed plugin before its replacement has discovered its devices, which must not withdraw
#: (and then publish again) every device the two have in common.
DETACH_GRACE = 10.0

#: How long the pool waits for every initial plugin's first device list: past it, what the others
#: reported is published (and the driver registers) with a warning naming the missing plugins; a
#: hung discovery must not keep the driver's other devices off the node forever.
FIRST_LIST_WAIT = 30.0


#: Takes the pool's devices and counter sets (``Publisher.want``).
Want = Callable[[Sequence[SliceDevice], Sequence[CounterSet]], None]


class Plugins:
    """The plugins one DRA driver serves, by resource name.

    Args:
        options: The driver's options (which devices it gets).
        both: The device-plugin API serves the plugins too (``api: both``): its registration
            owns the plugins' links.
        expected: Resources of the initial plugins: the pool is not ``ready`` (nothing is
            published or registered) before each has discovered its devices, or
            ``FIRST_LIST_WAIT`` has passed, so a restarted driver never withdraws devices it
            still has.

    Attributes:
        ready: Set once every expected plugin is attached (its first discovery is done), or
            ``FIRST_LIST_WAIT`` after ``run`` starts.
    """

    def __init__(
        self, options: Dra, board: HealthBoard, *, both: bool, expected: Collection[str]
    ) -> None:
        self.options = options
        self.driver = options.driver
        self.board = board
        self.both = both
        self.expected = set(expected)
        self.ready = anyio.Event()
        self._attached: dict[str, PluginHandle] = {}
        self._stopped: set[str] = set()  # attached plugins that stopped (within DETACH_GRACE)
        self._registered = False
        self._found: dict[str, Found] = {}
        self._duplicates: set[str] = set()
        self._want: Want | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        # The states changed since the pool was last built; ``_changed`` wakes the batcher.
        self._stale = False
        self._changed = anyio.Event()

    async def run(self) -> None:
        """Keep the devices of stopped plugins published for ``DETACH_GRACE``, and bound the
        wait for the first device lists, until cancelled."""
        async with anyio.create_task_group() as tg:
            self._tg = tg
            tg.start_soon(self._bound_first_lists)
            tg.start_soon(self._rebuild_in_batches)
            try:
                await anyio.sleep_forever()
            finally:
                # Forgotten before the group starts to exit: a plugin stopped by the same
                # failure (a refused start) detaches at once instead of starting a task in it.
                self._tg = None

    def publish_to(self, want: Want) -> None:
        """Hand the pool (devices, counter sets) to ``want`` (the publisher's) once ready and
        on every change."""
        self._want = want
        self.refresh()

    def find(self, name: str) -> Found | None:
        """The published device of DRA name ``name``, with its plugin and health now."""
        if self._stale:
            self._rebuild()  # a change not yet built: the claims side sees it at once
        return self._found.get(name)

    def registered(self, registered: bool) -> None:
        """The driver's registration came or went: so did the plugins' (unless ``both``)."""
        self._registered = registered
        if self.both:
            return  # the device-plugin registration owns the links
        for plugin in self._attached.values():
            if registered:
                plugin.link.up(0.0, f"as DRA driver {self.driver}")
            else:
                plugin.link.down()

    # ------------------------------------------------------------------ strategies

    async def attach(
        self, plugin: PluginHandle, settings: Settings, watcher: DirectoryWatcher
    ) -> None:
        """Serve ``plugin`` through the driver until cancelled (a ``Strategy``)."""
        resource = plugin.resource
        self._attached[resource] = plugin
        self._stopped.discard(resource)
        if not self.both:
            plugin.link.without_stream()
            if self._registered:
                plugin.link.up(0.0, f"as DRA driver {self.driver}")
        unsubscribe = plugin.state.subscribe(self.refresh)
        self.refresh()
        try:
            await anyio.sleep_forever()
        finally:
            unsubscribe()
            if not self.both:
                plugin.link.down()
            if self._attached.get(resource) is plugin:
                self._detach(resource, plugin)

    def alongside(self, strategy: Strategy) -> Strategy:
        """The strategy of ``api: both``: the device-plugin ``strategy`` lists only the devices
        DRA does not get, and the driver serves the others."""

        async def both(plugin: PluginHandle, settings: Settings, watcher: DirectoryWatcher) -> None:
            resource = plugin.resource
            plugin.state.list_only(lambda device: not self.options.selects(resource, device))
            async with anyio.create_task_group() as tg:
                tg.start_soon(self.attach, plugin, settings, watcher)
                await strategy(plugin, settings, watcher)
                tg.cancel_scope.cancel()

        return both

    async def _bound_first_lists(self) -> None:
        """Make the pool ``ready`` after ``FIRST_LIST_WAIT`` if some plugin has not reported."""
        with anyio.move_on_after(FIRST_LIST_WAIT):
            await self.ready.wait()
        if self.ready.is_set():
            return
        missing = sorted(self.expected - set(self._attached))
        log.warning(
            "DRA %s: publishing without %s: not discovered %gs after start (a slow or hung "
            "discover()); their devices are added when they report them",
            self.driver,
            ", ".join(missing),
            FIRST_LIST_WAIT,
        )
        self.ready.set()
        self.refresh()

    def _detach(self, resource: str, plugin: PluginHandle) -> None:
        """Keep a stopped plugin's devices published for ``DETACH_GRACE``, unless a new plugin
        of the resource attaches first."""

        async def later() -> None:
            await anyio.sleep(DETACH_GRACE)
            if self._attached.get(resource) is plugin:
                del self._attached[resource]
                self._stopped.discard(resource)
                self.refresh()

        if self._tg is None:
            # The driver is stopping: its pool stays as published (the kubelet removes it 30 s
            # after the driver is gone for good; a restarted driver takes it over).
            del self._attached[resource]
        else:
            self._stopped.add(resource)  # its devices' health is unknown from now on
            self.refresh()
            self._tg.start_soon(later)

    # ------------------------------------------------------------------ the pool

    def refresh(self) -> None:
        """An attached plugin's state changed (or the plugins did): the pool is built again,
        once for a batch of changes (``_rebuild_in_batches``); at once while not running."""
        if not self.ready.is_set() and self.expected <= set(self._attached):
            self.ready.set()
        self._stale = True
        if self._tg is None:
            self._rebuild()
        else:
            self._changed.set()

    async def _rebuild_in_batches(self) -> None:
        """Build the pool once per batch of changes, until cancelled.

        A building costs the whole pool (every device of every plugin), so one per device event
        made a storm quadratic: 1,500 devices reported unhealthy one by one took 30 s to be
        published. The changes made while the loop was busy (every event a plugin's ``watch()``
        yields in one go) are one batch; after a build the next waits as long as it took, so
        that a steady stream of events spends at most about half the loop on building.
        """
        while True:
            await self._changed.wait()
            self._changed = anyio.Event()
            started = time.monotonic()
            self._rebuild()
            await anyio.sleep(time.monotonic() - started)

    def _rebuild(self) -> None:
        """Recompute the pool (``pool.build``) from the attached plugins' states and hand it to
        the publisher (every device, with its taints, and the counter sets) and the health
        board."""
        if not self._stale:
            return
        self._stale = False
        members = [
            Member(resource, plugin, device, resource in self._stopped)
            for resource, plugin in self._attached.items()
            for device in plugin.state.devices
            if self.options.selects(resource, device)
        ]
        pool = build(self.options, members, several=len(self._attached) > 1, said=self._duplicates)
        self._found = pool.found
        self.board.set(pool.health)
        if self.ready.is_set() and self._want is not None:
            self._want(pool.offered, pool.counter_sets)
