"""A key that no reader asked for is a typo, reported by ``ConfigReader`` itself (issue 27, item 5).

A backend author reads the keys they need; the reader remembers which keys of each mapping were
looked up, and ``devplugin run`` (or a ``with ConfigReader(...)`` block) refuses the rest, naming
the dotted key and the closest key that was read. Nobody has to list the keys with ``known()``.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from cli_process import devplugin, error_line

from devplugin_sdk.config import ConfigReader, FileOptions
from devplugin_sdk.errors import ConfigError

# A third-party backend as a newcomer writes it: typed reads, no known().
_BACKEND = """
from collections.abc import Mapping, Sequence
from typing import Any

from devplugin_sdk import Device, DevicePlugin
from devplugin_sdk.config import ConfigReader


class AcmePlugin(DevicePlugin):
    resource_name = "acme.com/widget"

    def __init__(self, dev_root: str, interval: float) -> None:
        super().__init__()
        self.dev_root = dev_root

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> "AcmePlugin":
        reader = ConfigReader(config)
        health = reader.section("health")
        return cls(str(reader.path("devRoot", "/dev")), health.interval("probeInterval", 5))

    async def discover(self) -> Sequence[Device]:
        return []
"""


def _run(tmp_path: Path, config: str) -> str:
    (tmp_path / "acme_backend.py").write_text(_BACKEND)
    (tmp_path / "config.yaml").write_text(textwrap.dedent(config))
    plugins = tmp_path / "kubelet"
    plugins.mkdir()
    result = devplugin(
        "run",
        "acme_backend:AcmePlugin",
        "--config",
        "config.yaml",
        "--device-plugin-dir",
        str(plugins),
        "--registration",
        "kubelet",
        cwd=tmp_path,
    )
    return error_line(result)


def test_a_misspelt_key_of_a_third_party_backend_stops_devplugin_run(tmp_path: Path) -> None:
    line = _run(tmp_path, "devRooot: /tmp/acme\n")
    assert line.startswith("devplugin: error: devRooot: unknown key; did you mean 'devRoot'?"), line
    assert "devRoot" in line.split("expected one of", 1)[1]


def test_a_misspelt_nested_key_names_its_dotted_key(tmp_path: Path) -> None:
    line = _run(tmp_path, "health:\n  probeIntervall: 3\n")
    assert "health.probeIntervall: unknown key; did you mean 'probeInterval'?" in line, line


def test_a_misspelt_sdk_key_beside_a_third_party_backend_is_suggested(tmp_path: Path) -> None:
    line = _run(tmp_path, "loging: {level: debug}\n")
    assert "loging: unknown key; did you mean 'logging'?" in line, line


def test_every_key_read_is_accepted() -> None:
    data = {"devRoot": "/d", "health": {"probeInterval": 2}, "labels": {"a": "b"}, "flag": None}
    with ConfigReader(data) as reader:
        reader.path("devRoot", "/dev")
        reader.section("health").interval("probeInterval", 5)
        reader.string_map("labels")  # every key of a free-form mapping is read
        assert not reader.has("flag")  # asked about: known, though null


def test_keys_read_through_data_count_as_read() -> None:
    with ConfigReader({"raw": 1, "maybe": 2}) as reader:
        assert reader.data["raw"] == 1
        assert "maybe" in reader.data


def test_the_with_block_reports_the_first_unread_key_with_did_you_mean() -> None:
    with pytest.raises(ConfigError) as caught, ConfigReader({"devRooot": "/x"}) as reader:
        reader.path("devRoot", "/dev")
    assert (
        str(caught.value)
        == "devRooot: unknown key; did you mean 'devRoot'? expected one of devRoot"
    )


def test_a_typo_that_causes_a_missing_key_is_reported_as_the_typo() -> None:
    with pytest.raises(ConfigError) as caught, ConfigReader({"resourcess": []}) as reader:
        reader.sections("resources", required=True)
    assert caught.value.key == "resourcess"
    assert "did you mean 'resources'?" in str(caught.value)


def test_keys_a_backend_reads_from_the_mapping_itself_are_not_reported() -> None:
    options = FileOptions({"devRoot": "/x", "other": 1}, sdk_keys=("backend",))
    reader = ConfigReader(options)
    reader.path("devRoot", "/dev")
    assert options.get("other") == 1  # read without the reader
    options.check_read()


def test_an_unread_key_of_the_file_is_reported_with_the_sdk_keys() -> None:
    options = FileOptions({"devRooot": "/x"}, sdk_keys=("backend", "logging"))
    ConfigReader(options).path("devRoot", "/dev")
    with pytest.raises(ConfigError, match=r"^devRooot: unknown key; did you mean 'devRoot'\? "):
        options.check_read()
