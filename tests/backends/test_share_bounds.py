"""Share counts against the kubelet's 4 MiB ListAndWatch limit (issue 25, row 5): the size is
computed without building the devices, equals what the SDK encodes, and a count over the limit is
refused on its dotted key with the size (the process-level tests: tests/reliability/
test_bounds_faults.py)."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import anyio
import pytest

from devplugin_sdk._wire import convert
from devplugin_sdk.allocation import check_list_size, most_that_fit, numbered_list_bytes
from devplugin_sdk.api import constants
from devplugin_sdk.backends import generic, rdma
from devplugin_sdk.backends.generic import GenericPlugin
from devplugin_sdk.backends.nvidia import NvmlPlugin, from_config
from devplugin_sdk.errors import ConfigError
from devplugin_sdk.testing import fake_nvml, watching
from devplugin_sdk.testing.fake_nvml import FakeNVML
from devplugin_sdk.types import Device, Health, HealthEvent, replicate

NEVER = 3600


def encoded(devices: list[Device]) -> int:
    return sum(len(convert.list_and_watch_entry(d, Health.UNHEALTHY)) for d in devices)


@pytest.mark.parametrize("count", [0, 1, 9, 10, 11, 99, 100, 1234])
@pytest.mark.parametrize("numa", [(), (0,), (1,)])
def test_numbered_list_bytes_is_what_the_sdk_encodes(count: int, numa: tuple[int, ...]) -> None:
    devices = replicate([Device("GPU-1234", numa_nodes=numa)], max(count, 2))[:count]
    assert numbered_list_bytes("GPU-1234::", count, numa) == encoded(devices)


def test_check_list_size_names_the_key_and_the_size_only_over_the_limit() -> None:
    check_list_size("k", constants.MAX_MESSAGE_BYTES, "x", "y")  # at the limit: fits
    with pytest.raises(ConfigError) as caught:
        check_list_size("a.b", constants.MAX_MESSAGE_BYTES + 1, "9 things", "fewer")
    assert str(caught.value) == (
        "a.b: 9 things make a ListAndWatch list of up to 4,194,305 bytes here, over the kubelet's"
        " limit of 4,194,304 bytes (4 MiB); fewer"
    )


def test_most_that_fit_is_the_largest_count_within_the_limit() -> None:
    def size(n: int) -> int:
        return numbered_list_bytes("d::", n)

    most = most_that_fit(size, 10**9)
    assert size(most) <= constants.MAX_MESSAGE_BYTES < size(most + 1)
    assert most_that_fit(size, 5) == 5


# ----------------------------------------------------------------------------- nvidia


def plugins_for(nvml: FakeNVML, tmp_path: Path, replicas: int) -> list[NvmlPlugin]:
    roots = nvml.write_host(tmp_path)
    config = {
        "sharing": {"timeSlicing": {"replicas": replicas}},
        "health": {"probeInterval": NEVER},
        **roots.config(),
    }
    with nvml.installed():
        plugins = from_config(config)
    return [p for p in plugins if isinstance(p, NvmlPlugin)]


async def test_the_most_replicas_the_refusal_names_fit_and_one_more_is_refused(
    tmp_path: Path,
) -> None:
    nvml = fake_nvml.dgx_a100()
    with pytest.raises(ConfigError) as caught:
        plugins_for(nvml, tmp_path / "a", 10**6)
    assert caught.value.key == "sharing.timeSlicing.replicas"
    [most] = re.findall(r"at most ([\d,]+) fit$", caught.value.reason)
    most_replicas = int(most.replace(",", ""))

    [plugin] = plugins_for(nvml, tmp_path / "b", most_replicas)
    with nvml.installed():
        devices = list(await plugin.discover())
    assert len(devices) == 8 * most_replicas
    assert encoded(devices) <= constants.MAX_MESSAGE_BYTES
    with pytest.raises(ConfigError, match="at most"):
        plugins_for(nvml, tmp_path / "c", most_replicas + 1)


def test_mixed_mig_replicas_name_the_profile_whose_list_is_too_large(tmp_path: Path) -> None:
    nvml = fake_nvml.a100_mig([("1g.10gb",) * 7, None])
    roots = nvml.write_host(tmp_path)
    config = {
        "migStrategy": "mixed",
        "sharing": {"timeSlicing": {"replicas": 20_000}},
        **roots.config(),
    }
    with nvml.installed(), pytest.raises(ConfigError) as caught:
        from_config(config)
    # The full GPU's 20,000 fit; the seven MIG devices' 140,000 do not.
    assert "here (140,000 devices on 7 1g.10gb MIG devices), over" in caught.value.reason


# ----------------------------------------------------------------------------- generic


def generic_plugin(devices: Path, **entry: Any) -> GenericPlugin:
    config = {
        "healthInterval": 0.05,
        "resources": [{"resourceName": "example.com/dev", **entry}],
    }
    (made,) = generic.from_config(config)
    assert isinstance(made, GenericPlugin)
    return made


def test_a_group_count_no_device_could_list_is_refused_on_its_key(tmp_path: Path) -> None:
    groups = [{"paths": [{"path": f"{tmp_path}/d*"}]}, {"paths": [{"path": "/x"}], "count": 10**7}]
    with pytest.raises(ConfigError) as caught:
        generic_plugin(tmp_path, groups=groups)
    assert caught.value.key == "resources[0].groups[1].count"
    assert caught.value.reason.startswith("10,000,000 shares make a ListAndWatch list of at least")


async def test_shares_of_what_discovery_finds_are_refused_and_a_rescan_keeps_the_list(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "d0").touch()
    plugin = generic_plugin(tmp_path, paths=[f"{tmp_path}/d*"], share=20_000)
    assert len(await plugin.discover()) == 20_000
    refused = anyio.Event()
    handler = logging.Handler(logging.ERROR)
    handler.emit = lambda record: refused.set()  # type: ignore[method-assign]
    logger = logging.getLogger("devplugin_sdk.backends.generic")
    logger.addHandler(handler)
    try:
        async with watching(plugin) as events:
            for i in range(1, 16):
                (tmp_path / f"d{i}").touch()
            with anyio.fail_after(5):
                await refused.wait()  # logged on the event loop, by the watch
            (tmp_path / "d0").unlink()  # a listed device is still watched
            gone = HealthEvent("d0", Health.UNHEALTHY, f"{tmp_path / 'd0'} disappeared")
            while (event := await events.next_event()) != gone:
                assert isinstance(event, HealthEvent), event  # the first rescan's Healthy d0
    finally:
        logger.removeHandler(handler)
    refusals = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(refusals) == 1, "said once, though every rescan finds the same"
    assert re.fullmatch(
        r"example\.com/dev: resources\[0\]\.share: 20,000 shares make a ListAndWatch list of up"
        r" to [\d,]+ bytes here \(320,000 devices of 16 matches\), over the kubelet's limit of"
        r" 4,194,304 bytes \(4 MiB\); at most [\d,]+ fit; keeping the devices already listed",
        refusals[0].getMessage(),
    )
    with pytest.raises(ConfigError) as caught:
        await plugin.discover()
    assert caught.value.key == "resources[0].share"


def test_rdma_shares_no_device_could_list_are_refused_on_their_key() -> None:
    config = {"resources": [{"resourceName": "rdma/x", "mode": "shared", "shares": 10**9}]}
    with pytest.raises(ConfigError) as caught:
        rdma.from_config(config)
    assert caught.value.key == "resources[0].shares"
    assert caught.value.reason.startswith("1,000,000,000 shares make a ListAndWatch list of at")
