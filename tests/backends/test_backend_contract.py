"""The one backend contract, checked on every built-in backend alike.

``from_config(mapping) -> list[DevicePlugin]`` takes only the mapping, speaks camelCase, and
fails with a ``ConfigError`` naming the full dotted key (with a did-you-mean for a key written in
another style), never with another exception.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import pytest

from devplugin_sdk import backends
from devplugin_sdk.errors import ConfigError

# A key each backend really has, written snake_case as the first version's fpga did.
SNAKE = {
    "generic": ("health_interval", "healthInterval"),
    "nvidia": ("sysfs_root", "sysfsRoot"),
    "fpga": ("host_dev_root", "hostDevRoot"),
    "rdma": ("dev_root", "devRoot"),
}

# A nested bad value and the dotted key its error must name.
NESTED: dict[str, tuple[dict[str, Any], str]] = {
    "generic": (
        {"resources": [{"resourceName": "a.com/b", "paths": ["/dev/b"], "share": "two"}]},
        "resources[0].share",
    ),
    "nvidia": ({"health": {"probeInterval": -1}}, "health.probeInterval"),
    "fpga": ({"family": "xrt", "vendors": [3]}, "vendors[0]"),
    "rdma": (
        {"resources": [{"resourceName": "rdma/a", "selectors": {"vendors": [15]}}]},
        "resources[0].selectors.vendors[0]",
    ),
}


def _from_config(name: str) -> Any:
    return importlib.import_module(backends.BUILTIN[name]).from_config


@pytest.mark.parametrize("name", sorted(backends.BUILTIN))
def test_from_config_takes_only_the_mapping(name: str) -> None:
    parameters = list(inspect.signature(_from_config(name)).parameters.values())
    assert len(parameters) == 1, parameters
    assert parameters[0].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD


@pytest.mark.parametrize("name", sorted(backends.BUILTIN))
def test_a_snake_case_key_is_refused_with_its_camel_case_name(name: str) -> None:
    snake, camel = SNAKE[name]
    with pytest.raises(ConfigError) as caught:
        _from_config(name)({snake: 1})
    assert caught.value.key == snake
    assert f"did you mean {camel!r}" in caught.value.reason


@pytest.mark.parametrize("name", sorted(backends.BUILTIN))
def test_a_nested_error_names_the_full_dotted_key(name: str) -> None:
    config, key = NESTED[name]
    with pytest.raises(ConfigError) as caught:
        _from_config(name)(config)
    assert caught.value.key == key


@pytest.mark.parametrize("name", sorted(backends.BUILTIN))
@pytest.mark.parametrize("config", [[], "text", 3, {"resourceName": {"a": 1}}])
def test_nonsense_is_a_config_error_never_another_exception(name: str, config: Any) -> None:
    with pytest.raises(ConfigError):
        _from_config(name)(config)
