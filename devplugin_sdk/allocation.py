"""Topology-aware preferred allocation that any backend can feed with its own link scores.

``TopologyScorer`` picks the best-connected set of devices for GetPreferredAllocation: the set
with the highest sum of pairwise scores (link score between physical units, plus a bonus for a
shared NUMA node), must-include devices always kept. The scoring model follows NVIDIA's
go-gpuallocator best-effort policy (``besteffort_policy.go``: pair scores summed over the set);
the search is exact for small sets and greedy beyond, and every tie is broken deterministically.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

__all__ = ["LinkScore", "TopologyScorer", "matrix_score"]

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
