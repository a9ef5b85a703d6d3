"""The engine's one health model (``_state.DeviceState``): the latest report wins, nothing sticks.

Reports come from discovery, polls and pushed events, and name a device or its parent. These
tests drive the state directly, as the engine does, and read what the kubelet would be sent.
"""

from __future__ import annotations

import logging

import pytest

from devplugin_sdk import Device, Health
from devplugin_sdk._engine.conditions import Condition
from devplugin_sdk._engine.events import Events
from devplugin_sdk._engine.state import DeviceState
from devplugin_sdk.errors import UnknownDeviceError
from devplugin_sdk.types import Effect, HealthReport

H, U = Health.HEALTHY, Health.UNHEALTHY


def listed(state: DeviceState) -> dict[str, str]:
    """What the next ListAndWatch message says, by device ID."""
    snapshot = state.snapshot()
    from devplugin_sdk._wire import convert

    message = convert.decode_list_and_watch(snapshot.payload)
    return {d.id: d.health for d in convert.listed_devices(message)}


def test_discovered_unhealthy_is_cleared_by_a_later_healthy_event() -> None:
    """Discovery is only the first report: a pushed Healthy brings the device back."""
    state = DeviceState("example.com/w")
    state.set_devices([Device("a", health=U), Device("b")])
    assert listed(state) == {"a": "Unhealthy", "b": "Healthy"}
    assert state.report_health({"a": H}, "recovered") == ["a"]
    assert listed(state) == {"a": "Healthy", "b": "Healthy"}
    assert state.snapshot().healthy_count == 2


def test_discovered_unhealthy_is_cleared_by_a_later_poll() -> None:
    state = DeviceState("example.com/w")
    state.set_devices([Device("a", health=U)])
    state.report_health({"a": H}, "polled")
    assert listed(state) == {"a": "Healthy"}


def test_rescan_that_still_sees_healthy_keeps_a_pushed_fault() -> None:
    """A backend whose discovery cannot see a fault (an Xid) does not clear it by rescanning."""
    state = DeviceState("example.com/w")
    state.set_devices([Device("a"), Device("b")])
    state.report_health({"a": U}, "Xid 79")
    changed = state.set_devices([Device("a"), Device("b"), Device("c")])
    assert changed
    assert listed(state) == {"a": "Unhealthy", "b": "Healthy", "c": "Healthy"}


def test_rescan_that_sees_a_change_reports_it_both_ways() -> None:
    """Discovery's own view counts when it changes: Healthy -> Unhealthy -> Healthy."""
    state = DeviceState("example.com/w")
    state.set_devices([Device("a")])
    state.set_devices([Device("a", health=U)])
    assert listed(state) == {"a": "Unhealthy"}
    state.set_devices([Device("a", health=H)])
    assert listed(state) == {"a": "Healthy"}


def test_parent_report_speaks_for_children_and_clears_their_discovered_health() -> None:
    """Shares discovered Unhealthy (their path was missing) recover on one event for the parent."""
    state = DeviceState("example.com/w")
    state.set_devices([Device(f"p::{n}", health=U, parent="p") for n in range(3)])
    assert set(listed(state).values()) == {"Unhealthy"}
    flipped = state.report_health({"p": H}, "path is back")
    assert sorted(flipped) == ["p::0", "p::1", "p::2"]
    assert set(listed(state).values()) == {"Healthy"}


def test_a_newer_own_report_overrides_an_older_parent_report() -> None:
    state = DeviceState("example.com/w")
    state.set_devices([Device("gpu"), Device("mig-1", parent="gpu"), Device("mig-2", parent="gpu")])
    state.report_health({"gpu": U}, "Xid 79")
    assert listed(state) == {"gpu": "Unhealthy", "mig-1": "Unhealthy", "mig-2": "Unhealthy"}
    state.report_health({"mig-1": H}, "probe clean")
    assert listed(state) == {"gpu": "Unhealthy", "mig-1": "Healthy", "mig-2": "Unhealthy"}


def test_repeated_equal_reports_do_not_override_newer_ones() -> None:
    """A poll saying Healthy for the parent every interval does not clear a child's fault."""
    state = DeviceState("example.com/w")
    state.set_devices([Device("mig-1", parent="gpu"), Device("mig-2", parent="gpu")])
    state.report_health({"gpu": H}, "polled")  # equal to "no report": not a report
    state.report_health({"mig-1": U}, "Xid 94")
    state.report_health({"gpu": H}, "polled")
    assert listed(state) == {"mig-1": "Unhealthy", "mig-2": "Healthy"}


def test_new_child_of_a_faulted_parent_starts_unhealthy() -> None:
    state = DeviceState("example.com/w")
    state.set_devices([Device("p::0", parent="p")])
    state.report_health({"p": U}, "fault")
    state.set_devices([Device("p::0", parent="p"), Device("p::1", parent="p")])
    assert listed(state) == {"p::0": "Unhealthy", "p::1": "Unhealthy"}


def test_reports_for_unknown_ids_are_ignored_and_forgotten_ids_start_over() -> None:
    state = DeviceState("example.com/w")
    state.set_devices([Device("a")])
    assert state.report_health({"ghost": U}) == []
    state.report_health({"a": U})
    state.set_devices([])
    state.set_devices([Device("a")])  # a device that comes back is a new device
    assert listed(state) == {"a": "Healthy"}


def test_unchanged_list_is_not_a_new_version() -> None:
    state = DeviceState("example.com/w")
    assert state.set_devices([Device("a"), Device("b", health=U)])
    version = state.version
    assert not state.set_devices([Device("a"), Device("b", health=U)])
    assert state.report_health({"a": H}) == []
    assert state.version == version


def test_many_flips_at_once_are_logged_as_one_line(caplog: pytest.LogCaptureFixture) -> None:
    """A reload that drops 56 shares logs one summary, not 56 lines; a few flips log one each."""
    state = DeviceState("example.com/w")
    state.set_devices([Device(f"d{n}") for n in range(60)])
    with caplog.at_level(logging.INFO, logger="devplugin_sdk"):
        state.set_devices([Device(f"d{n}", health=U if n >= 4 else H) for n in range(60)])
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1
    assert lines[0].startswith("example.com/w: 56 devices are now Unhealthy (discovered): d10, ")
    assert lines[0].endswith("and 46 more")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="devplugin_sdk"):
        state.set_devices([Device(f"d{n}", health=U if n >= 2 else H) for n in range(60)])
    assert [r.getMessage() for r in caplog.records] == [
        "example.com/w: device d2 is now Unhealthy (discovered)",
        "example.com/w: device d3 is now Unhealthy (discovered)",
    ]


# ----------------------------------------------------------------------------- reasons


class Changes:
    """An observer that records ``health_changed`` calls."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, Health | None, str]] = []

    def health_changed(
        self, resource: str, device: str, health: Health | None, reason: str
    ) -> None:
        self.seen.append((device, health, reason))


def test_each_change_goes_to_the_observer_and_the_log_once_with_its_reason(
    caplog: pytest.LogCaptureFixture,
) -> None:
    changes = Changes()
    state = DeviceState("example.com/w", events=Events(changes))
    state.set_devices([Device("gpu"), *(Device(f"gpu::{n}", parent="gpu") for n in range(2))])
    with caplog.at_level(logging.INFO, logger="devplugin_sdk"):
        state.report_health({"gpu": U}, "Xid 79 (GPU has fallen off the bus)")
        state.report_health({"gpu": U}, "Xid 79 again")  # no change: no line, no call
        state.report_health(
            HealthReport({"gpu::0": H, "gpu::1": U}, {"gpu::0": "recovered: clean for 60 s"}),
            "polled",
        )

    why = "Xid 79 (GPU has fallen off the bus)"
    assert changes.seen == [
        ("gpu", U, why),
        ("gpu::0", U, why),
        ("gpu::1", U, why),
        ("gpu::0", H, "recovered: clean for 60 s"),
    ]
    assert [r.getMessage() for r in caplog.records] == [
        f"example.com/w: device gpu is now Unhealthy ({why})",
        f"example.com/w: device gpu::0 is now Unhealthy ({why})",
        f"example.com/w: device gpu::1 is now Unhealthy ({why})",
        "example.com/w: device gpu::0 is now Healthy (recovered: clean for 60 s)",
    ]


def test_a_report_without_a_reason_for_a_key_uses_the_callers() -> None:
    changes = Changes()
    state = DeviceState("example.com/w", events=Events(changes))
    state.set_devices([Device("a"), Device("b")])

    state.report_health(HealthReport({"a": U, "b": U}, {"a": "row remapping pending"}), "polled")

    assert changes.seen == [("a", U, "row remapping pending"), ("b", U, "polled")]


def test_discovery_changes_and_removals_reach_the_observer() -> None:
    changes = Changes()
    state = DeviceState("example.com/w", events=Events(changes))
    state.set_devices([Device("a"), Device("b", health=U)])
    state.set_devices([Device("a", health=U)])

    assert changes.seen == [
        ("b", U, "discovered"),
        ("a", U, "discovered"),
        ("b", None, "removed"),
    ]


def test_a_health_report_is_a_mapping_of_health() -> None:
    report = HealthReport({"a": "Unhealthy"}, {"a": "Xid 48"})

    assert report == {"a": U}
    assert report["a"] is U
    assert report.get("b") is None
    assert report.reasons == {"a": "Xid 48"}
    with pytest.raises(ValueError, match="'sick' is not a valid Health"):
        HealthReport({"a": "sick"})  # type: ignore[dict-item]


def test_devices_left_to_dra_are_neither_listed_nor_allocatable() -> None:
    state = DeviceState("example.com/w")
    state.set_devices([Device("a"), Device("b")])
    before = state.devices_version
    state.list_only(lambda device: device.id == "a")
    assert list(state.by_id) == ["a"]
    assert [d.id for d in state.snapshot().devices] == ["a"]
    assert state.devices_version != before  # cached Allocate answers are dropped
    with pytest.raises(UnknownDeviceError):
        state.lookup(["b"])
    state.list_only(None)
    assert list(state.by_id) == ["a", "b"]


# ----------------------------------------------------------------------------- conditions


class Clocks:
    """The state's monotonic and wall clocks, moved by hand."""

    def __init__(self) -> None:
        self.now = 100.0
        self.wall_now = 1_800_000_000.0

    def clock(self) -> float:
        return self.now

    def wall(self) -> float:
        return self.wall_now

    def advance(self, seconds: float) -> None:
        self.now += seconds
        self.wall_now += seconds


def conditioned(clocks: Clocks, hold: float = 60.0) -> DeviceState:
    state = DeviceState("example.com/w", clock=clocks.clock, wall=clocks.wall, advisory_hold=hold)
    state.set_devices([Device("gpu"), *(Device(f"gpu::{n}", parent="gpu") for n in range(2))])
    return state


def test_an_unhealthy_report_is_no_schedule_with_its_reason_and_start() -> None:
    clocks = Clocks()
    state = conditioned(clocks)
    assert state.condition_of("gpu::0") == Condition(H)
    state.report_health({"gpu": U}, "Xid 48 (double-bit ECC error)")
    for device in ("gpu", "gpu::0", "gpu::1"):  # the parent's report is every share's
        assert state.condition_of(device) == Condition(
            U, Effect.NO_SCHEDULE, "Xid 48 (double-bit ECC error)", clocks.wall_now
        )


def test_a_condition_keeps_its_first_reason_and_start_while_it_lasts() -> None:
    """A DRA taint's timeAdded stays while the taint does: another report of the same health
    and effect changes nothing, an escalation is a new condition."""
    clocks = Clocks()
    state = conditioned(clocks)
    changes: list[int] = []
    state.subscribe(lambda: changes.append(1))
    state.report_health({"gpu": U}, "Xid 48")
    started = clocks.wall_now
    clocks.advance(30)
    state.report_health({"gpu::0": U}, "polled: still bad")
    assert state.condition_of("gpu::0") == Condition(U, Effect.NO_SCHEDULE, "Xid 48", started)
    before = len(changes)
    state.report_health({"gpu": U}, "Xid 79", {"gpu": Effect.NO_EXECUTE})
    assert state.condition_of("gpu::1") == Condition(
        U, Effect.NO_EXECUTE, "Xid 79", clocks.wall_now
    )
    assert len(changes) == before + 1  # the listeners (DRA) hear an escalation
    assert listed(state) == {"gpu": "Unhealthy", "gpu::0": "Unhealthy", "gpu::1": "Unhealthy"}


def test_an_advisory_leaves_listandwatch_alone_and_polls_do_not_clear_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clocks = Clocks()
    state = conditioned(clocks)
    state.report_health({"gpu": H}, "polled")
    version = state.version
    with caplog.at_level(logging.INFO, logger="devplugin_sdk"):
        state.report_health({"gpu": H}, "Xid 43 (GPU stopped processing)", {"gpu": Effect.ADVISORY})
    assert state.version == version  # no ListAndWatch message
    assert listed(state) == {"gpu": "Healthy", "gpu::0": "Healthy", "gpu::1": "Healthy"}
    advised = Condition(H, Effect.ADVISORY, "Xid 43 (GPU stopped processing)", clocks.wall_now)
    assert [state.condition_of(d) for d in ("gpu", "gpu::0", "gpu::1")] == [advised] * 3
    assert "example.com/w: device gpu::1 has an advisory (Xid 43 (GPU stopped processing))" in [
        r.getMessage() for r in caplog.records
    ]
    state.report_health({"gpu": H, "gpu::0": H}, "polled")  # a poll says Healthy, as ever
    assert state.condition_of("gpu::1") == advised
    # gpu::0's first own report is newer than the parent's advisory: it supersedes it.
    assert state.condition_of("gpu::0") == Condition(H)


def test_an_advisory_ends_after_its_hold_and_a_repeat_extends_it() -> None:
    clocks = Clocks()
    state = conditioned(clocks, hold=60)
    state.report_health({"gpu": H}, "Xid 13", {"gpu": Effect.ADVISORY})
    started = clocks.wall_now
    clocks.advance(50)
    assert state.expire_advice() == pytest.approx(clocks.now + 10)
    state.report_health({"gpu": H}, "Xid 13", {"gpu": Effect.ADVISORY})  # again: 60 s more
    assert state.condition_of("gpu").since == started  # the same advisory, the same start
    clocks.advance(50)
    assert state.expire_advice() == pytest.approx(clocks.now + 10)
    assert state.condition_of("gpu").effect is Effect.ADVISORY
    clocks.advance(10)
    assert state.expire_advice() is None
    assert state.condition_of("gpu") == Condition(H)


def test_recovery_clears_the_fault_and_any_advisory_before_it() -> None:
    clocks = Clocks()
    state = conditioned(clocks)
    state.report_health({"gpu": H}, "Xid 43", {"gpu": Effect.ADVISORY})
    state.report_health({"gpu": U}, "Xid 79")
    assert state.condition_of("gpu::0").effect is Effect.NO_SCHEDULE
    state.report_health({"gpu": H}, "recovered")
    assert [state.condition_of(d) for d in ("gpu", "gpu::0", "gpu::1")] == [Condition(H)] * 3


def test_a_retired_device_is_no_schedule() -> None:
    state = DeviceState("example.com/w")
    state.set_devices([Device("a"), Device("old")], retired=["old"])
    condition = state.condition_of("old")
    assert (condition.health, condition.effect) == (U, Effect.NO_SCHEDULE)
    assert condition.reason.startswith("retired")


def test_an_effect_must_go_with_its_health() -> None:
    from devplugin_sdk import HealthEvent

    with pytest.raises(ValueError, match="effect None does not go with Unhealthy"):
        HealthEvent("gpu", Health.UNHEALTHY, "x", Effect.ADVISORY)
    with pytest.raises(ValueError, match="effect NoSchedule does not go with Healthy"):
        HealthReport({"gpu": H}, effects={"gpu": Effect.NO_SCHEDULE})
    with pytest.raises(ValueError, match="which has no health"):
        HealthReport({"gpu": H}, effects={"other": Effect.ADVISORY})
