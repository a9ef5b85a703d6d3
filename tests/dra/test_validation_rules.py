"""Each API-server rule for ResourceSlices has one home (``dra._validation``) and two consumers:
``devplugin dra check`` and MemoryApi. For every slice, counter, taint and request-policy rule,
one pool that breaks it and one that does not, through both: the same verdict from each. The
same for a claim's device status, between the driver's own check and MemoryApi.

The pools are the SDK's ``ResourceSlice``s; ``dra check`` reads them as the driver would write
them (``slice_objects``, the lightkube conversion), MemoryApi takes them as ``create_slice`` does.
"""

from __future__ import annotations

from typing import Any

import pytest

from devplugin_sdk.dra._claims.status import status_problem
from devplugin_sdk.dra.check import check_slices, slice_objects
from devplugin_sdk.dra.resources import (
    ClaimDeviceStatus,
    CounterConsumption,
    CounterSet,
    DeviceTaint,
    RequestPolicy,
    ResourceSlice,
    SliceDevice,
)
from devplugin_sdk.errors import KubeApiError
from devplugin_sdk.testing import MemoryApi
from devplugin_sdk.types import DeviceCondition, DeviceStatus, NetworkData, Quantity

pytest.importorskip("lightkube", reason="slice_objects needs the dra extra")

DRIVER = "gpu.example.com"
NODE = "node-1"
Q = Quantity


def pool(*devices: SliceDevice, **spec: Any) -> list[ResourceSlice]:
    """One slice of ``devices`` on NODE (``spec`` overrides its fields)."""
    fields: dict[str, Any] = {
        "name": "s-0",
        "driver": DRIVER,
        "node_name": NODE,
        "pool": NODE,
        "generation": 1,
        "slice_count": 1,
        "devices": devices,
    }
    return [ResourceSlice(**{**fields, **spec})]


def counting(*devices: SliceDevice, sets: tuple[CounterSet, ...] | None = None) -> list:
    """A pool of two slices: the counter sets (since 1.35 in a slice of their own) and
    ``devices``, which consume them."""
    sets = sets if sets is not None else (CounterSet("c", {"memory": Q(100)}),)
    counters = pool(name="s-0", slice_count=2, devices=(), shared_counters=sets)
    return counters + pool(*devices, name="s-1", slice_count=2)


def gpu(name: str = "gpu-0", **fields: Any) -> SliceDevice:
    return SliceDevice(name, **fields)


def consuming(name: str, *sets: str, counters: int = 1) -> SliceDevice:
    amounts = {f"k{i}" if counters > 1 else "memory": Q(1) for i in range(counters)}
    return gpu(name, consumes_counters=tuple(CounterConsumption(s, amounts) for s in sets))


def tainted(*taints: tuple[str, str, str]) -> SliceDevice:
    return gpu(taints=tuple(DeviceTaint(k, v, e) for k, v, e in taints))  # type: ignore[arg-type]


def shared(policy: RequestPolicy, capacity: int = 16, *, multiple: bool = True) -> SliceDevice:
    return gpu(
        capacity={"memory": Q(capacity)},
        allow_multiple_allocations=multiple,
        request_policies={"memory": policy},
    )


def ranged(default: int, low: int, high: int | None = None, step: int | None = None) -> Any:
    return RequestPolicy(
        Q(default),
        minimum=Q(low),
        maximum=None if high is None else Q(high),
        step=None if step is None else Q(step),
    )


def values(default: int, *options: int) -> RequestPolicy:
    return RequestPolicy(Q(default), valid_values=tuple(map(Q, options)))


TAINT = ("gpu.example.com/health", "xid-79", "NoSchedule")
SETS = tuple(CounterSet(f"c{i}", {"memory": Q(1)}) for i in range(9))
WIDE = {f"k{i}": Q(1) for i in range(33)}

#: rule: (a pool breaking it, a pool keeping it).
RULES: dict[str, tuple[list[ResourceSlice], list[ResourceSlice]]] = {
    # ---------------------------------------------------------------- slices
    "driver name": (pool(gpu(), driver="Bad_Driver"), pool(gpu())),
    "pool name": (pool(gpu(), pool="bad pool"), pool(gpu(), pool="rack-1/node-1")),
    "generation >= 0": (pool(gpu(), generation=-1), pool(gpu(), generation=0)),
    "resourceSliceCount > 0": (pool(gpu(), slice_count=0), pool(gpu())),
    "devices or sharedCounters": (pool(gpu(), shared_counters=SETS[:1]), counting(gpu())),
    "128 devices": (
        pool(*(gpu(f"g{i}") for i in range(129))),
        pool(*(gpu(f"g{i}") for i in range(128))),
    ),
    "64 devices with taints": (
        pool(*(gpu(f"g{i}", taints=(DeviceTaint(*TAINT),)) for i in range(65))),  # type: ignore[arg-type]
        pool(*(gpu(f"g{i}", taints=(DeviceTaint(*TAINT),)) for i in range(64))),  # type: ignore[arg-type]
    ),
    "64 devices consuming counters": (
        counting(*(consuming(f"g{i}", "c") for i in range(65))),
        counting(*(consuming(f"g{i}", "c") for i in range(64))),
    ),
    "device names unique": (pool(gpu("a"), gpu("a")), pool(gpu("a"), gpu("b"))),
    "device name": (pool(gpu("GPU_0")), pool(gpu("gpu-0"))),
    "32 attributes and capacities": (
        pool(gpu(attributes={f"a{i}": i for i in range(32)}, capacity={"m": Q(1)})),
        pool(gpu(attributes={f"a{i}": i for i in range(31)}, capacity={"m": Q(1)})),
    ),
    "attribute name": (pool(gpu(attributes={"x" * 33: 1})), pool(gpu(attributes={"x" * 32: 1}))),
    "string attribute 64 bytes": (
        pool(gpu(attributes={"model": "é" * 33})),
        pool(gpu(attributes={"model": "é" * 32})),
    ),
    "capacity name": (
        pool(gpu(capacity={"a.b/9lives": Q(1)})),
        pool(gpu(capacity={"a.b/lives_9": Q(1)})),
    ),
    # ---------------------------------------------------------------- counters
    "8 counter sets": (
        pool(devices=(), shared_counters=SETS),
        pool(devices=(), shared_counters=SETS[:8]),
    ),
    "counter set names unique": (
        pool(devices=(), shared_counters=(SETS[0], SETS[0])),
        pool(devices=(), shared_counters=SETS[:2]),
    ),
    "counter set name": (
        pool(devices=(), shared_counters=(CounterSet("Bad_Set", {"m": Q(1)}),)),
        pool(devices=(), shared_counters=(CounterSet("good-set", {"m": Q(1)}),)),
    ),
    "a counter set has counters": (
        pool(devices=(), shared_counters=(CounterSet("c", {}),)),
        pool(devices=(), shared_counters=(CounterSet("c", {"m": Q(0)}),)),
    ),
    "32 counters per set": (
        pool(devices=(), shared_counters=(CounterSet("c", WIDE),)),
        pool(devices=(), shared_counters=(CounterSet("c", dict(list(WIDE.items())[:32])),)),
    ),
    "counter name": (
        pool(devices=(), shared_counters=(CounterSet("c", {"Mem_0": Q(1)}),)),
        pool(devices=(), shared_counters=(CounterSet("c", {"mem-0": Q(1)}),)),
    ),
    "2 consumesCounters": (
        counting(consuming("g", "c0", "c1", "c2"), sets=SETS[:3]),
        counting(consuming("g", "c0", "c1"), sets=SETS[:3]),
    ),
    "one consumption per counter set": (
        counting(consuming("g", "c0", "c0"), sets=SETS[:2]),
        counting(consuming("g", "c0", "c1"), sets=SETS[:2]),
    ),
    "32 counters per consumption": (
        counting(consuming("g", "c", counters=33), sets=(CounterSet("c", WIDE),)),
        counting(
            consuming("g", "c", counters=32),
            sets=(CounterSet("c", dict(list(WIDE.items())[:32])),),
        ),
    ),
    # ---------------------------------------------------------------- taints
    "16 taints": (
        pool(tainted(*((TAINT[0], f"v{i}", TAINT[2]) for i in range(17)))),
        pool(tainted(*((TAINT[0], f"v{i}", TAINT[2]) for i in range(16)))),
    ),
    "taint key": (pool(tainted(("bad key", "v", "NoSchedule"))), pool(tainted(TAINT))),
    "taint value": (
        pool(tainted((TAINT[0], "not a value!", "NoSchedule"))),
        pool(tainted((TAINT[0], "", "NoSchedule"))),
    ),
    "taint effect": (
        pool(tainted((TAINT[0], "v", "PreferNoSchedule"))),
        pool(tainted((TAINT[0], "v", "None"))),
    ),
    # ---------------------------------------------------------------- request policies
    "a policy needs allowMultipleAllocations": (
        pool(shared(values(4, 4, 8), multiple=False)),
        pool(shared(values(4, 4, 8))),
    ),
    "validValues or validRange": (
        pool(shared(RequestPolicy(Q(4), valid_values=(Q(4),), minimum=Q(4)))),
        pool(shared(RequestPolicy(Q(4), minimum=Q(4)))),
    ),
    "validValues ascending": (pool(shared(values(4, 8, 4))), pool(shared(values(4, 4, 8)))),
    "10 validValues": (
        pool(shared(values(1, *range(1, 12)))),
        pool(shared(values(1, *range(1, 11)))),
    ),
    "validValues unique": (pool(shared(values(4, 4, 4))), pool(shared(values(4, 4)))),
    "validValues within the capacity": (
        pool(shared(values(4, 4, 17))),
        pool(shared(values(4, 4, 16))),
    ),
    "the default one of validValues": (
        pool(shared(values(6, 4, 8))),
        pool(shared(values(8, 4, 8))),
    ),
    "min within the capacity": (pool(shared(ranged(17, 17))), pool(shared(ranged(16, 16)))),
    "the default at least min": (pool(shared(ranged(1, 2))), pool(shared(ranged(2, 2)))),
    "max at least min": (pool(shared(ranged(4, 4, 3))), pool(shared(ranged(4, 4, 4)))),
    "max within the capacity": (pool(shared(ranged(4, 4, 17))), pool(shared(ranged(4, 4, 16)))),
    "the default at most max": (pool(shared(ranged(9, 4, 8))), pool(shared(ranged(8, 4, 8)))),
    "the default past the capacity without max is not checked": (
        pool(shared(ranged(4, 4, 8), capacity=2)),  # min and max past it are
        pool(shared(ranged(20, 4))),
    ),
    "step > 0": (pool(shared(ranged(4, 4, step=0))), pool(shared(ranged(4, 4, step=1)))),
    "min + step within the capacity": (
        pool(shared(ranged(4, 4, step=13))),
        pool(shared(ranged(4, 4, step=12))),
    ),
    # The case: min 2, step 4, default 6, max 10 is valid (6 and 10 are 2 + n * 4).
    "the default a multiple of step from min": (
        pool(shared(ranged(4, 2, 10, 4))),
        pool(shared(ranged(6, 2, 10, 4))),
    ),
    "max a multiple of step from min": (
        pool(shared(ranged(6, 2, 12, 4))),
        pool(shared(ranged(6, 2, 14, 4))),
    ),
}


def check_refuses(slices: list[ResourceSlice]) -> list[str]:
    problems = check_slices(slice_objects(slices), versions=("1.37",))
    return [str(p) for p in problems if p.severity == "error"]


async def memory_api_refuses(slices: list[ResourceSlice]) -> list[str]:
    api = MemoryApi(nodes=[NODE])
    refused: list[KubeApiError] = []
    for s in slices:
        try:
            await api.create_slice(s)
        except KubeApiError as error:
            refused.append(error)
    assert {e.status for e in refused} <= {422}, refused  # Invalid, never another failure
    return [e.reason for e in refused]


@pytest.mark.parametrize("rule", list(RULES))
async def test_dra_check_and_memory_api_give_one_verdict(rule: str) -> None:
    bad, good = RULES[rule]
    assert check_refuses(good) == []
    assert await memory_api_refuses(good) == []
    assert check_refuses(bad), "dra check accepted it"
    assert await memory_api_refuses(bad), "MemoryApi accepted it"


def test_every_rule_has_a_case_breaking_it_and_one_keeping_it() -> None:
    assert len(RULES) >= 40
    for bad, good in RULES.values():
        assert bad != good


#: A device's status: (one the API server refuses, one it takes), per rule.
STATUSES: dict[str, tuple[DeviceStatus, DeviceStatus]] = {
    "8 conditions": (
        DeviceStatus(conditions=tuple(DeviceCondition(f"C{i}", "True", "Why") for i in range(9))),
        DeviceStatus(conditions=tuple(DeviceCondition(f"C{i}", "True", "Why") for i in range(8))),
    ),
    "one condition per type": (
        DeviceStatus(conditions=(DeviceCondition("Ready", "True", "Up"),) * 2),
        DeviceStatus(conditions=(DeviceCondition("Ready", "True", "Up"),)),
    ),
    "condition reason": (
        DeviceStatus(conditions=(DeviceCondition("Ready", "True", "not camel"),)),
        DeviceStatus(conditions=(DeviceCondition("Ready", "True", "NotCamel"),)),
    ),
    "data 10 KiB": (
        DeviceStatus(data={"blob": "x" * 10 * 1024}),
        DeviceStatus(data={"blob": "x" * 9 * 1024}),
    ),
    "16 IPs": (
        DeviceStatus(network_data=NetworkData(ips=tuple(f"10.0.0.{i}/24" for i in range(17)))),
        DeviceStatus(network_data=NetworkData(ips=tuple(f"10.0.0.{i}/24" for i in range(16)))),
    ),
    "IPs in CIDR form": (
        DeviceStatus(network_data=NetworkData(ips=("10.0.0.1",))),
        DeviceStatus(network_data=NetworkData(ips=("10.0.0.1/24",))),
    ),
    "IPs in canonical form": (
        DeviceStatus(network_data=NetworkData(ips=("fd00:0::1/64",))),
        DeviceStatus(network_data=NetworkData(ips=("fd00::1/64",))),
    ),
    "IPs once": (
        DeviceStatus(network_data=NetworkData(ips=("10.0.0.1/24", "10.0.0.1/24"))),
        DeviceStatus(network_data=NetworkData(ips=("10.0.0.1/24", "10.0.0.2/24"))),
    ),
    "interface name": (
        DeviceStatus(network_data=NetworkData(interface_name="e" * 257)),
        DeviceStatus(network_data=NetworkData(interface_name="e" * 256)),
    ),
}


@pytest.mark.parametrize("rule", list(STATUSES))
async def test_the_driver_and_memory_api_judge_a_device_status_alike(rule: str) -> None:
    api = MemoryApi(nodes=[NODE])
    await api.create_slice(pool(gpu())[0])
    claim = api.allocate("default", "c", {"r": ["gpu-0"]}, driver=DRIVER, pool=NODE)
    for status, valid in zip(STATUSES[rule], (False, True), strict=True):
        assert (status_problem(status) is None) == valid, status_problem(status)
        entry = ClaimDeviceStatus(DRIVER, NODE, "gpu-0", status)
        try:
            await api.apply_claim_status(claim, DRIVER, [entry])
            accepted = True
        except KubeApiError:
            accepted = False
        assert accepted == valid
