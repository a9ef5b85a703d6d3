"""The engine's one health model (``_state.DeviceState``): the latest report wins, nothing sticks.

Reports come from discovery, polls and pushed events, and name a device or its parent. These
tests drive the state directly, as the engine does, and read what the kubelet would be sent.
"""

from __future__ import annotations

import logging

import pytest

from devplugin_sdk import Device, Health
from devplugin_sdk._engine.events import Events
from devplugin_sdk._engine.state import DeviceState
from devplugin_sdk.errors import UnknownDeviceError
from devplugin_sdk.types import HealthReport

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
