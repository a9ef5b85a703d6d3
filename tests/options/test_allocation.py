"""devplugin_sdk.allocation on its own (no backend): the topology scorer, placing shares of a
unit together or apart, and the size of a ListAndWatch message."""

from __future__ import annotations

import itertools
import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from devplugin_sdk._wire import convert
from devplugin_sdk.allocation import (
    TopologyScorer,
    complete_preference,
    list_entry_bytes,
    list_message_bytes,
    matrix_score,
    place_together,
    spread_apart,
)
from devplugin_sdk.types import Device, Health

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


# ----------------------------------------------------------------------------- shares of a unit

# Four GPUs of 40 GiB as memory units "g<gpu>-<n>" (the nvidia backend's ID shape).
ORDER = ["g0", "g1", "g2", "g3"]


def units(free: dict[str, int]) -> list[str]:
    """Available memory units: ``free[g]`` units of GPU ``g``, the highest-numbered ones."""
    return [f"{g}-{n}" for g, count in free.items() for n in range(40 - count, 40)]


def gpu_of(device_id: str) -> str:
    return device_id.rpartition("-")[0]


def test_binpack_takes_the_unit_with_the_fewest_free_shares_that_fits() -> None:
    available = units({"g0": 30, "g1": 5, "g2": 40, "g3": 12})

    placed = place_together(available, 10, gpu_of, unit_order=ORDER)

    assert placed.together
    assert set(placed.units) == {"g3"}
    assert len(placed.device_ids) == 10
    assert placed.free == {"g0": 30, "g1": 5, "g2": 40, "g3": 12}


def test_spread_takes_the_unit_with_the_most_free_shares() -> None:
    available = units({"g0": 30, "g1": 5, "g2": 40, "g3": 12})

    placed = place_together(available, 10, gpu_of, placement="spread", unit_order=ORDER)

    assert set(placed.units) == {"g2"}


def test_ties_go_to_the_first_unit_in_unit_order() -> None:
    available = units(dict.fromkeys(ORDER, 40))

    assert set(place_together(available, 10, gpu_of, unit_order=ORDER).units) == {"g0"}
    reverse = list(reversed(ORDER))
    assert set(place_together(available, 10, gpu_of, unit_order=reverse).units) == {"g3"}
    # Without an order, by name.
    assert set(place_together(available, 10, gpu_of).units) == {"g0"}


def test_10_35_30_gib_binpack_onto_two_gpus_and_45_does_not_fit_on_one() -> None:
    # The scenario on an A100x8 40 GiB node, replayed as the kubelet would: each
    # container's units leave `available` once allocated.
    gpus = [f"g{i}" for i in range(8)]
    free = [f"{g}-{n}" for g in gpus for n in range(40)]
    landed = []
    for size in (10, 35, 30):
        placed = place_together(free, size, gpu_of, unit_order=gpus)
        assert placed.together
        landed.append(placed.units[0])
        free = [i for i in free if i not in set(placed.device_ids)]

    assert landed == ["g0", "g1", "g0"]
    placed = place_together(free, 45, gpu_of, unit_order=gpus)
    assert not placed.together
    assert placed.largest_free() == ("g2", 40)
    assert "g0" not in placed.free  # full: none of its units is available
    # As few GPUs as possible: the largest block, then the next.
    assert placed.units.count("g2") == 40
    assert len(set(placed.units)) == 2


def test_must_include_keeps_the_rest_on_its_unit() -> None:
    available = units({"g0": 40, "g1": 20})

    placed = place_together(available, 15, gpu_of, must_include=["g1-30"], unit_order=ORDER)

    assert placed.device_ids[0] == "g1-30"
    assert set(placed.units) == {"g1"}


def test_must_include_on_a_unit_too_small_spills_over_to_the_largest_block() -> None:
    available = units({"g0": 40, "g1": 4})

    placed = place_together(available, 10, gpu_of, must_include=["g1-36"], unit_order=ORDER)

    assert placed.device_ids[0] == "g1-36"
    assert placed.units.count("g1") == 4
    assert placed.units.count("g0") == 6


def test_shares_of_a_unit_are_taken_in_number_order() -> None:
    placed = place_together(["g0-10", "g0-9", "g0-2", "g0-100"], 3, gpu_of)

    assert placed.device_ids == ("g0-2", "g0-9", "g0-10")


def test_a_table_names_the_units_and_unlisted_devices_are_their_own_unit() -> None:
    table = {"a": "u1", "b": "u1", "c": "u2"}

    placed = place_together(["a", "b", "c", "solo"], 2, table)

    assert set(placed.units) == {"u1"}
    assert placed.free == {"solo": 1, "u1": 2, "u2": 1}


def test_too_few_available_gives_what_there_is_and_nothing_gives_no_largest_block() -> None:
    assert place_together(["g0-1"], 3, gpu_of).device_ids == ("g0-1",)
    empty = place_together([], 3, gpu_of)
    assert empty.device_ids == ()
    assert empty.largest_free() is None
    assert place_together(["g0-1"], 0, gpu_of).device_ids == ()


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: place_together([], -1, gpu_of), "size must be >= 0"),
        (lambda: place_together([], 1, gpu_of, placement="first"), "binpack, spread"),
        (lambda: spread_apart([], -2, gpu_of), "size must be >= 0"),
    ],
)
def test_bad_arguments_raise_value_error(call: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()


@settings(max_examples=80, deadline=None)
@given(
    free=st.lists(st.integers(0, 12), min_size=1, max_size=6),
    size=st.integers(1, 20),
    spread=st.booleans(),
)
def test_shares_stay_on_one_unit_whenever_one_unit_can_hold_them(
    free: list[int], size: int, spread: bool
) -> None:
    available = [f"u{u}-{n}" for u, count in enumerate(free) for n in range(count)]
    random.Random(size).shuffle(available)  # the kubelet's order is random

    placed = place_together(available, size, gpu_of, placement="spread" if spread else "binpack")

    assert len(set(placed.device_ids)) == len(placed.device_ids) == min(size, len(available))
    assert set(placed.device_ids) <= set(available)
    if not available:
        assert placed.device_ids == ()
        return
    fitting = [c for c in free if c >= size]
    assert placed.together == (bool(fitting) or size >= len(available) == max(free))
    if fitting:
        assert placed.free[placed.units[0]] == (max(fitting) if spread else min(fitting))
    else:
        # Fewest units: no other choice of units could use fewer.
        needed = 0
        for i, count in enumerate(sorted(free, reverse=True), 1):
            needed += count
            if needed >= min(size, len(available)):
                assert len(set(placed.units)) == i
                break


def test_spread_apart_puts_each_share_on_a_different_unit_most_free_first() -> None:
    slices = [f"gpu{g}::{n}" for g in range(4) for n in range(4)]
    taken = {"gpu0::0", "gpu0::1", "gpu2::0"}
    available = [s for s in slices if s not in taken]

    placed = spread_apart(available, 2, lambda i: i.split("::")[0])

    assert placed.apart
    assert set(placed.units) == {"gpu1", "gpu3"}


def test_spread_apart_breaks_ties_by_link_score_to_the_units_already_chosen() -> None:
    slices = [f"gpu{g}::{n}" for g in range(8) for n in range(2)]
    unit = lambda i: i.split("::")[0]  # noqa: E731

    placed = spread_apart(slices, 4, unit, link_score=ISLANDS)

    # Four units of one NVLink island, every unit equally free.
    assert placed.apart
    assert len({int(u[3:]) // 4 for u in placed.units}) == 1


def test_spread_apart_keeps_must_include_and_avoids_its_unit() -> None:
    slices = [f"gpu{g}::{n}" for g in range(3) for n in range(4)]

    placed = spread_apart(slices, 3, lambda i: i.split("::")[0], must_include=["gpu1::2"])

    assert placed.device_ids[0] == "gpu1::2"
    assert placed.apart
    assert set(placed.units) == {"gpu0", "gpu1", "gpu2"}


def test_spread_apart_with_too_few_units_doubles_up_on_the_freest() -> None:
    placed = spread_apart(["g0-1", "g0-2", "g0-3", "g1-1"], 3, gpu_of)

    assert not placed.apart
    assert sorted(placed.units) == ["g0", "g0", "g1"]


# ----------------------------------------------------------------------------- message size


@settings(max_examples=100, deadline=None)
@given(
    device_id=st.text(st.characters(codec="utf-8", categories=["L", "N", "P"]), min_size=1),
    numa=st.lists(st.integers(0, 5000), max_size=3),
    health=st.sampled_from(list(Health)),
)
def test_entry_bytes_are_what_the_sdk_encodes(
    device_id: str, numa: list[int], health: Health
) -> None:
    device = Device(device_id, numa_nodes=tuple(numa))

    assert list_entry_bytes(device_id, numa, health) == len(
        convert.list_and_watch_entry(device, health)
    )


def test_message_bytes_add_up_and_count_unhealthy_as_asked() -> None:
    devices = [Device(f"d{i}", numa_nodes=(i % 2,)) for i in range(1000)]
    encoded = b"".join(convert.list_and_watch_entry(d, d.health) for d in devices)

    assert list_message_bytes(devices) == len(encoded)
    assert convert.decode_list_and_watch(encoded).devices[999].ID == "d999"
    assert list_message_bytes(devices, Health.UNHEALTHY) == len(encoded) + 2 * len(devices)


# ------------------------------------------------------------------ complete_preference


def test_preference_puts_must_include_first_then_the_choice_then_the_rest() -> None:
    available = ["w0", "w1", "w2", "w3"]
    assert complete_preference(available, ["w2"], 3, ["w3", "w1"]) == ["w2", "w3", "w1"]
    assert complete_preference(available, ["w2"], 3) == ["w2", "w0", "w1"]
    assert complete_preference(available, [], 2, ["w3"]) == ["w3", "w0"]


def test_preference_ignores_unavailable_and_repeated_choices() -> None:
    assert complete_preference(["w0", "w1", "w2"], [], 2, ["x", "w2", "w2", "w0"]) == ["w2", "w0"]
    assert complete_preference(["w0", "w0", "w1"], ["w1", "w1"], 3) == ["w1", "w0"]


def test_preference_orders_offered_must_include_ids_before_the_others() -> None:
    """The kubelet sends must-include IDs in both lists; one it did not offer comes last."""
    assert complete_preference(["w1", "w2"], ["w9", "w2"], 3) == ["w2", "w9", "w1"]


def test_preference_cuts_must_include_at_size_and_answers_nothing_for_no_size() -> None:
    assert complete_preference(["w0", "w1"], ["w1", "w0"], 1, ["w0"]) == ["w1"]
    assert complete_preference(["w0"], ["w0"], 0) == []
    assert complete_preference(["w0"], ["w0"], -1) == []
    assert complete_preference([], [], 2) == []


def test_preference_takes_a_dict_of_available_ids_as_it_is() -> None:
    available = dict.fromkeys(["w0", "w1", "w2"])
    assert complete_preference(available, [], 2, ["w2"]) == ["w2", "w0"]
    assert list(available) == ["w0", "w1", "w2"]


@settings(max_examples=200, deadline=None)
@given(
    available=st.lists(st.sampled_from([f"w{i}" for i in range(8)])),
    must=st.lists(st.sampled_from([f"w{i}" for i in range(10)]), max_size=3),
    choice=st.lists(st.sampled_from([f"w{i}" for i in range(10)])),
    size=st.integers(-1, 10),
)
def test_preference_is_always_a_valid_answer(
    available: list[str], must: list[str], choice: list[str], size: int
) -> None:
    answer = complete_preference(available, must, size, choice)
    pool = set(available) | set(must)
    assert len(answer) == len(set(answer)) == (max(0, min(size, len(pool))))
    assert set(answer) <= pool
    must_count = len(dict.fromkeys(must))
    assert set(answer[:must_count]) <= set(must)  # must-include IDs first
