"""MemoryApi's allocator: what the scheduler would allocate to a claim from a published pool.

It plays kube-scheduler's DRA allocator (k8s.io/dynamic-resource-allocation structured) for the
devices a test names: exclusive devices, shares of devices that allow multiple allocations with
their capacities rounded by their request policies, counters, admin access. Apart from
``MemoryApi`` because it is a policy of its own, not the API server's storage.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace

from devplugin_sdk.dra.resources import (
    AllocatedDevice,
    DeviceConfig,
    ResourceClaim,
    ResourceSlice,
    SliceDevice,
)
from devplugin_sdk.errors import KubeApiError
from devplugin_sdk.types import Quantity

__all__ = ["allocate", "ordered_config"]


def allocate(
    claim: tuple[str, str],
    devices: Mapping[str, Sequence[str]],
    *,
    driver: str,
    pool: str,
    slices: Sequence[ResourceSlice],
    claims: Iterable[ResourceClaim],
    capacity: Mapping[str, Mapping[str, Quantity]],
    admin_access: bool,
    check: bool,
) -> tuple[AllocatedDevice, ...]:
    """The results of allocating ``devices`` (names by request) to ``claim`` (namespace, name)
    from ``driver``'s ``pool``, whose highest generation is ``slices``, beside the allocations
    of ``claims``; ``MemoryApi.allocate`` documents the other arguments.

    Raises:
        KubeApiError: a device is not in the pool; with ``check``, what the scheduler refuses.
    """
    published = {d.name: d for s in slices for d in s.devices}
    counter_sets = {c.name: c.counters for s in slices for c in s.shared_counters}
    owners: dict[tuple[str, str], str] = {}
    others: list[AllocatedDevice] = []
    for c in claims:
        for r in c.results:
            owners[(r.device, r.share_id)] = f"{c.namespace}/{c.name}"
            if (c.namespace, c.name) != claim and (r.driver, r.pool) == (driver, pool):
                others += [] if r.admin_access else [r]
    results: list[AllocatedDevice] = []
    for request, names in devices.items():
        asked = capacity.get(request, {})
        for device_name in names:
            device = published.get(device_name)
            if device is None:
                raise KubeApiError(422, f"device {device_name} is not published in pool {pool}")
            result = AllocatedDevice(request, driver, pool, device_name, admin_access=admin_access)
            if device.allow_multiple_allocations and not admin_access:
                consumed = _consumed(device, asked)
                result = replace(result, share_id=str(uuid.uuid4()), consumed=consumed or {})
                if check and consumed is None:
                    raise KubeApiError(
                        422,
                        f"device {device_name}: request {request} asks "
                        f"{_shown(asked)}, which its request policy does not allow",
                    )
            if check and not admin_access:
                _check_free(
                    device,
                    result,
                    others=[*others, *results],
                    owners=owners,
                    counter_sets=counter_sets,
                    published=published,
                )
            results.append(result)
    return tuple(results)


def ordered_config(config: Sequence[DeviceConfig]) -> tuple[DeviceConfig, ...]:
    """The entries as the scheduler records them: every class's before the claim's
    (k8s.io/dynamic-resource-allocation structured allocator: ``FromClass`` entries are
    appended per request first, then the claim's ``spec.devices.config``)."""
    return tuple(sorted(config, key=lambda c: 0 if c.source == "FromClass" else 1))


def _consumed(device: SliceDevice, asked: Mapping[str, Quantity]) -> dict[str, Quantity] | None:
    """What a share of ``device`` consumes of every capacity for a request of ``asked``;
    None when a request policy refuses it or it names a capacity the device lacks."""
    if any(key not in device.capacity for key in asked):
        return None
    out: dict[str, Quantity] = {}
    for key, value in device.capacity.items():
        policy = device.request_policies.get(key)
        if policy is None:
            amount: Quantity | None = asked.get(key, value)
            if amount is not None and amount.value > value.value:
                amount = None
        else:
            amount = policy.consumed(asked.get(key), value)
        if amount is None:
            return None
        out[key] = amount
    return out


def _check_free(
    device: SliceDevice,
    result: AllocatedDevice,
    *,
    others: Sequence[AllocatedDevice],
    owners: Mapping[tuple[str, str], str],
    counter_sets: Mapping[str, Mapping[str, Quantity]],
    published: Mapping[str, SliceDevice],
) -> None:
    """Refuse what the scheduler would not allocate: a device in use (exclusively, or by
    anyone when this allocation is exclusive), capacity past the device's, counters past their
    set's."""
    same = [r for r in others if r.device == result.device]
    if same and not device.allow_multiple_allocations:
        first = same[0]
        raise KubeApiError(
            409,
            f"device {result.device} is allocated to "
            f"{owners.get((first.device, first.share_id), 'another claim')}",
        )
    for key, value in device.capacity.items() if device.allow_multiple_allocations else ():
        used = sum(r.consumed.get(key, Quantity(0)).value for r in same)
        want = result.consumed.get(key, Quantity(0)).value
        if used + want > value.value:
            raise KubeApiError(
                409,
                f"device {result.device}: {key} {Quantity(want)} asked, "
                f"{Quantity(max(value.value - used, 0))} of {value} free",
            )
    for consumption in device.consumes_counters:
        total = counter_sets.get(consumption.counter_set)
        if total is None:
            raise KubeApiError(
                422,
                f"device {result.device} consumes counter set {consumption.counter_set}, "
                "which the pool does not publish",
            )
        for key, amount in consumption.counters.items():
            used = sum(
                c.counters.get(key, Quantity(0)).value
                for r in others
                if r.device in published
                for c in published[r.device].consumes_counters
                if c.counter_set == consumption.counter_set
            )
            have = total.get(key, Quantity(0)).value
            if used + amount.value > have:
                raise KubeApiError(
                    409,
                    f"device {result.device}: counter {consumption.counter_set}/{key} has "
                    f"{Quantity(max(have - used, 0))} left, the device consumes {amount}",
                )


def _shown(asked: Mapping[str, Quantity]) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(asked.items())) or "no amounts"
