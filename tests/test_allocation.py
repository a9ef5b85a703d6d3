"""The generic topology scorer in devplugin_sdk.allocation, on its own (no backend)."""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from devplugin_sdk.allocation import TopologyScorer, matrix_score

# Two NVLink islands of four GPUs each (go-gpuallocator's scale: +100 per link), joined by
# PCIe only; GPUs 0-3 on NUMA node 0, 4-7 on node 1.
ISLANDS = {
    (f"gpu{a}", f"gpu{b}"): (200.0 if (a < 4) == (b < 4) else 10.0)
    for a, b in itertools.combinations(range(8), 2)
}
GPUS = [f"gpu{i}" for i in range(8)]
NUMA = {f"gpu{i}": i // 4 for i in range(8)}


def test_matrix_score_looks_up_either_direction_and_defaults_the_rest() -> None:
    score = matrix_score({("a", "b"): 3.0}, default=-1.0)

    assert score("a", "b") == 3.0
    assert score("b", "a") == 3.0
    assert score("a", "c") == -1.0


def test_picks_the_nvlinked_pair_over_a_pcie_pair() -> None:
    scorer = TopologyScorer({("a", "b"): 10.0, ("a", "c"): 100.0, ("b", "c"): 10.0})

    assert scorer.choose(["a", "b", "c"], 2) == ["a", "c"]


def test_keeps_must_include_first_and_completes_it_with_its_best_partners() -> None:
    scorer = TopologyScorer(ISLANDS, numa_nodes=NUMA)

    chosen = scorer.choose(GPUS, 3, must_include=["gpu6"])

    assert chosen[0] == "gpu6"
    assert set(chosen) <= {"gpu4", "gpu5", "gpu6", "gpu7"}


def test_same_numa_node_breaks_a_tie_between_equal_links() -> None:
    flat = dict.fromkeys(itertools.combinations(GPUS, 2), 100.0)
    scorer = TopologyScorer(flat, numa_nodes=NUMA)

    chosen = scorer.choose(GPUS, 2, must_include=["gpu5"])

    assert NUMA[chosen[1]] == NUMA["gpu5"]


def test_fills_a_whole_island_when_four_are_asked() -> None:
    scorer = TopologyScorer(ISLANDS, numa_nodes=NUMA)

    assert set(scorer.choose(GPUS, 4)) in (
        {"gpu0", "gpu1", "gpu2", "gpu3"},
        {"gpu4", "gpu5", "gpu6", "gpu7"},
    )


def test_single_device_comes_from_the_island_already_broken_into() -> None:
    # gpu0 and gpu1 are taken: giving gpu2 away keeps the intact island 4-7 free.
    scorer = TopologyScorer(ISLANDS, numa_nodes=NUMA)

    chosen = scorer.choose([g for g in GPUS if g not in ("gpu0", "gpu1")], 1)

    assert chosen[0] in ("gpu2", "gpu3")


def test_replicas_spread_across_distinct_physical_units() -> None:
    replicas = [f"gpu{g}::{n}" for g in range(4) for n in range(4)]
    units = {r: r.split("::")[0] for r in replicas}
    scorer = TopologyScorer(ISLANDS, units=units, numa_nodes=NUMA)

    chosen = scorer.choose(replicas, 3)

    assert len({units[c] for c in chosen}) == 3


def test_a_single_replica_comes_from_the_least_used_unit() -> None:
    # gpu0 has one free replica left, gpu1 has all four: take from gpu1.
    available = ["gpu0::3", "gpu1::0", "gpu1::1", "gpu1::2", "gpu1::3"]
    units = {r: r.split("::")[0] for r in available}
    scorer = TopologyScorer({("gpu0", "gpu1"): 100.0}, units=units)

    assert scorer.choose(available, 1)[0].startswith("gpu1::")


def test_large_replica_pools_are_solved_greedily_and_still_spread() -> None:
    replicas = [f"gpu{g}::{n}" for g in range(8) for n in range(10)]
    units = {r: r.split("::")[0] for r in replicas}
    scorer = TopologyScorer(ISLANDS, units=units, numa_nodes=NUMA)

    chosen = scorer.choose(replicas, 4)

    assert len({units[c] for c in chosen}) == 4
    # Four distinct GPUs of one NVLink island.
    assert len({int(units[c][3:]) // 4 for c in chosen}) == 1


def test_greedy_search_finds_the_islands_like_the_exact_search() -> None:
    exact = TopologyScorer(ISLANDS, numa_nodes=NUMA)
    greedy = TopologyScorer(ISLANDS, numa_nodes=NUMA, exact_limit=0)

    for size in range(1, 5):
        assert exact.set_score(greedy.choose(GPUS, size)) == exact.set_score(
            exact.choose(GPUS, size)
        )


def test_the_answer_does_not_depend_on_the_order_of_the_candidates() -> None:
    scorer = TopologyScorer(ISLANDS, numa_nodes=NUMA)
    expected = scorer.choose(GPUS, 3, must_include=["gpu1"])
    shuffled = list(GPUS)

    for seed in range(5):
        random.Random(seed).shuffle(shuffled)
        assert scorer.choose(shuffled, 3, must_include=["gpu1"]) == expected


def test_the_whole_must_include_set_is_returned_when_it_fills_the_request() -> None:
    scorer = TopologyScorer(ISLANDS)

    assert scorer.choose(GPUS, 2, must_include=["gpu7", "gpu0"]) == ["gpu7", "gpu0"]


@pytest.mark.parametrize(
    ("available", "size", "must_include", "message"),
    [
        (["a", "b"], 3, [], "size must be between 0 and 2"),
        (["a", "b"], -1, [], "size must be between 0 and 2"),
        (["a", "b"], 1, ["a", "b"], "more than size 1"),
        (["a", "b"], 2, ["c"], "not available: c"),
    ],
)
def test_impossible_requests_raise_value_error(
    available: list[str], size: int, must_include: list[str], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        TopologyScorer({}).choose(available, size, must_include)


def test_a_link_function_is_accepted_instead_of_a_table() -> None:
    scorer = TopologyScorer(lambda a, b: 50.0 if {a, b} == {"x", "z"} else 0.0)

    assert scorer.choose(["x", "y", "z"], 2) == ["x", "z"]


@settings(max_examples=60, deadline=None)
@given(
    scores=st.lists(st.integers(0, 300), min_size=15, max_size=15),
    size=st.integers(1, 6),
)
def test_exact_search_finds_a_set_at_least_as_good_as_any_other(
    scores: list[int], size: int
) -> None:
    ids = [f"d{i}" for i in range(6)]
    table = {pair: float(s) for pair, s in zip(itertools.combinations(ids, 2), scores, strict=True)}
    scorer = TopologyScorer(table)

    best = scorer.set_score(scorer.choose(ids, size))

    assert all(best >= scorer.set_score(list(c)) for c in itertools.combinations(ids, size))
