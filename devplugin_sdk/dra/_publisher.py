"""Keeps a driver's ResourceSlices on one node equal to the devices it offers.

One pool per node, named after the node, as Kubernetes' resourceslice controller does: at most
128 devices per slice, every slice of the pool at the same generation, the generation bumped on
every change (consumers only trust the slices of the highest generation, and a pool whose
slice count is not complete). Slices are owned by the Node, so they go with it. Stale slices
(more than needed, or from a previous run) are updated in place or deleted; slices someone else
changes or deletes (the kubelet deletes every slice of its node when it starts) are noticed
through a watch and written again. Slices stay when the plugin stops: the kubelet removes them
30 s after the driver is gone for good, and a restarted plugin takes them over.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import replace

import anyio

from devplugin_sdk.dra.resources import (
    MAX_DEVICES_PER_SLICE,
    ResourceApi,
    ResourceSlice,
    SliceDevice,
)
from devplugin_sdk.errors import KubeApiError

__all__ = ["Publisher"]

log = logging.getLogger("devplugin_sdk")

_RETRY_FIRST = 0.5
_RETRY_MAX = 30.0
_LOG_AGAIN_AFTER = 60.0


class Publisher:
    """Publishes one driver's pool on one node.

    Args:
        api: The Kubernetes API.
        driver: The driver name.
        node_name: The node; also the pool's name.
    """

    def __init__(self, api: ResourceApi, driver: str, node_name: str) -> None:
        self.api = api
        self.driver = driver
        self.node_name = node_name
        self.generation = 0
        self.published: tuple[SliceDevice, ...] | None = None
        self.syncs = 0
        self.last_error: str | None = None
        self._wanted: tuple[SliceDevice, ...] = ()
        self._wanted_at = time.monotonic()
        self._dirty = anyio.Event()
        self._done = anyio.Event()
        self._node_uid: str | None = None
        self._logged: tuple[str, float] = ("", 0.0)

    def want(self, devices: Sequence[SliceDevice]) -> None:
        """Make ``devices`` (sorted by name) the pool's content; published soon after."""
        wanted = tuple(sorted(devices, key=lambda d: d.name))
        if wanted != self._wanted:
            self._wanted = wanted
            self._wanted_at = time.monotonic()
        self._dirty.set()

    @property
    def pending_seconds(self) -> float:
        """How long the wanted content has waited unpublished (0 when published)."""
        if self.published == self._wanted:
            return 0.0
        return time.monotonic() - self._wanted_at

    async def wait_published(self) -> None:
        """Wait until the wanted content is published (for tests and start-up)."""
        while self.published != self._wanted:
            await self._done.wait()

    async def run(self) -> None:
        """Publish until cancelled: on every ``want``, and whenever the slices change."""
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._watch)
            delay = _RETRY_FIRST
            while True:
                await self._dirty.wait()
                self._dirty = anyio.Event()
                try:
                    await self._sync()
                except KubeApiError as exc:
                    self._failed(exc, delay)
                    # A conflict only means someone wrote in between: read and try again now.
                    await anyio.sleep(0 if exc.conflict else delay)
                    delay = _RETRY_FIRST if exc.conflict else min(delay * 2, _RETRY_MAX)
                    self._dirty.set()
                else:
                    delay = _RETRY_FIRST
                    if self.last_error is not None:
                        log.info("DRA %s: publishing ResourceSlices works again", self.driver)
                        self.last_error = None

    async def _watch(self) -> None:
        delay = _RETRY_FIRST
        while True:
            try:
                async for _ in self.api.watch_slices(self.driver, self.node_name):
                    self._dirty.set()
                    delay = _RETRY_FIRST
            except KubeApiError as exc:
                log.debug("DRA %s: the ResourceSlice watch ended: %s", self.driver, exc)
            # The watch ended (a server timeout, an error): changes may have been missed.
            self._dirty.set()
            await anyio.sleep(delay)
            delay = min(delay * 2, _RETRY_MAX)

    def _failed(self, exc: KubeApiError, delay: float) -> None:
        self.last_error = str(exc)
        message, at = self._logged
        now = time.monotonic()
        level = logging.DEBUG
        if str(exc) != message or now - at >= _LOG_AGAIN_AFTER:
            level = logging.WARNING if exc.conflict else logging.ERROR
            self._logged = (str(exc), now)
        log.log(
            level,
            "DRA %s: cannot publish ResourceSlices: %s; retrying in %gs",
            self.driver,
            exc,
            0 if exc.conflict else delay,
        )

    async def _owner(self) -> str:
        if self._node_uid is None:
            try:
                self._node_uid = await self.api.node_uid(self.node_name)
            except KubeApiError as exc:
                if not exc.not_found:
                    raise
                log.warning(
                    "DRA %s: node %s not found; its ResourceSlices get no owner",
                    self.driver,
                    self.node_name,
                )
                self._node_uid = ""
        return self._node_uid

    async def _sync(self) -> None:
        wanted = self._wanted
        chunks = [
            wanted[i : i + MAX_DEVICES_PER_SLICE]
            for i in range(0, len(wanted), MAX_DEVICES_PER_SLICE)
        ] or [()]
        current = await self.api.list_slices(self.driver, self.node_name)
        self.syncs += 1
        if self._matches(current, chunks):
            self.generation = current[0].generation
            self._published(wanted)
            return
        owner = await self._owner()
        generation = max([s.generation for s in current] + [self.generation]) + 1
        count = len(chunks)
        for i, devices in enumerate(chunks):
            if i < len(current):
                await self.api.update_slice(
                    replace(
                        current[i],
                        pool=self.node_name,
                        generation=generation,
                        slice_count=count,
                        devices=devices,
                        node_uid=current[i].node_uid or owner,
                    )
                )
            else:
                await self.api.create_slice(
                    ResourceSlice(
                        name="",
                        driver=self.driver,
                        node_name=self.node_name,
                        pool=self.node_name,
                        generation=generation,
                        slice_count=count,
                        devices=devices,
                        node_uid=owner,
                    )
                )
        for stale in current[count:]:
            try:
                await self.api.delete_slice(stale.name)
            except KubeApiError as exc:
                if not exc.not_found:
                    raise
        self.generation = generation
        log.info(
            "DRA %s: published %d devices in %d ResourceSlices (pool %s, generation %d)",
            self.driver,
            len(wanted),
            count,
            self.node_name,
            generation,
            extra={"driver": self.driver},
        )
        self._published(wanted)

    def _published(self, wanted: tuple[SliceDevice, ...]) -> None:
        self.published = wanted
        self._done.set()
        self._done = anyio.Event()

    def _matches(
        self, current: Sequence[ResourceSlice], chunks: Sequence[Sequence[SliceDevice]]
    ) -> bool:
        if len(current) != len(chunks):
            return False
        generation = current[0].generation
        return all(
            s.generation == generation
            and s.slice_count == len(chunks)
            and s.pool == self.node_name
            and tuple(s.devices) == tuple(devices)
            for s, devices in zip(current, chunks, strict=True)
        )
