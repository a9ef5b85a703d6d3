"""What the pool does about a field the API server drops (upstream's resourceslice controller
reports dropped fields too, and leaves the decision to the driver).

An API server whose feature gate for a field is off stores a write without it, silently; the
publisher finds that on the first write that carried one and reports it here, once. Taints
dropped (``DRADeviceTaints`` off): a device with a ``NoSchedule`` or ``NoExecute`` taint is
withdrawn instead, and advisories are not published. Counters dropped (``DRAPartitionableDevices``
off, before 1.36): the whole devices of partitions are withdrawn (the scheduler could otherwise
give a GPU and its MIG devices at once) and the partitions published without counters.
``allowMultipleAllocations`` dropped (``DRAConsumableCapacity`` off) is said once: its shared
devices are allocated whole, which the claims side handles. Each holds until the driver restarts.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import replace
from typing import Literal

from devplugin_sdk.dra.resources import CounterSet, SliceDevice

__all__ = ["Dropped", "Field"]

log = logging.getLogger("devplugin_sdk")

#: A field of a write that an API server can drop.
Field = Literal["taints", "counters", "shares"]


class Dropped:
    """The fields this API server drops, and the pool as it can hold them.

    Args:
        driver: The driver name (for the warnings).

    Attributes:
        taints: The server dropped the taints of a write: tainted devices are withdrawn.
        counters: The server dropped counters: whole devices of partitions are withdrawn.
    """

    def __init__(self, driver: str) -> None:
        self.driver = driver
        self.taints = False
        self.counters = False
        self.shares = False

    def report(self, fields: Iterable[Field]) -> bool:
        """A write was stored without ``fields``: whether the content must be shaped anew and
        written again (the rest of that write is moot)."""
        for field in fields:
            if field == "taints":
                self._taints()
                return True
            if field == "counters":
                self._counters()
                return True
            self._shares()
        return False

    def shape(
        self, devices: tuple[SliceDevice, ...], counter_sets: tuple[CounterSet, ...]
    ) -> tuple[tuple[SliceDevice, ...], tuple[CounterSet, ...]]:
        """``devices`` and ``counter_sets`` as this API server can hold them: without counters
        when it drops them, a device that consumes a whole counter set (a GPU beside its MIG
        devices) withdrawn; without taints when it drops them, a device tainted ``NoSchedule``
        or ``NoExecute`` withdrawn."""
        if self.counters:
            totals = {c.name: c.counters for c in counter_sets}
            devices = tuple(
                replace(d, consumes_counters=())
                for d in devices
                if not any(totals.get(c.counter_set) == c.counters for c in d.consumes_counters)
            )
            counter_sets = ()
        if self.taints:
            devices = tuple(
                replace(d, taints=()) for d in devices if all(t.effect == "None" for t in d.taints)
            )
        return devices, counter_sets

    def _taints(self) -> None:
        self.taints = True
        log.warning(
            "DRA %s: the API server dropped the devices' taints (its DRADeviceTaints feature is "
            "off; on by default from Kubernetes 1.36): unhealthy devices are withdrawn from the "
            "pool instead and advisories are not published, until this driver restarts",
            self.driver,
        )

    def _counters(self) -> None:
        self.counters = True
        log.warning(
            "DRA %s: the API server dropped the devices' counters (its DRAPartitionableDevices "
            "feature is off; on by default from Kubernetes 1.36): whole devices that have "
            "partitions (a GPU beside its MIG devices) are withdrawn, until this driver restarts",
            self.driver,
        )

    def _shares(self) -> None:
        if not self.shares:
            self.shares = True
            log.warning(
                "DRA %s: the API server dropped allowMultipleAllocations (its "
                "DRAConsumableCapacity feature is off; on by default from Kubernetes 1.36): each "
                "shared device is allocated to one claim at a time, which gets all its shares",
                self.driver,
            )
