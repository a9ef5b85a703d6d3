"""NVML health: Xid/ECC events pushed as they happen, probes, recovery, replicas and MIG siblings."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import pytest
from prometheus_client import CollectorRegistry

from devplugin_sdk.backends.nvidia import NvidiaConfig, NvmlPlugin
from devplugin_sdk.metrics import PrometheusObserver
from devplugin_sdk.testing import FakeKubelet, fake_nvml, serving, watching
from devplugin_sdk.testing.fake_nvml import FakeNVML
from devplugin_sdk.types import Device, Effect, Health, HealthEvent, HealthReport

NEVER = 3600.0  # a probe interval that never comes round within a test
XID_79 = "Xid 79 (GPU has fallen off the bus)"


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def plugin_for(
    nvml: FakeNVML, tmp_path: Path, clock: Clock | None = None, **config: Any
) -> NvmlPlugin:
    roots = nvml.write_host(tmp_path)
    config.setdefault("probe_interval", NEVER)
    cfg = NvidiaConfig(
        sysfs_root=roots.sysfs_root, dev_root=roots.dev_root, proc_root=roots.proc_root, **config
    )
    return NvmlPlugin(cfg, nvml=nvml, clock=clock or Clock())


async def armed(nvml: FakeNVML) -> None:
    """Return once ``watch()`` waits in the fake NVML's event set (a thread the event loop does
    not see)."""
    assert await anyio.to_thread.run_sync(nvml.wait_for_waiters, 1, 5.0)


# ----------------------------------------------------------------------------- pushed events


async def test_xid_79_is_pushed_the_moment_nvml_reports_it(tmp_path: Path) -> None:
    nvml = fake_nvml.dgx_a100()
    plugin = plugin_for(nvml, tmp_path)
    await plugin.discover()

    async with watching(plugin) as events:
        await armed(nvml)
        nvml.xid(3, 79)
        event = await events.next_event()

    assert event == HealthEvent(nvml.gpus[3].uuid, Health.UNHEALTHY, XID_79, Effect.NO_EXECUTE)


async def test_application_xids_leave_the_gpu_healthy_by_default(tmp_path: Path) -> None:
    nvml = fake_nvml.t4_pcie()
    plugin = plugin_for(nvml, tmp_path)
    await plugin.discover()

    async with watching(plugin) as events:
        await armed(nvml)
        for xid in (13, 31, 43, 45, 68, 109):
            nvml.xid(0, xid)
        nvml.xid(1, 48)
        got = [await events.next_event() for _ in range(6)]

    # Five advisories (Healthy: the GPU works), none for 109 (in the default ignoredXids), then
    # the double-bit ECC Xid on GPU 1.
    gpu0 = nvml.gpus[0].uuid
    assert [(e.device_id, e.health, e.effect) for e in got[:5]] == [  # type: ignore[union-attr]
        (gpu0, Health.HEALTHY, Effect.ADVISORY)
    ] * 5
    assert [e.reason.split(" (")[0] for e in got[:5]] == [  # type: ignore[union-attr]
        "Xid 13",
        "Xid 31",
        "Xid 43",
        "Xid 45",
        "Xid 68",
    ]
    assert got[5] == HealthEvent(
        nvml.gpus[1].uuid, Health.UNHEALTHY, "Xid 48 (double-bit ECC error)"
    )


async def test_the_ignored_xid_list_is_configurable(tmp_path: Path) -> None:
    nvml = fake_nvml.t4_pcie()
    plugin = plugin_for(nvml, tmp_path, ignored_xids=frozenset({79}))
    await plugin.discover()

    async with watching(plugin) as events:
        await armed(nvml)
        nvml.xid(0, 79)
        nvml.xid(2, 95)
        event = await events.next_event()

    assert isinstance(event, HealthEvent)
    assert (event.device_id, event.reason) == (nvml.gpus[2].uuid, "Xid 95 (uncontained ECC error)")


async def test_double_bit_ecc_event_marks_the_gpu_unhealthy(tmp_path: Path) -> None:
    nvml = fake_nvml.hgx_h100()
    plugin = plugin_for(nvml, tmp_path)
    await plugin.discover()

    async with watching(plugin) as events:
        await armed(nvml)
        nvml.ecc_double_bit(6)
        event = await events.next_event()

    assert event == HealthEvent(nvml.gpus[6].uuid, Health.UNHEALTHY, "double-bit ECC error")


async def test_an_xid_from_a_gpu_that_fell_off_the_bus_is_still_attributed(tmp_path: Path) -> None:
    nvml = fake_nvml.dgx_a100()
    plugin = plugin_for(nvml, tmp_path)
    await plugin.discover()

    async with watching(plugin) as events:
        await armed(nvml)
        nvml.lose(5)  # nvmlDeviceGetUUID on its handle now fails: the handle itself identifies it
        nvml.xid(5, 79)
        event = await events.next_event()

    # Attributed to the Xid itself, not found later by a probe.
    assert event == HealthEvent(nvml.gpus[5].uuid, Health.UNHEALTHY, XID_79, Effect.NO_EXECUTE)


async def test_a_failed_event_wait_opens_the_event_set_again(tmp_path: Path) -> None:
    nvml = fake_nvml.dgx_a100()
    plugin = plugin_for(nvml, tmp_path, probe_interval=0.01)
    await plugin.discover()
    nvml.fail("nvmlEventSetWait_v2", fake_nvml.NVML_ERROR_UNKNOWN)  # the first wait fails

    # `armed` returns once a wait is under way: on a second event set.
    async with watching(plugin) as events:
        await armed(nvml)
        nvml.xid(2, 79)
        event = await events.next_event()

    assert nvml.calls["nvmlEventSetCreate"] == 2
    assert event == HealthEvent(nvml.gpus[2].uuid, Health.UNHEALTHY, XID_79, Effect.NO_EXECUTE)


async def test_a_gpu_wide_xid_reaches_every_replica(tmp_path: Path) -> None:
    nvml = fake_nvml.t4_pcie()
    plugin = plugin_for(nvml, tmp_path, replicas=4)
    await plugin.discover()

    async with watching(plugin) as events:
        await armed(nvml)
        nvml.xid(1, 79)
        got = [await events.next_event() for _ in range(4)]

    assert got == [
        HealthEvent(f"{nvml.gpus[1].uuid}::{n}", Health.UNHEALTHY, XID_79, Effect.NO_EXECUTE)
        for n in range(4)
    ]


async def test_a_gpu_wide_xid_reaches_every_mig_device_of_that_gpu(tmp_path: Path) -> None:
    nvml = fake_nvml.a100_mig([("1g.10gb",) * 3, ("1g.10gb",) * 3])
    plugin = plugin_for(nvml, tmp_path, mig_strategy="single")
    await plugin.discover()

    async with watching(plugin) as events:
        await armed(nvml)
        nvml.xid(0, 79)
        got = [await events.next_event() for _ in range(3)]

    assert [e.device_id for e in got if isinstance(e, HealthEvent)] == [
        m.uuid for m in nvml.gpus[0].migs
    ]


async def test_an_xid_in_one_mig_instance_marks_only_that_mig_device(tmp_path: Path) -> None:
    nvml = fake_nvml.a100_mig([("1g.10gb",) * 3])
    plugin = plugin_for(nvml, tmp_path, mig_strategy="single", replicas=2)
    devices = await plugin.discover()
    target = nvml.gpus[0].migs[1]

    async with watching(plugin) as events:
        await armed(nvml)
        nvml.xid(0, 94, gi=target.gi, ci=target.ci)
        got = [await events.next_event() for _ in range(2)]
        nvml.xid(0, 79)  # the next events are the GPU-wide fault's: nothing else came between
        assert await events.next_event() == HealthEvent(
            devices[0].id,
            Health.UNHEALTHY,
            "Xid 79 (GPU has fallen off the bus)",
            Effect.NO_EXECUTE,
        )

    # Both replicas of the MIG device (whose parent is the GPU, not the MIG device).
    assert {e.device_id for e in got if isinstance(e, HealthEvent)} == {
        f"{target.uuid}::0",
        f"{target.uuid}::1",
    }
    health = await plugin.check_health(devices)
    assert [d.id for d in devices if health[d.id] is Health.HEALTHY] == []


async def test_a_mig_device_stays_unhealthy_while_its_own_fault_lasts_after_its_gpu_recovers(
    tmp_path: Path,
) -> None:
    nvml = fake_nvml.a100_mig([("1g.10gb",) * 2])
    clock = Clock()
    plugin = plugin_for(nvml, tmp_path, clock, mig_strategy="single", recovery_period=60)
    devices = await plugin.discover()
    well, sick = devices
    target = nvml.gpus[0].migs[1]
    async with watching(plugin) as events:
        await armed(nvml)
        nvml.xid(0, 79)  # the GPU first
        assert [await events.next_event() for _ in range(2)] == [
            HealthEvent(d.id, Health.UNHEALTHY, XID_79, Effect.NO_EXECUTE) for d in devices
        ]
        clock.now += 30
        nvml.xid(0, 94, gi=target.gi, ci=target.ci)  # then one of its MIG instances
        assert await events.next_event() == HealthEvent(
            sick.id, Health.UNHEALTHY, "Xid 94 (contained ECC error)"
        )

    clock.now += 30  # the GPU's fault is 60 s old, the MIG instance's 30 s
    assert await plugin.check_health(devices) == {
        well.id: Health.HEALTHY,
        sick.id: Health.UNHEALTHY,
    }
    clock.now += 30
    assert await plugin.check_health(devices) == {
        well.id: Health.HEALTHY,
        sick.id: Health.HEALTHY,
    }


async def test_an_xid_in_another_resources_mig_instance_is_not_ours(tmp_path: Path) -> None:
    nvml = fake_nvml.a100_mig([("2g.20gb", "1g.10gb")])
    plugin = NvmlPlugin(
        NvidiaConfig(
            mig_strategy="mixed",
            probe_interval=NEVER,
            proc_root=nvml.write_host(tmp_path).proc_root,
            dev_root=tmp_path / "dev",
            sysfs_root=tmp_path / "sys",
        ),
        nvml=nvml,
        mig_profile="1g.10gb",
    )
    await plugin.discover()
    other, mine = nvml.gpus[0].migs

    async with watching(plugin) as events:
        await armed(nvml)
        nvml.xid(0, 94, gi=other.gi, ci=other.ci)
        nvml.xid(0, 94, gi=mine.gi, ci=mine.ci)
        event = await events.next_event()

    assert isinstance(event, HealthEvent)
    assert event.device_id == mine.uuid


def test_real_pynvml_handles_of_one_gpu_are_recognised_by_address() -> None:
    # Each nvmlEventSetWait_v2 result carries a new ctypes pointer object for the same GPU.
    import ctypes

    import pynvml

    from devplugin_sdk.backends.nvidia.events import _handle_key

    def handle(address: int) -> object:
        return ctypes.cast(ctypes.c_void_p(address), pynvml.c_nvmlDevice_t)

    assert _handle_key(handle(0x7F00)) == _handle_key(handle(0x7F00))
    assert _handle_key(handle(0x7F00)) != _handle_key(handle(0x7F08))


# ----------------------------------------------------------------------------- probes and recovery


async def test_a_lost_gpu_is_found_by_the_probe_without_any_event(tmp_path: Path) -> None:
    nvml = fake_nvml.t4_pcie()
    plugin = plugin_for(nvml, tmp_path)
    devices = await plugin.discover()
    nvml.lose(2)

    health = await plugin.check_health(devices)

    assert health == {
        g.uuid: Health.UNHEALTHY if g.index == 2 else Health.HEALTHY for g in nvml.gpus
    }


async def test_a_gpu_recovers_after_probing_clean_for_the_recovery_period(tmp_path: Path) -> None:
    nvml = fake_nvml.dgx_a100()
    clock = Clock()
    plugin = plugin_for(nvml, tmp_path, clock, recovery_period=60)
    devices = await plugin.discover()
    uuid = nvml.gpus[3].uuid
    async with watching(plugin) as events:
        await armed(nvml)
        nvml.xid(3, 79)
        await events.next_event()

    clock.now += 59
    assert (await plugin.check_health(devices))[uuid] is Health.UNHEALTHY
    clock.now += 1
    assert (await plugin.check_health(devices))[uuid] is Health.HEALTHY


async def test_a_failed_probe_restarts_the_recovery_period(tmp_path: Path) -> None:
    nvml = fake_nvml.t4_pcie()
    clock = Clock()
    plugin = plugin_for(nvml, tmp_path, clock, recovery_period=60)
    devices = await plugin.discover()
    uuid = nvml.gpus[0].uuid

    nvml.lose(0)
    assert (await plugin.check_health(devices))[uuid] is Health.UNHEALTHY
    clock.now += 30
    assert (await plugin.check_health(devices))[uuid] is Health.UNHEALTHY  # still lost at 30 s
    nvml.recover(0)
    clock.now += 59
    assert (await plugin.check_health(devices))[uuid] is Health.UNHEALTHY
    clock.now += 1
    assert (await plugin.check_health(devices))[uuid] is Health.HEALTHY


async def test_a_null_recovery_period_never_recovers(tmp_path: Path) -> None:
    nvml = fake_nvml.t4_pcie()
    clock = Clock()
    plugin = plugin_for(nvml, tmp_path, clock, recovery_period=None)
    devices = await plugin.discover()
    nvml.lose(0)
    await plugin.check_health(devices)
    nvml.recover(0)

    clock.now += 1e9

    assert (await plugin.check_health(devices))[nvml.gpus[0].uuid] is Health.UNHEALTHY


async def test_the_probe_is_polled_on_the_probe_interval_and_never_run_by_watch(
    tmp_path: Path,
) -> None:
    nvml = fake_nvml.t4_pcie()
    plugin = plugin_for(nvml, tmp_path, probe_interval=0.01)
    await plugin.discover()
    probes = nvml.calls["nvmlDeviceGetMemoryInfo"]

    async with watching(plugin) as events:
        await armed(nvml)
        nvml.lose(3)
        nvml.xid(0, 79)
        event = await events.next_event()

    assert plugin.health_interval == 0.01
    assert event == HealthEvent(nvml.gpus[0].uuid, Health.UNHEALTHY, XID_79, Effect.NO_EXECUTE)
    assert nvml.calls["nvmlDeviceGetMemoryInfo"] == probes


async def test_a_gpu_unhealthy_at_discovery_is_healthy_again_once_it_probes_clean(
    tmp_path: Path,
) -> None:
    nvml = fake_nvml.t4_pcie()
    plugin = plugin_for(nvml, tmp_path, recovery_period=0)
    await plugin.discover()
    nvml.lose(1)
    devices = await plugin.discover()
    assert devices[1].health is Health.UNHEALTHY
    assert (await plugin.check_health(devices))[devices[1].id] is Health.UNHEALTHY

    nvml.recover(1)

    assert (await plugin.check_health(devices))[devices[1].id] is Health.HEALTHY
    # No rescan needed: the engine clears the discovered Unhealthy on this report.
    assert (await plugin.discover())[1].health is Health.HEALTHY


async def test_a_gpu_that_could_not_register_for_events_registers_once_back(
    tmp_path: Path,
) -> None:
    nvml = fake_nvml.t4_pcie()
    plugin = plugin_for(nvml, tmp_path, probe_interval=0.01)
    await plugin.discover()
    uuid = nvml.gpus[1].uuid
    nvml.lose(1)

    async with watching(plugin) as events:
        await armed(nvml)
        nvml.recover(1)
        assert await anyio.to_thread.run_sync(nvml.wait_for_waiters, 1, 5.0, 1)
        nvml.xid(1, 79)
        event = await events.next_event()

    assert event == HealthEvent(uuid, Health.UNHEALTHY, XID_79, Effect.NO_EXECUTE)


async def test_the_engine_clears_a_discovered_fault_on_the_polled_recovery(
    tmp_path: Path,
) -> None:
    nvml = fake_nvml.t4_pcie()
    plugin = plugin_for(nvml, tmp_path, probe_interval=0.01, recovery_period=0)
    await plugin.discover()
    nvml.lose(2)  # unreadable at the next discovery: listed Unhealthy by discovery itself
    uuid = nvml.gpus[2].uuid

    async with FakeKubelet() as kubelet, serving(plugin, settings=kubelet.settings()):
        await kubelet.wait_for_health("nvidia.com/gpu", uuid, "Unhealthy")
        assert kubelet.allocatable("nvidia.com/gpu") == 3
        nvml.recover(2)
        await kubelet.wait_for_allocatable("nvidia.com/gpu", 4)


async def test_gpus_without_event_support_are_still_probed(tmp_path: Path) -> None:
    nvml = fake_nvml.t4_pcie()
    nvml.gpus[0].supported_events = 0
    plugin = plugin_for(nvml, tmp_path)
    devices = await plugin.discover()

    async with watching(plugin) as events:
        await armed(nvml)
        nvml.xid(0, 79)  # not delivered: GPU 0 could not register
        nvml.xid(1, 79)
        event = await events.next_event()
    nvml.lose(0)

    assert isinstance(event, HealthEvent)
    assert event.device_id == nvml.gpus[1].uuid
    assert (await plugin.check_health(devices))[nvml.gpus[0].uuid] is Health.UNHEALTHY


async def test_disabled_health_reports_nothing_and_watches_nothing(tmp_path: Path) -> None:
    nvml = fake_nvml.t4_pcie()
    plugin = plugin_for(nvml, tmp_path, health_disabled=True)
    devices = await plugin.discover()
    nvml.lose(0)

    assert await plugin.check_health(devices) == {}
    assert [e async for e in plugin.watch()] == []
    assert nvml.calls["nvmlEventSetCreate"] == 0


@pytest.mark.parametrize("xid", [79, 48])
async def test_one_failed_gpu_leaves_allocation_of_the_others_untouched(
    tmp_path: Path, xid: int
) -> None:
    nvml = fake_nvml.dgx_a100()
    plugin = plugin_for(nvml, tmp_path)
    devices = await plugin.discover()
    async with watching(plugin) as events:
        await armed(nvml)
        nvml.xid(4, xid)
        nvml.lose(4)
        await events.next_event()
    others = [d for d in devices if d.attributes["index"] != 4]

    chosen = await plugin.preferred_allocation(others, [], 4)
    allocation = await plugin.allocate([d for d in others if d.id in chosen])

    assert len(allocation.env["NVIDIA_VISIBLE_DEVICES"].split(",")) == 4


# ----------------------------------------------------------------------------- the GPU health rules
# docs/backends.md, "GPU health": one test per row of the table.

RECOVERY = 60.0


async def probe(plugin: NvmlPlugin, devices: Sequence[Device]) -> HealthReport:
    report = await plugin.check_health(devices)
    assert isinstance(report, HealthReport)
    return report


def out(report: HealthReport) -> dict[str, str]:
    """The devices the report says are Unhealthy, with why."""
    return {i: report.reasons[i] for i, h in report.items() if h is Health.UNHEALTHY}


async def test_an_xid_with_rising_ecc_is_not_declared_healthy_while_the_ecc_rises(
    tmp_path: Path,
) -> None:
    """The issue's A100: Xid 79, then uncorrected ECC errors rising on every read."""
    nvml = fake_nvml.dgx_a100()
    clock = Clock()
    plugin = plugin_for(nvml, tmp_path, clock, recovery_period=RECOVERY)
    devices = await plugin.discover()
    gpu3 = nvml.gpus[3].uuid
    await probe(plugin, devices)  # the ECC baseline
    async with watching(plugin) as events:
        await armed(nvml)
        nvml.xid(3, 79)
        nvml.ecc_uncorrected(3, 2)
        assert await events.next_event() == HealthEvent(
            gpu3, Health.UNHEALTHY, XID_79, Effect.NO_EXECUTE
        )

    for _ in range(5):  # well past the recovery period, the GPU still answers every query
        clock.now += RECOVERY * 2
        report = await probe(plugin, devices)
        assert list(out(report)) == [gpu3]
    assert out(report)[gpu3] == XID_79  # out for what took it out first
    nvml.clear(3)
    clock.now += RECOVERY - 1
    assert list(out(await probe(plugin, devices))) == [gpu3]
    clock.now += 1
    report = await probe(plugin, devices)

    assert out(report) == {}
    assert report.reasons[gpu3] == f"recovered: probed clean for 60 s (out since {XID_79})"


async def test_rising_ecc_without_any_event_is_a_fault_of_its_own(tmp_path: Path) -> None:
    nvml = fake_nvml.dgx_a100()
    clock = Clock()
    plugin = plugin_for(nvml, tmp_path, clock, recovery_period=RECOVERY)
    devices = await plugin.discover()
    gpu5 = nvml.gpus[5].uuid
    await probe(plugin, devices)

    nvml.ecc_uncorrected(5, 3)
    first = out(await probe(plugin, devices))
    clock.now += RECOVERY
    second = out(await probe(plugin, devices))

    assert first == {gpu5: "uncorrected ECC errors rising: 0 -> 6 (volatile count)"}
    assert list(second) == [gpu5]
    nvml.clear(5)  # the counter stays at its new value: not rising is clean
    clock.now += RECOVERY
    assert out(await probe(plugin, devices)) == {}


async def test_the_first_probe_takes_the_ecc_count_as_it_finds_it(tmp_path: Path) -> None:
    """Errors from before the plugin started, and a count a reset took back to 0, are clean."""
    nvml = fake_nvml.t4_pcie()
    nvml.ecc_uncorrected(0, 7, rising=False)
    plugin = plugin_for(nvml, tmp_path, recovery_period=RECOVERY)
    devices = await plugin.discover()

    assert out(await probe(plugin, devices)) == {}
    nvml.reset(0)
    assert out(await probe(plugin, devices)) == {}


async def test_a_lost_gpu_stays_out_until_it_answers_then_for_the_recovery_period(
    tmp_path: Path,
) -> None:
    nvml = fake_nvml.dgx_a100()
    clock = Clock()
    plugin = plugin_for(nvml, tmp_path, clock, recovery_period=RECOVERY)
    devices = await plugin.discover()
    gpu2 = nvml.gpus[2].uuid
    nvml.lose(2)

    report = await probe(plugin, devices)
    for _ in range(3):
        clock.now += RECOVERY * 10
        assert list(out(await probe(plugin, devices))) == [gpu2]
    nvml.recover(2)
    clock.now += RECOVERY - 1
    assert list(out(await probe(plugin, devices))) == [gpu2]
    clock.now += 1

    assert out(report) == {
        gpu2: "GPU lost: NVML answered 'GPU is lost' to nvmlDeviceGetHandleByUUID "
        "(fallen off the bus?)"
    }
    assert out(await probe(plugin, devices)) == {}


async def test_a_pending_row_remapping_is_a_fault_until_a_reset_applies_it(
    tmp_path: Path,
) -> None:
    nvml = fake_nvml.hgx_h100()
    clock = Clock()
    plugin = plugin_for(nvml, tmp_path, clock, recovery_period=RECOVERY)
    devices = await plugin.discover()
    gpu1 = nvml.gpus[1].uuid
    nvml.remap_rows(1, 2)

    report = await probe(plugin, devices)
    clock.now += RECOVERY * 10
    assert list(out(await probe(plugin, devices))) == [gpu1]
    nvml.reset(1)
    clock.now += RECOVERY

    assert out(report) == {
        gpu1: "row remapping pending: a GPU reset applies it "
        "(2 rows remapped for uncorrectable errors)"
    }
    assert out(await probe(plugin, devices)) == {}


async def test_a_failed_row_remapping_keeps_the_gpu_out_after_a_reset(tmp_path: Path) -> None:
    nvml = fake_nvml.dgx_a100()
    clock = Clock()
    plugin = plugin_for(nvml, tmp_path, clock, recovery_period=RECOVERY)
    devices = await plugin.discover()
    nvml.remap_rows(6, failed=True)
    await probe(plugin, devices)
    nvml.reset(6)

    clock.now += RECOVERY * 100
    report = await probe(plugin, devices)

    assert list(out(report)) == [nvml.gpus[6].uuid]
    assert out(report)[nvml.gpus[6].uuid].startswith(
        "row remapping failed: the GPU needs service (1 rows remapped for uncorrectable errors); "
        "row remapping pending"  # both found by the first probe, which took it out
    )


async def test_pending_retired_pages_are_a_fault_until_a_reset(tmp_path: Path) -> None:
    nvml = fake_nvml.t4_pcie()
    clock = Clock()
    plugin = plugin_for(nvml, tmp_path, clock, recovery_period=RECOVERY)
    devices = await plugin.discover()
    nvml.retire_pages(3)

    report = await probe(plugin, devices)
    nvml.reset(3)
    clock.now += RECOVERY

    assert out(report) == {
        nvml.gpus[3].uuid: "retired pages pending: a reboot or GPU reset retires them"
    }
    assert out(await probe(plugin, devices)) == {}


@pytest.mark.parametrize(
    "code", [fake_nvml.NVML_ERROR_NOT_SUPPORTED, fake_nvml.NVML_ERROR_FUNCTION_NOT_FOUND]
)
async def test_a_getter_that_gives_no_signal_never_marks_a_gpu_out(
    tmp_path: Path, code: int
) -> None:
    """T4, L40S, consumer boards: ECC off or absent, no row remapping, an older driver."""
    nvml = fake_nvml.t4_pcie()
    nvml.gpus[0].ecc = False
    plugin = plugin_for(nvml, tmp_path, recovery_period=RECOVERY)
    devices = await plugin.discover()
    for getter in (
        "nvmlDeviceGetTotalEccErrors",
        "nvmlDeviceGetRemappedRows",
        "nvmlDeviceGetRetiredPagesPendingStatus",
    ):
        nvml.fail(getter, code, times=None)

    reports = [await probe(plugin, devices) for _ in range(3)]

    assert [out(r) for r in reports] == [{}, {}, {}]
    assert nvml.calls["nvmlDeviceGetRemappedRows"] == 4 * 3


async def test_any_other_nvml_error_from_a_health_query_is_a_fault(tmp_path: Path) -> None:
    nvml = fake_nvml.dgx_a100()
    plugin = plugin_for(nvml, tmp_path, recovery_period=RECOVERY)
    devices = await plugin.discover()
    nvml.fail("nvmlDeviceGetRemappedRows", fake_nvml.NVML_ERROR_UNKNOWN)

    report = await probe(plugin, devices)

    # The first GPU probed (by UUID) met the failure; the others answered.
    assert out(report) == {
        min(g.uuid for g in nvml.gpus): "NVML error: NVML answered 'Unknown Error' to "
        "nvmlDeviceGetRemappedRows"
    }


async def test_rising_ecc_under_mig_takes_out_every_mig_device_of_that_gpu(
    tmp_path: Path,
) -> None:
    """Memory health is the whole GPU's; NVML has no remapped rows with MIG instances."""
    nvml = fake_nvml.a100_mig([("1g.10gb",) * 3, ("1g.10gb",) * 3])
    plugin = plugin_for(nvml, tmp_path, mig_strategy="single", recovery_period=RECOVERY)
    devices = await plugin.discover()
    await probe(plugin, devices)

    nvml.ecc_uncorrected(1, 1)
    report = await probe(plugin, devices)

    assert sorted(out(report)) == sorted(m.uuid for m in nvml.gpus[1].migs)
    assert {r.split(":")[0] for r in out(report).values()} == {"uncorrected ECC errors rising"}


async def test_each_gpu_change_is_logged_once_with_its_reason_and_labelled_in_metrics(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    nvml = fake_nvml.dgx_a100()
    clock = Clock()
    plugin = plugin_for(nvml, tmp_path, clock, probe_interval=0.01, recovery_period=RECOVERY)
    registry = CollectorRegistry()
    gpu4 = nvml.gpus[4].uuid
    caplog.set_level(logging.INFO)

    async with (
        FakeKubelet() as kubelet,
        serving(plugin, settings=kubelet.settings(), observer=PrometheusObserver(registry)),
    ):
        await kubelet.wait_for_allocatable("nvidia.com/gpu", 8)
        nvml.ecc_uncorrected(4, 1)  # rising at every probe, every 10 ms
        await kubelet.wait_for_health("nvidia.com/gpu", gpu4, "Unhealthy")
        labels = {"resource": "nvidia.com/gpu", "device": gpu4}
        gauge = registry.get_sample_value(
            "devplugin_device_unhealthy", {**labels, "reason": "uncorrected_ecc_errors_rising"}
        )
        before = nvml.calls["nvmlDeviceGetTotalEccErrors"]
        await kubelet.wait_for(
            lambda: nvml.calls["nvmlDeviceGetTotalEccErrors"] >= before + 8 * 3,
            what="three more probes",
        )
        nvml.clear(4)
        clock.now += RECOVERY
        await kubelet.wait_for_allocatable("nvidia.com/gpu", 8)

    assert gauge == 1
    lines = [r.getMessage() for r in caplog.records if gpu4 in r.getMessage()]
    assert len(lines) == 2, lines
    assert lines[0].startswith(
        f"nvidia.com/gpu: device {gpu4} is now Unhealthy (uncorrected ECC errors rising: "
    )
    assert lines[1].startswith(f"nvidia.com/gpu: device {gpu4} is now Healthy (recovered: ")
    assert (
        registry.get_sample_value(
            "devplugin_device_unhealthy", {**labels, "reason": "uncorrected_ecc_errors_rising"}
        )
        is None
    )


# ----------------------------------------------------------------------------- NVML's lifetime


async def test_each_plugin_balances_its_own_nvml_init_when_serving_ends(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    nvml = fake_nvml.a100_mig([("1g.10gb", "2g.20gb"), None])
    roots = nvml.write_host(tmp_path)
    with nvml.installed():
        plugins = NvmlPlugin.from_config({"migStrategy": "mixed", **roots.config()})
    assert len(plugins) == 3
    assert nvml.init_count == 0  # listing the MIG profiles shut NVML down again

    async with FakeKubelet() as kubelet, serving(*plugins, settings=kubelet.settings()):
        await kubelet.wait_for_allocatable("nvidia.com/mig-2g.20gb", 1)
        # Every plugin's watch() is inside nvmlEventSetWait_v2 when serving is cancelled.
        assert await anyio.to_thread.run_sync(nvml.wait_for_waiters, 3, 5.0)
        assert nvml.init_count == 3

    assert nvml.init_count == 0
    assert nvml.calls["nvmlEventSetFree"] == nvml.calls["nvmlEventSetCreate"] == 3
    # Each set was freed before NVML was shut down under it (the fake would refuse the free).
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


async def test_a_plugin_that_never_initialised_nvml_does_not_shut_it_down(
    tmp_path: Path,
) -> None:
    nvml = fake_nvml.t4_pcie()
    nvml.nvmlInit()  # someone else's reference
    plugin = plugin_for(nvml, tmp_path)

    await plugin.on_stop()

    assert nvml.init_count == 1
    assert nvml.calls["nvmlShutdown"] == 0
