"""Preferred allocation that any backend can feed, and the arithmetic of sharing a device.

``TopologyScorer`` picks the best-connected set of devices for GetPreferredAllocation: the set
with the highest sum of pairwise scores (link score between physical units, plus a bonus for a
shared NUMA node), must-include devices always kept. The scoring model follows NVIDIA's
go-gpuallocator best-effort policy (``besteffort_policy.go``: pair scores summed over the set);
the search is exact for small sets and greedy beyond, and every tie is broken deterministically.
``complete_preference`` makes any choice a valid answer, as the SDK does with what
``preferred_allocation`` returns.

For devices that are *shares* of a unit (memory units or slices of a GPU), ``place_together``
keeps one container's shares on one unit (binpack or spread) and ``spread_apart`` puts them on
different units; both compute what is free from the kubelet's ``available`` list only, so they
stay right across plugin and kubelet restarts, and their ``Placement`` reports the free shares
per unit (the largest free block) for error messages. ``list_entry_bytes``,
``list_message_bytes`` and ``numbered_list_bytes`` size a ListAndWatch message the way it is
encoded, and ``check_list_size`` refuses a configuration whose list would pass the kubelet's 4 MiB
limit, before a device is built (every backend's shares: replicas, memory units, ``share``).
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from devplugin_sdk.api import constants
from devplugin_sdk.errors import ConfigError
from devplugin_sdk.types import Device, Health

__all__ = [
    "PLACEMENTS",
    "LinkScore",
    "Placement",
    "TopologyScorer",
    "UnitOf",
    "check_list_size",
    "check_share_count",
    "complete_preference",
    "list_entry_bytes",
    "list_message_bytes",
    "matrix_score",
    "most_that_fit",
    "numbered_list_bytes",
    "place_together",
    "spread_apart",
]

LinkScore = Callable[[str, str], float]
"""Score of the link between two *physical units* (higher is better connected)."""


def matrix_score(matrix: Mapping[tuple[str, str], float], default: float = 0.0) -> LinkScore:
    """Turn a pairwise score table into a symmetric ``LinkScore``.

    Args:
        matrix: Scores by ``(a, b)``; one direction is enough, ``(b, a)`` is looked up too.
        default: Score of a pair missing from the table.

    Returns:
        A function ``score(a, b)``.
    """

    def score(a: str, b: str) -> float:
        value = matrix.get((a, b))
        if value is None:
            value = matrix.get((b, a), default)
        return value

    return score


@dataclass(frozen=True)
class TopologyScorer:
    """Chooses the best-connected set of device IDs.

    The score of a set is the sum of ``pair_score`` over its pairs. Two devices that share a
    physical unit (replicas of one GPU, MIG devices of one GPU) score ``same_unit_score``, by
    default low enough that sets spread across distinct units. Among sets with the same score,
    the one whose devices are *least* connected to the rest of the available devices wins,
    which keeps well-connected groups free for later requests and, for replicas, takes from
    the least-used unit first.

    Args:
        link_score: Link score between two different units (a function or a
            ``{(a, b): score}`` table); called once per unit pair and cached per call.
        numa_nodes: NUMA node by device ID or unit ID; ``None`` or missing means unknown.
        units: Physical unit by device ID; a device not listed is its own unit.
        numa_bonus: Added to a pair's score when both are on the same known NUMA node.
        same_unit_score: Score of a pair of devices on the same unit.
        exact_limit: Largest number of pair evaluations the exhaustive search may spend;
            bigger problems are solved greedily.
    """

    link_score: LinkScore | Mapping[tuple[str, str], float]
    numa_nodes: Mapping[str, int | None] = field(default_factory=dict)
    units: Mapping[str, str] = field(default_factory=dict)
    numa_bonus: float = 10.0
    same_unit_score: float = -1_000_000.0
    exact_limit: int = 200_000

    def __post_init__(self) -> None:
        if self.exact_limit < 0:
            raise ValueError(f"exact_limit must be >= 0, got {self.exact_limit}")

    def unit_of(self, device_id: str) -> str:
        """The physical unit a device belongs to."""
        return self.units.get(device_id, device_id)

    def pair_score(self, a: str, b: str) -> float:
        """Score of having devices ``a`` and ``b`` in the same set."""
        return _Pairs(self).score(a, b)

    def set_score(self, device_ids: Sequence[str]) -> float:
        """Sum of ``pair_score`` over every pair of ``device_ids``."""
        pairs = _Pairs(self)
        return sum(pairs.score(a, b) for a, b in itertools.combinations(device_ids, 2))

    def choose(
        self, available: Sequence[str], size: int, must_include: Sequence[str] = ()
    ) -> list[str]:
        """Pick ``size`` device IDs: ``must_include`` first, then the best-scoring completion.

        Args:
            available: Candidate device IDs (must include ``must_include``).
            size: How many IDs to return.
            must_include: IDs that must be in the answer.

        Returns:
            ``must_include`` in the given order, followed by the chosen IDs in sorted order.

        Raises:
            ValueError: if ``size`` is negative or larger than the available set, if
                ``must_include`` has more than ``size`` IDs or IDs that are not available.
        """
        ids = list(dict.fromkeys(available))
        must = list(dict.fromkeys(must_include))
        missing = [m for m in must if m not in set(ids)]
        if missing:
            raise ValueError(f"must_include IDs are not available: {', '.join(missing)}")
        if not 0 <= size <= len(ids):
            raise ValueError(f"size must be between 0 and {len(ids)}, got {size}")
        if len(must) > size:
            raise ValueError(f"must_include has {len(must)} IDs, more than size {size}")
        need = size - len(must)
        if need == 0:
            return must
        taken = set(must)
        rest = sorted(i for i in ids if i not in taken)
        pairs = _Pairs(self)
        # How connected each candidate is to everything available: the tie-breaker.
        connectivity = pairs.connectivity(rest, ids)
        combos = math.comb(len(rest), need)
        work = combos * (need * (need - 1) // 2 + need * len(must))
        if work <= self.exact_limit:
            chosen = _exact(pairs, must, rest, need, connectivity)
        else:
            chosen = _greedy(pairs, must, rest, need, connectivity)
        return must + sorted(chosen)


def complete_preference(
    available: Iterable[str], must_include: Iterable[str], size: int, choice: Iterable[str] = ()
) -> list[str]:
    """A valid GetPreferredAllocation answer, whatever ``choice`` holds.

    Must-include IDs come first (those also in ``available`` before the others: the kubelet
    sends them in both lists), then the IDs of ``choice`` that are available, in its order,
    then the other available IDs in their order, until there are ``size``. Repeats are dropped.
    A request can name every unit of a large resource (81,920 GPU memory units): each ID is
    walked as few times as possible, with the set work done in C.

    Args:
        available: IDs the kubelet may allocate, in its order; a ``dict``'s keys are used as
            they are, without a copy.
        must_include: IDs that must be in the answer.
        size: How many IDs the container gets.
        choice: Preferred IDs (a hook's answer); unavailable ones are ignored.

    Returns:
        ``size`` IDs, fewer only when ``available`` and ``must_include`` together hold fewer;
        none when ``size`` is not positive. Must-include IDs beyond ``size`` are cut off.
    """
    if size <= 0:
        return []
    offered = available if isinstance(available, dict) else dict.fromkeys(available)
    must = dict.fromkeys(must_include)
    result = [i for i in must if i in offered] + [i for i in must if i not in offered]
    if len(result) >= size:
        return result[:size]
    chosen = set(result)
    for candidates in (choice, offered):
        for candidate in candidates:
            if candidate in offered and candidate not in chosen:
                result.append(candidate)
                if len(result) >= size:
                    return result
                chosen.add(candidate)
    return result


_Key = tuple[str, int | None]  # (physical unit, NUMA node)


class _Pairs:
    """Pair scores computed per (unit, NUMA node) class, so replicas cost nothing extra."""

    def __init__(self, scorer: TopologyScorer) -> None:
        self._scorer = scorer
        link = scorer.link_score
        self._link: LinkScore = link if callable(link) else matrix_score(link)
        self._cache: dict[tuple[_Key, _Key], float] = {}

    def key(self, device_id: str) -> _Key:
        unit = self._scorer.unit_of(device_id)
        numa = self._scorer.numa_nodes.get(device_id, self._scorer.numa_nodes.get(unit))
        return unit, numa

    def score(self, a: str, b: str) -> float:
        return self.key_score(self.key(a), self.key(b))

    def key_score(self, ka: _Key, kb: _Key) -> float:
        cached = self._cache.get((ka, kb))
        if cached is not None:
            return cached
        if ka[0] == kb[0]:
            value = self._scorer.same_unit_score
        else:
            value = float(self._link(ka[0], kb[0]))
            if ka[1] is not None and ka[1] == kb[1]:
                value += self._scorer.numa_bonus
        self._cache[(ka, kb)] = self._cache[(kb, ka)] = value
        return value

    def connectivity(
        self, candidates: Sequence[str], everything: Sequence[str]
    ) -> dict[str, float]:
        counts: dict[_Key, int] = {}
        for device_id in everything:
            k = self.key(device_id)
            counts[k] = counts.get(k, 0) + 1
        out: dict[str, float] = {}
        for device_id in candidates:
            own = self.key(device_id)
            total = 0.0
            for k, n in counts.items():
                # A device is not paired with itself.
                total += self.key_score(own, k) * (n - 1 if k == own else n)
            out[device_id] = total
        return out


def _exact(
    pairs: _Pairs, must: list[str], rest: list[str], need: int, connectivity: dict[str, float]
) -> list[str]:
    best: tuple[float, float] | None = None
    best_combo: tuple[str, ...] = ()
    for combo in itertools.combinations(rest, need):
        score = sum(pairs.score(a, b) for a, b in itertools.combinations(combo, 2))
        score += sum(pairs.score(m, c) for m in must for c in combo)
        rank = (score, -sum(connectivity[c] for c in combo))
        # Strictly better only: the first combination in sorted order wins a tie.
        if best is None or rank > best:
            best, best_combo = rank, combo
    return list(best_combo)


def _greedy(
    pairs: _Pairs, must: list[str], rest: list[str], need: int, connectivity: dict[str, float]
) -> list[str]:
    if must:
        seeds: list[list[str]] = [[]]
    else:
        # One seed per (unit, NUMA) class: replicas of one unit are interchangeable seeds.
        by_class: dict[_Key, str] = {}
        for device_id in rest:
            by_class.setdefault(pairs.key(device_id), device_id)
        seeds = [[s] for s in by_class.values()]
    best: tuple[float, float] | None = None
    best_set: list[str] = []
    for seed in seeds:
        chosen = list(seed)
        gain = {c: 0.0 for c in rest if c not in seed}  # keeps sorted order
        for member in must + chosen:
            for c in gain:
                gain[c] += pairs.score(member, c)
        while len(chosen) < need:
            pick = _best_candidate(gain, connectivity)
            del gain[pick]
            chosen.append(pick)
            for c in gain:
                gain[c] += pairs.score(pick, c)
        score = sum(pairs.score(a, b) for a, b in itertools.combinations(chosen, 2))
        score += sum(pairs.score(m, c) for m in must for c in chosen)
        rank = (score, -sum(connectivity[c] for c in chosen))
        if best is None or rank > best:
            best, best_set = rank, chosen
    return best_set


def _best_candidate(gain: dict[str, float], connectivity: dict[str, float]) -> str:
    # Highest gain, then least connected to the rest; the first in sorted order wins a tie.
    pick = ""
    pick_rank: tuple[float, float] | None = None
    for candidate, value in gain.items():
        rank = (value, -connectivity[candidate])
        if pick_rank is None or rank > pick_rank:
            pick, pick_rank = candidate, rank
    return pick


# ----------------------------------------------------------------------------- shares of a unit

UnitOf = Callable[[str], str] | Mapping[str, str]
"""The unit (a GPU, an HCA) a share belongs to: a function of the device ID, or a table by
device ID (a device missing from the table is its own unit)."""

#: How ``place_together`` picks among the units that fit: ``binpack`` takes the unit with the
#: fewest free shares (whole units stay free for big requests), ``spread`` the one with the most
#: (containers share a unit as little as possible).
PLACEMENTS = ("binpack", "spread")


@dataclass(frozen=True)
class Placement:
    """Where ``place_together`` or ``spread_apart`` put a container's shares, and what was free.

    Attributes:
        device_ids: The chosen device IDs, must-include ones first; fewer than asked only when
            fewer were available.
        units: The unit of each chosen ID, in the same order.
        free: Free shares per unit in the ``available`` list (must-include ones counted), in
            the order the units rank (``unit_order``, then by name).
    """

    device_ids: tuple[str, ...]
    units: tuple[str, ...]
    free: Mapping[str, int]

    @property
    def together(self) -> bool:
        """Whether every chosen share is on one unit."""
        return len(set(self.units)) <= 1

    @property
    def apart(self) -> bool:
        """Whether every chosen share is on a different unit."""
        return len(set(self.units)) == len(self.units)

    def largest_free(self) -> tuple[str, int] | None:
        """The unit with the most free shares (the first in rank order on a tie) and that count;
        None when nothing was available."""
        if not self.free:
            return None
        unit = max(self.free, key=lambda u: self.free[u])  # max keeps the first of equals
        return unit, self.free[unit]


def place_together(
    available: Iterable[str],
    size: int,
    unit_of: UnitOf,
    *,
    must_include: Sequence[str] = (),
    placement: str = "binpack",
    unit_order: Sequence[str] = (),
) -> Placement:
    """Choose ``size`` shares on one unit, the unit picked by ``placement``.

    What is free is what ``available`` lists (the kubelet's view: healthy and not in use), so the
    answer needs no memory of earlier allocations. Must-include shares are kept; when they are all
    on one unit, the rest comes from that unit. When no unit can hold the whole request, the
    answer uses as few units as possible: the must-include shares' units first, then the units
    with the most free shares; ``Placement.together`` is then False and ``Placement.free`` says
    what each unit had.

    Args:
        available: Device IDs the container may get (the kubelet's ``available`` list).
        size: How many shares the container gets in total.
        unit_of: The unit of each share.
        must_include: IDs that must be in the answer (the kubelet lists them in ``available``
            too; they count as free shares of their unit).
        placement: ``binpack`` (the unit with the fewest free shares that fits) or ``spread``
            (the unit with the most).
        unit_order: Units in the order that breaks ties (GPU index order, say); units not
            listed come after, by name.

    Returns:
        The placement. Within a unit, shares are taken in ``(len(id), id)`` order, which for
        ``<prefix>-<n>`` IDs is the order of ``n``.

    Raises:
        ValueError: ``size`` is negative or ``placement`` is not one of ``PLACEMENTS``.
    """
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {', '.join(PLACEMENTS)}, got {placement!r}")
    shares = _Shares(available, size, unit_of, must_include, unit_order)
    must_units = shares.must_units
    if len(must_units) <= 1:
        fits = [
            u
            for u in shares.free
            if shares.free[u] >= size and (not must_units or u == must_units[0])
        ]
        if fits:
            sign = 1 if placement == "binpack" else -1
            # min keeps the first of equals, and `free` is in rank order.
            best = min(fits, key=lambda u: sign * shares.free[u])
            return shares.fill([best])
    # No unit holds it all: as few units as possible, largest blocks first.
    rest = sorted((u for u in shares.free if u not in must_units), key=lambda u: -shares.free[u])
    return shares.fill([*must_units, *rest])


def spread_apart(
    available: Iterable[str],
    size: int,
    unit_of: UnitOf,
    *,
    must_include: Sequence[str] = (),
    link_score: LinkScore | Mapping[tuple[str, str], float] | None = None,
    unit_order: Sequence[str] = (),
) -> Placement:
    """Choose ``size`` shares, each on a different unit (slices of GPUs, as HAMi spreads them).

    Units are taken one by one: the unit with the most free shares first (spread), then, among
    units with as many, the best linked to the units already chosen (``link_score`` summed),
    then ``unit_order``. Must-include shares are kept and their units count as chosen. When
    fewer units than ``size`` have a free share, the rest comes from the chosen units, most free
    first, and ``Placement.apart`` is False.

    Args:
        available: Device IDs the container may get (the kubelet's ``available`` list).
        size: How many shares the container gets in total.
        unit_of: The unit of each share.
        must_include: IDs that must be in the answer.
        link_score: Link score between two units (a function or a ``{(a, b): score}`` table);
            None scores every pair alike.
        unit_order: Units in the order that breaks the remaining ties.

    Raises:
        ValueError: ``size`` is negative.
    """
    shares = _Shares(available, size, unit_of, must_include, unit_order)
    link: LinkScore | None
    link = link_score if callable(link_score) or link_score is None else matrix_score(link_score)
    chosen = list(shares.must_units)
    want = size - len(shares.must)
    candidates = [u for u in shares.free if u not in chosen and shares.spare(u)]
    while want > 0 and candidates:

        def rank(unit: str) -> tuple[int, float]:
            linked = sum(link(unit, c) for c in chosen) if link is not None else 0.0
            return shares.free[unit], linked

        best = max(candidates, key=rank)  # max keeps the first of equals: rank order
        candidates.remove(best)
        chosen.append(best)
        want -= 1
    placement = shares.fill(chosen[len(shares.must_units) :], per_unit=1)
    if len(placement.device_ids) < size:
        # Not enough distinct units: the rest from the units with the most shares left.
        again = sorted(chosen, key=lambda u: -shares.spare(u))
        placement = shares.fill(again, start=placement)
    return placement


class _Shares:
    """The available shares grouped by unit, for one placement (used once)."""

    def __init__(
        self,
        available: Iterable[str],
        size: int,
        unit_of: UnitOf,
        must_include: Sequence[str],
        unit_order: Sequence[str],
    ) -> None:
        if size < 0:
            raise ValueError(f"size must be >= 0, got {size}")
        self.size = size
        table = unit_of
        unit = self.unit_of = table if callable(table) else (lambda i: table.get(i, i))
        self.must = list(dict.fromkeys(must_include))
        # One pass, no per-item overhead beyond the unit: a node may list 100,000 shares.
        groups: dict[str, list[str]] = {}
        for device_id in dict.fromkeys([*self.must, *available]):
            key = unit(device_id)
            group = groups.get(key)
            if group is None:
                groups[key] = group = []
            group.append(device_id)
        position = {u: i for i, u in enumerate(dict.fromkeys(unit_order))}
        ranked = sorted(groups, key=lambda u: (position.get(u, len(position)), u))
        self.groups = {u: groups[u] for u in ranked}
        self.free = {u: len(groups[u]) for u in ranked}
        self.must_units = list(dict.fromkeys(unit(m) for m in self.must))
        self.taken: dict[str, int] = {}
        for m in self.must:
            self.taken[unit(m)] = self.taken.get(unit(m), 0) + 1

    def spare(self, unit: str) -> int:
        """Free shares of ``unit`` not yet chosen."""
        return self.free[unit] - self.taken.get(unit, 0)

    def fill(
        self, units: Sequence[str], *, per_unit: int | None = None, start: Placement | None = None
    ) -> Placement:
        """Must-include shares (or ``start``'s), then shares of ``units`` in turn up to size."""
        if start is not None:
            chosen, units_of = list(start.device_ids), list(start.units)
        else:
            chosen, units_of = list(self.must), [self.unit_of(m) for m in self.must]
        taken = set(chosen)
        for unit in units:
            want = self.size - len(chosen)
            if want <= 0:
                break
            if per_unit is not None:
                want = min(want, per_unit)
            # (len(id), id) order, by two sorts in C: the second is stable.
            ordered = sorted(self.groups[unit])
            ordered.sort(key=len)
            if taken:
                ordered = [i for i in ordered if i not in taken]
            picked = ordered[:want]
            chosen += picked
            units_of += [unit] * len(picked)
            taken.update(picked)
            self.taken[unit] = self.taken.get(unit, 0) + len(picked)
        return Placement(tuple(chosen), tuple(units_of), dict(self.free))


# ----------------------------------------------------------------------------- message size


def _varint_bytes(value: int) -> int:
    return max(1, (value.bit_length() + 6) // 7)


def _field_bytes(length: int) -> int:
    """A length-delimited field: one tag byte (field numbers below 16), its length, the bytes."""
    return 1 + _varint_bytes(length) + length


def list_entry_bytes(
    device_id: str, numa_nodes: Sequence[int] = (), health: Health = Health.HEALTHY
) -> int:
    """Bytes one device adds to a ListAndWatch message, as protobuf encodes it.

    The message is a repeated ``Device`` field: each device costs its ID, its health string
    (``Unhealthy`` is two bytes longer than ``Healthy``) and its NUMA nodes (node 0 encodes in
    fewer bytes than the others, protobuf leaving zeros out).
    """
    device = _field_bytes(len(device_id.encode())) + _field_bytes(len(health.value))
    if numa_nodes:
        nodes = sum(_field_bytes(1 + _varint_bytes(n) if n else 0) for n in numa_nodes)
        device += _field_bytes(nodes)
    return _field_bytes(device)


def list_message_bytes(devices: Iterable[Device], health: Health | None = None) -> int:
    """Size of the ListAndWatch message listing ``devices``: compare it with
    ``devplugin_sdk.api.constants.MAX_MESSAGE_BYTES`` (4 MiB), over which the kubelet drops the
    stream (and the SDK refuses to send it).

    Args:
        devices: The devices.
        health: Count every device with this health (``Health.UNHEALTHY`` for the largest the
            message can get); None uses each device's own.
    """
    return sum(
        list_entry_bytes(d.id, d.numa_nodes, d.health if health is None else health)
        for d in devices
    )


def numbered_list_bytes(
    prefix: str, count: int, numa_nodes: Sequence[int] = (), health: Health = Health.UNHEALTHY
) -> int:
    """Bytes the ``count`` devices ``<prefix>0`` to ``<prefix><count - 1>`` add to a ListAndWatch
    message, counted without building them: the shares of one unit (replicas ``<id>::<n>``,
    memory units ``<key>-<n>``), however many.

    An entry's size depends on the ID's length only, so the sum has one term per number of
    digits. The default health is the longer ``Unhealthy``: the largest the list gets, and that
    list must reach the kubelet too.
    """
    size = 0
    first, digits = 0, 1
    while first < count:
        end = min(10**digits, count)
        size += (end - first) * list_entry_bytes(f"{prefix}{first}", numa_nodes, health)
        first, digits = end, digits + 1
    return size


def check_list_size(
    key: str, size: int, made_by: str, fix: str, *, where: str = "here", at_least: bool = False
) -> None:
    """Refuse a configuration whose ListAndWatch list would pass the kubelet's 4 MiB limit.

    The kubelet's grpc-go client refuses any ListAndWatch message over
    ``devplugin_sdk.api.constants.MAX_MESSAGE_BYTES``: the resource would register and never
    list a device. Backends call this when they read their configuration, with the size from
    ``numbered_list_bytes`` (no device built), so a huge share count costs nothing.

    Args:
        key: The dotted key that makes the list (``sharing.timeSlicing.replicas``).
        size: The list's size in bytes.
        made_by: The subject of the message (``"20,000 replicas"``, ``"MiB units"``).
        fix: What to do instead.
        where: Which devices the size is for (``"here (160,000 devices on 8 GPUs)"``).
        at_least: ``size`` is a lower bound (the devices are not known yet).

    Raises:
        ConfigError: on ``key``, one line with the size and the limit.
    """
    if size <= constants.MAX_MESSAGE_BYTES:
        return
    bound = "at least" if at_least else "up to"
    raise ConfigError(
        key,
        f"{made_by} make a ListAndWatch list of {bound} {size:,} bytes {where}, over the kubelet's"
        f" limit of {constants.MAX_MESSAGE_BYTES:,} bytes (4 MiB); {fix}",
    )


def most_that_fit(size_of: Callable[[int], int], upper: int) -> int:
    """The largest count up to ``upper`` whose list ``size_of(count)`` fits the kubelet's limit
    (for a message that says what would fit; ``size_of`` must grow with the count)."""
    return bisect.bisect_right(range(upper + 1), constants.MAX_MESSAGE_BYTES, key=size_of) - 1


def check_share_count(key: str, count: int) -> None:
    """Refuse a count of shares per device (``share``, ``shares``, a group's ``count``) so large
    that even one device's list could not reach the kubelet, before any device is known (a
    one-character ID: the smallest list ``count`` shares can make). Check the list of the devices
    found again at discovery.

    Raises:
        ConfigError: on ``key``, with the size.
    """
    check_list_size(
        key,
        numbered_list_bytes("x::", count),
        f"{count:,} shares",
        "lower it",
        where="for one device",
        at_least=True,
    )
