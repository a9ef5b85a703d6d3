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


# ------------------------------------------------------------------ typed attributes (DRA)


def test_attributes_are_typed_facts_with_dras_names() -> None:
    from devplugin_sdk.types import Quantity, Version

    device = Device(
        "gpu0",
        attributes={
            "uuid": "GPU-1",
            "index": 3,
            "migCapable": True,
            "driverVersion": Version("550.54.15"),
            "resource.kubernetes.io/pcieRoot": "pci0000:00",
        },
        capacity={"memory": Quantity(80 * 2**30)},
    )
    assert device.attributes["index"] == 3
    assert str(device.capacity["memory"]) == "80Gi"


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("1index", "C identifier"),
        ("pci-root", "C identifier"),
        ("x" * 33, "longer than 32"),
        ("Acme.COM/x", "DNS-1123"),
        ("a/b/c", "more than one '/'"),
        ("acme.com/", "empty"),
    ],
)
def test_attribute_names_follow_the_api_servers_rules(name: str, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        Device("a", attributes={name: "x"})
    from devplugin_sdk.types import Quantity

    with pytest.raises(ValueError, match=reason):
        Device("a", capacity={name: Quantity(1)})


def test_attribute_values_are_bounded_and_typed() -> None:
    with pytest.raises(ValueError, match="64 bytes"):
        Device("a", attributes={"model": "x" * 65})
    with pytest.raises(ValueError, match="64-bit"):
        Device("a", attributes={"big": 2**63})
    with pytest.raises(TypeError, match="str, int, bool or Version"):
        Device("a", attributes={"ratio": 0.5})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match="Quantity"):
        Device("a", capacity={"memory": 5})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="32 together"):
        Device("a", attributes={f"a{i}": i for i in range(33)})


def test_versions_are_semantic_and_loose_ones_are_normalised() -> None:
    from devplugin_sdk.types import Version

    assert str(Version("1.2.3-rc.1+build.5")) == "1.2.3-rc.1+build.5"
    assert str(Version.loose("12.4")) == "12.4.0"
    assert str(Version.loose("535.104.05")) == "535.104.5"
    assert str(Version.loose("v2")) == "2.0.0"
    for bad in ("1.2", "01.2.3", "1.2.3-", ""):
        with pytest.raises(ValueError, match="semantic version"):
            Version(bad)
    with pytest.raises(ValueError, match="not a version"):
        Version.loose("R535")


def test_quantities_parse_and_print_as_kubernetes_does() -> None:
    from devplugin_sdk.types import Quantity

    assert Quantity.parse("80Gi") == Quantity(80 * 2**30)
    assert Quantity.parse("16k").value == 16000
    assert [str(Quantity(v)) for v in (0, 7, 1024, 1536, 3000, 2**40)] == [
        "0",
        "7",
        "1Ki",
        "1536",
        "3k",
        "1Ti",
    ]
    # Any Kubernetes spelling, rounded up to a whole amount (tests/dra/test_quantities.py).
    assert Quantity.parse("1.5Gi") == Quantity(1536 * 2**20)
    with pytest.raises(ValueError, match="quantity"):
        Quantity.parse("1.5GB")
    with pytest.raises(ValueError, match="between"):
        Quantity(-1)
