"""``ConfigReader``'s resource-name readers: a bare name under a default domain, and domains."""

from __future__ import annotations

import pytest

from devplugin_sdk.config import ConfigReader
from devplugin_sdk.errors import ConfigError


def test_a_bare_resource_name_takes_the_given_domain() -> None:
    reader = ConfigReader({"a": "u250", "b": "example.com/u280"}, "rename")

    assert reader.resource_name("a", domain="amd.com") == "amd.com/u250"
    assert reader.resource_name("b", domain="amd.com") == "example.com/u280"


@pytest.mark.parametrize(
    ("value", "domain", "problem"),
    [
        ("u250", None, "has no '/'"),
        ("Bad Name!", "amd.com", "must use only"),
        ("x" * 64, "amd.com", "longer than 63"),
    ],
)
def test_an_invalid_resource_name_names_the_dotted_key(
    value: str, domain: str | None, problem: str
) -> None:
    reader = ConfigReader({"shell": value}, "rename")

    with pytest.raises(ConfigError, match=problem) as raised:
        reader.resource_name("shell", domain=domain)

    assert raised.value.key == "rename.shell"


def test_a_domain_is_read_and_checked_with_the_kubelets_rules() -> None:
    reader = ConfigReader({"ok": "fpga.example.com", "upper": "Intel", "reserved": "kubernetes.io"})

    assert reader.domain("ok") == "fpga.example.com"
    assert reader.domain("absent", "amd.com") == "amd.com"
    with pytest.raises(ConfigError, match="DNS-1123") as raised:
        reader.domain("upper")
    assert raised.value.key == "upper"
    with pytest.raises(ConfigError, match="reserved"):
        reader.domain("reserved")
    with pytest.raises(ConfigError, match="is required"):
        reader.domain("absent")


def test_resource_name_whose_socket_name_is_too_long_is_a_config_error() -> None:
    """The plugin's socket is named after the resource: a name the kubelet takes but whose socket
    cannot exist fails as a config error on the key, not as a ValueError at construction."""
    name = "a" * 60 + ".com/" + "b" * 60
    with pytest.raises(ConfigError) as caught:
        ConfigReader({"resourceName": name}).resource_name("resourceName")
    assert caught.value.key == "resourceName"
    assert "too long for a unix socket path" in caught.value.reason
