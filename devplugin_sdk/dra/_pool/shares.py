"""How a shared or partitioned device is published: a physical device advertised as shares
(``Device.shareable``: replicas, memory units, slices) is published once, with
``allowMultipleAllocations`` and one consumable capacity whose ``requestPolicy`` takes whole
shares (KEP-5075); a partition (``Device.partition``: a MIG instance) with ``consumesCounters`` of
a counter set of its whole device, which is published too and consumes all of it (KEP-4815).
What a claim holding one gets is the claims side's (``dra/_claims/shares.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

from devplugin_sdk.dra.resources import CounterConsumption, CounterSet, RequestPolicy, SliceDevice
from devplugin_sdk.types import Device, Partition, Quantity

__all__ = ["counter_set", "partition_device", "shared_device", "whole_device"]

# A Kubernetes quantity is a signed 64-bit integer (resource.Quantity's int64 fast path).
MAX_QUANTITY = 2**63 - 1


def shared_device(name: str, shares: Sequence[Device]) -> SliceDevice:
    """The one device published for the ``shares`` of a physical device.

    Its capacity is the shares' capacity name, ``unit`` times their number; a claim takes a
    whole number of units (``validRange`` with ``step`` = unit), at most ``most`` of them (one
    unit: ``validValues``); a claim that asks none takes one unit, or all of them with
    ``whole_by_default`` (the whole device). The shares' other capacities are left out: with
    multiple allocations every capacity is consumed, by default all of it (resource/v1
    types.go, DeviceCapacity.requestPolicy), which would let one claim take the device.
    """
    first = shares[0]
    described = first.shareable
    assert described is not None
    unit = described.unit
    count = len(shares)
    if unit * count > MAX_QUANTITY:
        raise ValueError(
            f"shareable.unit {unit} times {count} shares is past the largest Kubernetes "
            f"quantity (2**63-1)"
        )
    most = count if described.most is None else min(described.most, count)
    one = Quantity(unit)
    if most == 1:
        policy = RequestPolicy(default=one, valid_values=(one,))
    else:
        top = Quantity(unit * most)
        default = top if described.whole_by_default else one
        policy = RequestPolicy(default=default, minimum=one, maximum=top, step=one)
    return SliceDevice(
        name,
        first.attributes,
        {described.capacity: Quantity(unit * count)},
        allow_multiple_allocations=True,
        request_policies={described.capacity: policy},
    )


def counter_set(name: str, partition: Partition) -> CounterSet:
    """The counter set of a whole device, named ``name``."""
    return CounterSet(name, dict(partition.counters))


def partition_device(name: str, device: Device, counters: str) -> SliceDevice:
    """A partition, consuming its share of the counter set ``counters``."""
    assert device.partition is not None
    return SliceDevice(
        name,
        device.attributes,
        device.capacity,
        consumes_counters=(CounterConsumption(counters, dict(device.partition.consumes)),),
    )


def whole_device(name: str, partition: Partition, counters: str) -> SliceDevice:
    """The whole device of a partition, consuming every counter of its set."""
    whole = partition.whole
    return SliceDevice(
        name,
        whole.attributes,
        whole.capacity,
        consumes_counters=(CounterConsumption(counters, dict(partition.counters)),),
    )
