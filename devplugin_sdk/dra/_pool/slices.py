"""How a pool's content is cut into ResourceSlices, and what a slice is written as.

The counter sets (partitionable devices) go first, in slices of their own, 8 sets a slice
(Kubernetes 1.35: "only one of Devices and SharedCounters can be set in a ResourceSlice"); then
the devices, 64 a slice (a cut that does not change when a device's health does). Every slice of
the pool has one generation and the pool's slice count, and is owned by the Node (so that it goes
with it); a new slice is named by the API server (``<node>-<driver>-`` and five characters), and
the stored slices, in the order of what they hold, take the chunks in order; whether a write can
keep the generation is ``same_layout``'s. A taint that a stored slice already has keeps its
``timeAdded``. What the server dropped from a write is found here too; what to do about it is
``dropped.py``'s.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from dataclasses import replace
from typing import NamedTuple

from devplugin_sdk.dra._pool.dropped import Field
from devplugin_sdk.dra.resources import (
    MAX_COUNTER_SETS_PER_SLICE,
    MAX_DEVICES_PER_SLICE_WITH_TAINTS,
    CounterSet,
    DeviceTaint,
    ResourceSlice,
    SliceDevice,
)

__all__ = [
    "Chunk",
    "dropped_fields",
    "in_order",
    "keep_time_added",
    "same_layout",
    "slice_for",
    "split",
]


class Chunk(NamedTuple):
    """What one slice holds: devices or counter sets (never both, but an empty pool's one
    slice holds neither)."""

    devices: tuple[SliceDevice, ...]
    counters: tuple[CounterSet, ...]


def split(devices: tuple[SliceDevice, ...], counters: tuple[CounterSet, ...]) -> list[Chunk]:
    """The slices' contents: counter sets first, in slices of their own, then the devices, 64 a
    slice (the API's ResourceSliceMaxDevicesWithTaintsOrConsumesCounters; one empty slice for
    an empty pool).

    64 whether or not a device has a taint now: any device may be tainted at any moment (its
    health), and a cut of 128 while none is would move every device to another slice on the
    pool's first taint and back on its last, a new generation each time, which a reader sees
    short while it is written (``same_layout``).
    """
    size = MAX_DEVICES_PER_SLICE_WITH_TAINTS
    out = [
        Chunk((), counters[i : i + MAX_COUNTER_SETS_PER_SLICE])
        for i in range(0, len(counters), MAX_COUNTER_SETS_PER_SLICE)
    ]
    out += [Chunk(devices[i : i + size], ()) for i in range(0, len(devices), size)]
    return out or [Chunk((), ())]


def in_order(current: Sequence[ResourceSlice]) -> list[ResourceSlice]:
    """The pool's stored slices in the order of the chunks they hold: counter sets first, then
    by their first device's name (the devices are cut in name order), the slice's name last.
    Not by name alone: the server names a new slice at random, so a pool written in chunk
    order is not in name order, and the next sync would move every device to another slice."""

    def key(s: ResourceSlice) -> tuple[bool, str, str]:
        first = s.shared_counters[0].name if s.shared_counters else ""
        if not first and s.devices:
            first = s.devices[0].name
        return (not s.shared_counters, first, s.name)

    return sorted(current, key=key)


def same_layout(current: Sequence[ResourceSlice], chunks: Sequence[Chunk]) -> bool:
    """Whether ``chunks`` can be written over ``current`` slice by slice, keeping the pool's
    generation: as many slices, all of one generation and complete, each holding the same
    devices (by name, in order, consuming the same counters) and the same counter sets. Only
    the devices' descriptions (attributes, capacity, taints) differ; each write then changes
    devices that stay where they are, and the pool is complete between any two writes."""
    if len(current) != len(chunks) or not current:
        return False
    generation = current[0].generation
    for stored, chunk in zip(current, chunks, strict=True):
        if (
            stored.generation != generation
            or stored.slice_count != len(chunks)
            or tuple(stored.shared_counters) != chunk.counters
            or [(d.name, d.consumes_counters) for d in stored.devices]
            != [(d.name, d.consumes_counters) for d in chunk.devices]
        ):
            return False
    return True


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
