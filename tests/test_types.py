"""The plain dataclasses authors use: validation, merging, replicas."""

from __future__ import annotations

import pytest

from devplugin_sdk import Allocation, Device, DeviceNode, Health, Mount, replicate


def test_device_node_defaults_to_same_path_rw() -> None:
    node = DeviceNode("/dev/widget0")
    assert (node.container_path, node.permissions) == ("/dev/widget0", "rw")


def test_device_node_rejects_bad_permissions() -> None:
    with pytest.raises(ValueError, match="permissions"):
        DeviceNode("/dev/x", permissions="rx")


def test_device_rejects_empty_and_unprintable_ids_and_negative_numa() -> None:
    with pytest.raises(ValueError, match="empty"):
        Device("")
    with pytest.raises(ValueError, match="printable"):
        Device("a\nb")
    with pytest.raises(ValueError, match="NUMA"):
        Device("a", numa_nodes=(-1,))


def test_device_accepts_health_strings_and_lists() -> None:
    device = Device("a", health="Unhealthy", numa_nodes=[0, 1])  # type: ignore[arg-type]
    assert device.health is Health.UNHEALTHY
    assert device.numa_nodes == (0, 1)
    with pytest.raises(ValueError, match="healthy"):
        Device("b", health="healthy")  # type: ignore[arg-type]


def test_merge_combines_and_deduplicates_like_the_kubelet() -> None:
    a = Device(
        "a",
        device_nodes=(DeviceNode("/dev/a"), DeviceNode("/dev/ctl")),
        mounts=(Mount("/opt/lib", read_only=True),),
        env={"VISIBLE": "a", "A": "1"},
        annotations={"x": "1"},
        cdi_devices=("acme.com/w=a",),
    )
    b = Device(
        "b",
        device_nodes=(DeviceNode("/dev/b"), DeviceNode("/dev/ctl")),
        mounts=(Mount("/opt/lib"),),
        env={"VISIBLE": "b"},
        cdi_devices=("acme.com/w=b", "acme.com/w=a"),
    )
    merged = Allocation.merge([a, b])
    assert [n.host_path for n in merged.device_nodes] == ["/dev/a", "/dev/ctl", "/dev/b"]
    assert merged.mounts == (Mount("/opt/lib", read_only=True),)
    assert merged.env == {"VISIBLE": "b", "A": "1"}
    assert merged.annotations == {"x": "1"}
    assert merged.cdi_devices == ("acme.com/w=a", "acme.com/w=b")


def test_replicate_makes_shares_with_parent() -> None:
    shares = replicate([Device("gpu0"), Device("gpu1")], 2)
    assert [d.id for d in shares] == ["gpu0::0", "gpu0::1", "gpu1::0", "gpu1::1"]
    assert {d.parent for d in shares} == {"gpu0", "gpu1"}
    assert replicate([Device("x")], 1) == [Device("x")]
    with pytest.raises(ValueError, match="replicas must be >= 1"):
        replicate([Device("x")], 0)
