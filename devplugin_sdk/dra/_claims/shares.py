"""Shares, partitions and admin access of a DRA driver's devices: what a claim that holds one
gets (how they are published is the pool's: ``dra/_pool/shares.py``).

A physical device advertised as shares (``Device.shareable``: replicas, memory units, slices)
is published once, with ``allowMultipleAllocations`` and one consumable capacity whose
``requestPolicy`` takes whole shares (KEP-5075). A claim's ``consumedCapacity`` is turned back
into that many shares of the device, whose plugin's ``allocate()`` gives the limits the
device-plugin API gives for them; how many shares each claim holds is checkpointed with the
claim (a count: shares of one device differ only in their IDs, which DRA never shows, and a
count keeps the checkpoint small with MiB units).
A partition (``Device.partition``: a MIG instance) is published with ``consumesCounters`` of a
counter set of its whole device, which is published too and consumes all of it (KEP-4815).
An allocation with ``adminAccess`` gets the devices' nodes only: no exclusivity, no limits.
The preparer refuses, per claim, what the scheduler should never have allocated, within one claim
too (``overlap``: a whole device beside its own partition, partitions whose counters overlap).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

from devplugin_sdk._logging import printable
from devplugin_sdk.dra._pool.pool import Found
from devplugin_sdk.dra.resources import AllocatedDevice
from devplugin_sdk.types import Allocation, Device, Quantity

__all__ = [
    "ShareError",
    "Use",
    "admin_edits",
    "overlap",
    "take",
]


class ShareError(Exception):
    """This claim's allocation cannot be given; the message names the device and why."""


@dataclass(frozen=True, slots=True)
class Use:
    """What one allocated device of a prepared claim holds beyond the device itself.

    Args:
        device: The device's name in the pool.
        share_id: The allocation's ``shareID`` (empty: exclusive).
        shares: How many of a shared device's shares it holds (memory units, replicas).
        admin: Allocated for admin access: holds nothing, excludes nothing.
    """

    device: str
    share_id: str = ""
    shares: int = 0
    admin: bool = False

    def to_raw(self) -> dict[str, object]:
        """The checkpoint's form."""
        raw: dict[str, object] = {"device": self.device}
        if self.share_id:
            raw["shareID"] = self.share_id
        if self.shares:
            raw["shares"] = self.shares
        if self.admin:
            raw["admin"] = True
        return raw

    @classmethod
    def from_raw(cls, raw: Mapping[str, object]) -> Use:
        """From the checkpoint's form (``TypeError``/``KeyError`` on a damaged one)."""
        shares = raw.get("shares", 0)
        if isinstance(shares, bool) or not isinstance(shares, int) or shares < 0:
            raise TypeError("uses[].shares is not a count")
        return cls(
            str(raw["device"]), str(raw.get("shareID") or ""), shares, raw.get("admin") is True
        )


def take(
    result: AllocatedDevice,
    shares: Sequence[Device],
    held: Iterable[tuple[Use, str]],
) -> tuple[list[Device], Use]:
    """The shares of a shared device a claim's ``result`` gets, and what it then holds.

    Args:
        result: The allocation result (its ``consumed`` capacity, or none: exclusive).
        shares: The device's shares, in order.
        held: What the prepared claims hold, each with its claim (for messages).

    Raises:
        ShareError: the consumption is not whole shares, more than a claim may take, or more
            than is free.
    """
    described = shares[0].shareable
    assert described is not None
    holding = [(use, claim) for use, claim in held if use.device == result.device and use.shares]
    free = len(shares) - sum(use.shares for use, _ in holding)
    capacity, unit = described.capacity, described.unit
    if not result.share_id and not result.consumed:
        # Exclusive: an API server without consumable capacity dropped allowMultipleAllocations
        # and the scheduler gave the whole device: every share.
        wanted = len(shares)
        asked = f"the whole device ({_amount(unit * wanted)} of {capacity})"
    else:
        amount = result.consumed.get(capacity)
        if amount is None:
            raise ShareError(
                f"device {result.device} is shared by {capacity}, and the allocation "
                f"consumes none of it (consumedCapacity: {_shown(result.consumed)})"
            )
        if amount.value % unit or amount.value == 0:
            raise ShareError(
                f"device {result.device}: the allocation consumes {amount} of {capacity}, "
                f"not a whole number of its {_amount(unit)} shares"
            )
        wanted = amount.value // unit
        asked = f"{amount} of {capacity}"
        if described.most is not None and wanted > described.most:
            raise ShareError(
                f"device {result.device}: the allocation consumes {asked}; one claim may "
                f"take at most {_amount(unit * described.most)}"
            )
    if wanted > free:
        users = sorted({claim for _, claim in holding})
        raise ShareError(
            f"device {result.device} has {_amount(unit * max(free, 0))} of {capacity} free "
            f"(of {_amount(unit * len(shares))}; held by {', '.join(users) or 'other claims'}), "
            f"the allocation asks {asked}"
        )
    # Shares of one device differ only in their IDs: any ``wanted`` of them give the limits.
    return list(shares[:wanted]), Use(result.device, result.share_id, wanted)


def overlap(results: Sequence[tuple[AllocatedDevice, Found]]) -> None:
    """Refuse one claim's devices that overlap each other: the container would get a device
    twice and its memory be counted twice (the scheduler's counters forbid both, KEP-4815).

    Args:
        results: The claim's exclusive results (not shares, not admin access), each with its
            published device.

    Raises:
        ShareError: naming both devices: a whole device and its own partition, or two
            partitions of one device whose counters add up to more than it has.
    """
    names = {result.device for result, _ in results}
    used: dict[tuple[str, str], tuple[int, str]] = {}  # (whole, counter) -> (taken, by whom)
    for result, found in results:
        if found.whole is None:
            continue
        name, whole = printable(result.device), printable(found.whole)
        if found.whole in names:
            raise ShareError(f"the claim holds device {whole} and its own partition {name}")
        partition = found.device.partition
        if partition is None:
            continue
        for counter, amount in partition.consumes.items():
            taken, by = used.get((found.whole, counter), (0, ""))
            if by and taken + amount.value > partition.counters[counter].value:
                raise ShareError(
                    f"the claim holds partitions {by} and {name} of device {whole}, which "
                    f"overlap: together they take {_amount(taken + amount.value)} of its "
                    f"{counter}, which has {partition.counters[counter]}"
                )
            used[(found.whole, counter)] = (taken + amount.value, by or name)


def admin_edits(devices: Collection[Device]) -> Allocation:
    """What an admin-access allocation gets: the devices' nodes, to monitor them; no
    environment, so no limits and no runtime hook that would claim the device."""
    merged = Allocation.merge(list(devices))
    return Allocation(device_nodes=merged.device_nodes)


def _amount(value: int) -> str:
    return str(Quantity(value))


def _shown(consumed: Mapping[str, Quantity]) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(consumed.items())) or "none"
