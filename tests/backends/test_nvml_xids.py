"""Xids classified by NVIDIA's catalog: no_schedule (Unhealthy), advisory (logged, Healthy),
ignore, and ``ignoredXids`` over all of them; on fake NVML through the event path."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import anyio.to_thread
import pytest

from devplugin_sdk.backends.nvidia import NvidiaConfig, NvmlPlugin
from devplugin_sdk.backends.nvidia.xids import CATALOG, classify
from devplugin_sdk.testing import fake_nvml, watching
from devplugin_sdk.testing.fake_nvml import FakeNVML
from devplugin_sdk.types import Effect, Health, HealthEvent

EVENTS = "devplugin_sdk.backends.nvidia.events"
NEVER = 3600.0  # a probe interval that never comes round within a test


def plugin_for(nvml: FakeNVML, tmp_path: Path, **config: Any) -> NvmlPlugin:
    roots = nvml.write_host(tmp_path)
    cfg = NvidiaConfig(
        sysfs_root=roots.sysfs_root,
        dev_root=roots.dev_root,
        proc_root=roots.proc_root,
        probe_interval=NEVER,
        **config,
    )
    return NvmlPlugin(cfg, nvml=nvml)


async def armed(nvml: FakeNVML) -> None:
    """Return once ``watch()`` waits in the fake NVML's event set."""
    assert await anyio.to_thread.run_sync(nvml.wait_for_waiters, 1, 5.0)


def lines(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == EVENTS and r.levelno == level]


# ----------------------------------------------------------------------------- the table


@pytest.mark.parametrize("xid", [13, 31, 43, 45, 68])
def test_application_xids_are_advisory(xid: int) -> None:
    assert classify(xid).cls == "advisory"


@pytest.mark.parametrize("xid", [46, 48, 62, 63, 64, 74, 79, 92, 94, 95, 109, 119, 154])
def test_xids_that_need_a_reset_or_a_reboot_are_no_schedule(xid: int) -> None:
    assert classify(xid).cls == "no_schedule"


def test_an_xid_the_catalog_does_not_list_is_no_schedule() -> None:
    info = classify(4321)

    assert (info.xid, info.name, info.cls) == (4321, "", "no_schedule")


def test_every_row_is_filed_under_its_own_xid_with_a_name_and_a_resolution() -> None:
    for xid, info in CATALOG.items():
        assert info.xid == xid
        assert info.name
        assert info.resolution
        assert info.cls in ("ignore", "advisory", "no_schedule")


def test_every_xid_of_the_catalog_has_a_row_or_an_explicit_default() -> None:
    # NVIDIA's catalog covers Xids 1-162 (NVIDIA/NVSentinel xiderrorsmapping.csv at 6f8b0fc).
    unknown = "unknown to this table: treated as needing a reset"

    missing = [x for x in range(1, 163) if classify(x).resolution == unknown]

    assert missing == []
    assert classify(163).resolution == unknown


@pytest.mark.parametrize("xid", [152, 153])
def test_dla_xids_are_ignored_as_the_catalog_says(xid: int) -> None:
    info = classify(xid)

    assert (info.cls, info.resolution) == ("ignore", "ignore (IGNORE)")


def test_an_xid_the_catalog_calls_unexpected_is_no_schedule_with_that_resolution() -> None:
    info = classify(47)

    assert info.cls == "no_schedule"
    assert "UNEXPECTED_ERR_REPORT_ISSUE" in info.resolution


def test_the_catalog_states_nvidias_resolution() -> None:
    assert classify(79).resolution == "reboot the node (RESTART_BM)"
    assert classify(95).resolution == "reset the GPU (RESET_GPU)"
    assert classify(13).resolution == "restart the application (RESTART_APP)"


# ----------------------------------------------------------------------------- the event path


async def test_xid_79_makes_the_gpu_unhealthy_with_the_catalogs_reason(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger=EVENTS)
    nvml = fake_nvml.dgx_a100()
    plugin = plugin_for(nvml, tmp_path)
    await plugin.discover()

    async with watching(plugin) as events:
        await armed(nvml)
        nvml.xid(2, 79)
        event = await events.next_event()

    gpu = nvml.gpus[2].uuid
    assert event == HealthEvent(
        gpu, Health.UNHEALTHY, "Xid 79 (GPU has fallen off the bus)", Effect.NO_EXECUTE
    )
    assert lines(caplog, logging.INFO) == [
        f"Xid 79 (GPU has fallen off the bus) on GPU {gpu}: NVIDIA's resolution: "
        "reboot the node (RESTART_BM)"
    ]


async def test_xid_43_is_an_advisory_the_gpu_stays_healthy(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger=EVENTS)
    nvml = fake_nvml.t4_pcie()
    plugin = plugin_for(nvml, tmp_path)
    await plugin.discover()

    async with watching(plugin) as events:
        await armed(nvml)
        nvml.xid(0, 43)
        nvml.xid(1, 48)
        advisory = await events.next_event()
        fault = await events.next_event()

    gpu0 = nvml.gpus[0].uuid
    assert advisory == HealthEvent(
        gpu0, Health.HEALTHY, "Xid 43 (GPU stopped processing)", Effect.ADVISORY
    )
    assert fault == HealthEvent(
        nvml.gpus[1].uuid, Health.UNHEALTHY, "Xid 48 (double-bit ECC error)"
    )
    said = [line for line in lines(caplog, logging.INFO) if "Xid 43" in line]
    assert said == [
        f"Xid 43 (GPU stopped processing) on GPU {gpu0}: NVIDIA's resolution: ignore (IGNORE)"
    ]


async def test_an_xid_in_ignored_xids_changes_nothing_whatever_its_class(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger=EVENTS)
    nvml = fake_nvml.t4_pcie()
    plugin = plugin_for(nvml, tmp_path, ignored_xids=frozenset({79, 13}))
    await plugin.discover()

    async with watching(plugin) as events:
        await armed(nvml)
        nvml.xid(0, 79)  # no_schedule by the catalog
        nvml.xid(0, 13)  # advisory by the catalog
        nvml.xid(1, 95)
        event = await events.next_event()

    assert event == HealthEvent(
        nvml.gpus[1].uuid, Health.UNHEALTHY, "Xid 95 (uncontained ECC error)"
    )
    assert not any("Xid 79" in line or "Xid 13" in line for line in lines(caplog, logging.INFO))
    assert sum("Xid 79" in line or "Xid 13" in line for line in lines(caplog, logging.DEBUG)) == 2


async def test_an_xid_left_out_of_a_users_list_falls_back_to_its_catalog_class(
    tmp_path: Path,
) -> None:
    nvml = fake_nvml.t4_pcie()
    plugin = plugin_for(nvml, tmp_path, ignored_xids=frozenset())
    await plugin.discover()

    async with watching(plugin) as events:
        await armed(nvml)
        nvml.xid(0, 109)  # ignored by default; the catalog says reset the GPU
        event = await events.next_event()

    assert event == HealthEvent(
        nvml.gpus[0].uuid, Health.UNHEALTHY, "Xid 109 (context switch timeout)"
    )


async def test_an_unknown_xid_makes_the_gpu_unhealthy(tmp_path: Path) -> None:
    nvml = fake_nvml.t4_pcie()
    plugin = plugin_for(nvml, tmp_path)
    await plugin.discover()

    async with watching(plugin) as events:
        await armed(nvml)
        nvml.xid(3, 4321)
        event = await events.next_event()

    assert event == HealthEvent(nvml.gpus[3].uuid, Health.UNHEALTHY, "Xid 4321")
