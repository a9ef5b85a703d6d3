"""Resource and socket names are validated with the kubelet's rules, at construction."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest

from devplugin_sdk import Device, DevicePlugin, _names
from devplugin_sdk._names import default_socket_name, resource_name_problem, validate_socket_name


@pytest.mark.parametrize(
    "name",
    [
        "example.com/foo",
        "nvidia.com/gpu",
        "vendor.example/My_Dev-1",
        "a.b/c.d-e_f",
        "x/" + "a" * 63,
    ],
)
def test_accepts_what_the_kubelet_accepts(name: str) -> None:
    assert resource_name_problem(name) is None


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("gpu", "no '/'"),
        ("kubernetes.io/foo", "reserved"),
        ("dev.kubernetes.io/foo", "reserved"),
        ("requests.example.com/foo", "requests."),
        ("Example.com/foo", "DNS-1123"),
        ("example.com/", "empty"),
        ("example.com/-x", "alphanumeric"),
        ("a/b/c", "more than one"),
        ("x/" + "a" * 64, "63"),
        ("exa_mple.com/foo", "DNS-1123"),
    ],
)
def test_rejects_what_the_kubelet_rejects(name: str, why: str) -> None:
    problem = resource_name_problem(name)
    assert problem is not None
    assert why in problem


@pytest.mark.parametrize(
    "name",
    [
        "kubelet.sock",
        "kubelet_internal_checkpoint",
        "DEPRECATION",
        ".hidden.sock",
        "a/b.sock",
        "",
        "..",
    ],
)
def test_rejects_socket_names_the_kubelet_would_clash_with(name: str) -> None:
    with pytest.raises(ValueError, match="invalid socket name"):
        validate_socket_name(name)


def test_default_socket_name_is_a_bare_file_name() -> None:
    assert default_socket_name("acme.com/widget") == "acme.com_widget.sock"


class _Plugin(DevicePlugin):
    async def discover(self) -> Sequence[Device]:
        return []


def test_bad_resource_name_fails_at_construction() -> None:
    with pytest.raises(ValueError, match="invalid resource name 'gpu'"):
        _Plugin(resource_name="gpu")


def test_bad_socket_name_fails_at_construction() -> None:
    with pytest.raises(ValueError, match="reserved by the kubelet"):
        _Plugin(resource_name="acme.com/x", socket_name="kubelet.sock")


def test_missing_resource_name_fails_at_construction() -> None:
    with pytest.raises(TypeError, match="must set resource_name"):
        _Plugin()


@pytest.mark.parametrize(
    "problem",
    [
        _names.device_name_problem,
        _names.driver_name_problem,
        _names.attribute_name_problem,
        _names.pool_name_problem,
        _names.label_value_problem,
        _names.label_name_problem,
    ],
    ids=lambda f: f.__name__,
)
def test_a_name_ending_in_a_newline_is_refused(problem: Callable[[str], str | None]) -> None:
    # A regular expression's "$" also matches before a final newline: "gpu0\n" passed as a
    # device name, a driver name and a label value.
    assert problem("gpu0") is None
    assert problem("gpu0\n") is not None


def test_dns_labels_and_subdomains_are_matched_whole() -> None:
    assert _names.is_dns_label("ns-1")
    assert not _names.is_dns_label("ns-1\n")
    assert not _names.is_dns_label("a" * 64)
    assert _names.is_dns_subdomain("claim.a-b")
    assert not _names.is_dns_subdomain("claim\n")
    assert not _names.is_dns_subdomain("a" * 254)
