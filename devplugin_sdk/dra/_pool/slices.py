"""How a pool's content is cut into ResourceSlices, and what a slice is written as.

The counter sets (partitionable devices) go first, in slices of their own, 8 sets a slice
(Kubernetes 1.35: "only one of Devices and SharedCounters can be set in a ResourceSlice"); then
the devices, 128 a slice, or 64 when any has a taint or consumes counters. Every slice of the
pool is written at one generation with the pool's slice count, owned by the Node (so that it goes
with it); a new slice is named by the API server (``<node>-<driver>-`` and five characters), and
the pool's stored slices, in name order, take the chunks in order. A taint that a stored slice
already has keeps its ``timeAdded``. What the server dropped from a write is found here too;
what to do about it is ``dropped.py``'s.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from dataclasses import replace
from typing import NamedTuple

from devplugin_sdk.dra._pool.dropped import Field
from devplugin_sdk.dra.resources import (
    MAX_COUNTER_SETS_PER_SLICE,
    MAX_DEVICES_PER_SLICE,
    MAX_DEVICES_PER_SLICE_WITH_TAINTS,
    CounterSet,
    DeviceTaint,
    ResourceSlice,
    SliceDevice,
)

__all__ = ["Chunk", "dropped_fields", "keep_time_added", "slice_for", "split"]


class Chunk(NamedTuple):
    """What one slice holds: devices or counter sets (never both, but an empty pool's one
    slice holds neither)."""

    devices: tuple[SliceDevice, ...]
    counters: tuple[CounterSet, ...]


def split(devices: tuple[SliceDevice, ...], counters: tuple[CounterSet, ...]) -> list[Chunk]:
    """The slices' contents: counter sets first, in slices of their own, then the devices, 64 a
    slice when any has taints or consumes counters (the API's
    ResourceSliceMaxDevicesWithTaintsOrConsumesCounters), else 128; one empty slice for an
    empty pool."""
    size = (
        MAX_DEVICES_PER_SLICE_WITH_TAINTS
        if any(d.taints or d.consumes_counters for d in devices)
        else MAX_DEVICES_PER_SLICE
    )
    out = [
        Chunk((), counters[i : i + MAX_COUNTER_SETS_PER_SLICE])
        for i in range(0, len(counters), MAX_COUNTER_SETS_PER_SLICE)
    ]
    out += [Chunk(devices[i : i + size], ()) for i in range(0, len(devices), size)]
    return out or [Chunk((), ())]


def slice_for(
    old: ResourceSlice | None,
    chunk: Chunk,
    *,
    driver: str,
    node_name: str,
    owner: str,
    generation: int,
    count: int,
) -> ResourceSlice:
    """``old`` (or a new slice, named by the server) holding ``chunk``, at ``generation`` of
    the pool of ``count`` slices; owned by the Node of UID ``owner`` unless it already has an
    owner."""
    if old is not None:
        return replace(
            old,
            pool=node_name,
            generation=generation,
            slice_count=count,
            devices=chunk.devices,
            node_uid=old.node_uid or owner,
            shared_counters=chunk.counters,
        )
    return ResourceSlice(
        name="",
        driver=driver,
        node_name=node_name,
        pool=node_name,
        generation=generation,
        slice_count=count,
        devices=chunk.devices,
        node_uid=owner,
        shared_counters=chunk.counters,
    )


def dropped_fields(chunk: Chunk, stored: ResourceSlice) -> list[Field]:
    """The fields the server stored a write of ``chunk`` without (an API server whose feature
    gate for them is off drops them silently), in the order the policy hears them."""
    devices, counters = chunk
    fields: list[Field] = []
    if any(d.taints for d in devices) and not any(d.taints for d in stored.devices):
        fields.append("taints")
    lost = any(d.consumes_counters for d in devices) and not any(
        d.consumes_counters for d in stored.devices
    )
    if lost or (counters and not stored.shared_counters):
        fields.append("counters")
    if any(d.allow_multiple_allocations for d in devices) and not any(
        d.allow_multiple_allocations for d in stored.devices
    ):
        fields.append("shares")
    return fields


def keep_time_added(
    wanted: tuple[SliceDevice, ...], current: Sequence[ResourceSlice]
) -> tuple[SliceDevice, ...]:
    """``wanted`` with each taint's ``timeAdded`` as a stored slice already has it for the same
    device, key, value and effect (a taint that stays keeps its time, across restarts too)."""
    held: dict[tuple[str, str, str, str], datetime.datetime] = {}
    for s in current:
        for d in s.devices:
            for t in d.taints:
                if t.time_added is not None:
                    held[(d.name, t.key, t.value, t.effect)] = t.time_added
    if not held:
        return wanted
    return tuple(
        replace(d, taints=tuple(_with_time(d.name, t, held) for t in d.taints)) if d.taints else d
        for d in wanted
    )


def _with_time(
    name: str, taint: DeviceTaint, held: dict[tuple[str, str, str, str], datetime.datetime]
) -> DeviceTaint:
    kept = held.get((name, taint.key, taint.value, taint.effect))
    return taint if kept is None or kept == taint.time_added else replace(taint, time_added=kept)
