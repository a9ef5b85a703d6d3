"""The published JSON Schemas (schemas/*.json) are up to date and agree with the readers.

jsonschema is not in the locked test environment, so ``_errors`` below checks the subset of JSON
Schema the files use, and a test pins that subset: a keyword it does not know fails the suite
rather than passing unchecked.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from devplugin_sdk.cli.runfile import SDK_KEYS, parse_run_config
from devplugin_sdk.cli.schemas import schemas
from devplugin_sdk.config import load_yaml
from devplugin_sdk.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
_TYPES: dict[str, Any] = {
    "object": dict,
    "array": list,
    "string": str,
    "boolean": bool,
    "null": type(None),
}
_ANNOTATIONS = {"$schema", "$id", "title", "description", "default"}
_CHECKED = {
    "type",
    "enum",
    "const",
    "properties",
    "additionalProperties",
    "required",
    "items",
    "minItems",
    "minLength",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "pattern",
    "anyOf",
    "minProperties",
    "maxProperties",
}


def _is(value: Any, kind: str) -> bool:
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, _TYPES[kind])


def _errors(schema: Any, value: Any, where: str = "") -> Iterator[str]:  # noqa: PLR0912
    """Where ``value`` breaks ``schema`` (the subset in ``_CHECKED``), as ``dotted.key: why``."""
    if schema is True:
        return
    if schema is False:
        yield f"{where}: not allowed"
        return
    kinds = schema.get("type")
    if kinds is not None:
        kinds = [kinds] if isinstance(kinds, str) else kinds
        if not any(_is(value, k) for k in kinds):
            yield f"{where}: must be {' or '.join(kinds)}"
            return
    if "enum" in schema and value not in schema["enum"]:
        yield f"{where}: must be one of {schema['enum']}"
    if "const" in schema and value != schema["const"]:
        yield f"{where}: must be {schema['const']!r}"
    if "anyOf" in schema and not any(not list(_errors(s, value, where)) for s in schema["anyOf"]):
        yield f"{where}: matches none of anyOf"
    if isinstance(value, dict):
        props = schema.get("properties", {})
        for key in schema.get("required", ()):
            if key not in value:
                yield f"{where}.{key}".lstrip(".") + ": is required"
        for key, item in value.items():
            dotted = f"{where}.{key}".lstrip(".")
            if key in props:
                yield from _errors(props[key], item, dotted)
            elif "additionalProperties" in schema:
                extra = schema["additionalProperties"]
                yield from (
                    _errors(extra, item, dotted)
                    if extra is not False
                    else iter([f"{dotted}: unknown key"])
                )
        if len(value) < schema.get("minProperties", 0):
            yield f"{where}: too few keys"
        if len(value) > schema.get("maxProperties", len(value)):
            yield f"{where}: too many keys"
    if isinstance(value, list):
        if len(value) < schema.get("minItems", 0):
            yield f"{where}: too few items"
        for i, item in enumerate(value):
            yield from _errors(schema.get("items", True), item, f"{where}[{i}]")
    if isinstance(value, str):
        if len(value) < schema.get("minLength", 0):
            yield f"{where}: too short"
        if "pattern" in schema and not re.search(schema["pattern"], value):
            yield f"{where}: does not match {schema['pattern']}"
    if _is(value, "number"):
        if "minimum" in schema and value < schema["minimum"]:
            yield f"{where}: below the minimum"
        if "maximum" in schema and value > schema["maximum"]:
            yield f"{where}: above the maximum"
        if "exclusiveMinimum" in schema and value <= schema["exclusiveMinimum"]:
            yield f"{where}: not above the minimum"


def _keywords(schema: Any) -> Iterator[str]:
    if not isinstance(schema, dict):
        return
    for key, value in schema.items():
        yield key
        if key == "properties":
            for item in value.values():
                yield from _keywords(item)
        elif key in ("items", "additionalProperties"):
            yield from _keywords(value)
        elif key == "anyOf":
            for item in value:
                yield from _keywords(item)


# Every run file the repository tells a user to use, and its backend; the NVIDIA example's
# subclass adds one key of its own (containerEnv), as a subclass's schema would.
_FILES = [
    *(
        (p, "generic")
        for p in sorted((ROOT / "examples/generic").glob("*.yaml"))
        if p.name != "daemonset.yaml"
    ),
    *((p, "nvidia") for p in sorted((ROOT / "examples/nvidia").glob("config*.yaml"))),
    *((p, "rdma") for p in sorted((ROOT / "examples/rdma").glob("config*.yaml"))),
    *((p, "fpga") for p in sorted((ROOT / "examples/fpga").glob("config*.yaml"))),
    *(
        (p, p.parent.name)
        for p in sorted((ROOT / "deploy/kustomize/overlays").glob("*/config*.yaml"))
    ),
]


def _schema_for(backend: str) -> dict[str, Any]:
    schema = schemas()[backend]
    if backend == "nvidia":
        extra = {"containerEnv": {"type": "object", "additionalProperties": {"type": "string"}}}
        schema = {**schema, "properties": {**schema["properties"], **extra}}
    return schema


def test_the_published_schemas_are_up_to_date() -> None:
    result = subprocess.run(
        [sys.executable, "scripts/gen_schemas.py", "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    published = {p.stem: json.loads(p.read_text()) for p in (ROOT / "schemas").glob("*.json")}
    assert published == schemas()
    assert set(published) == {"run", "generic", "nvidia", "rdma", "fpga"}


def test_the_check_here_knows_every_keyword_the_schemas_use() -> None:
    used = {key for schema in schemas().values() for key in _keywords(schema)}
    assert used <= _CHECKED | _ANNOTATIONS, used - _CHECKED - _ANNOTATIONS
    for schema in schemas().values():
        for key, item in schema["properties"].items():
            if "pattern" in item:
                re.compile(item["pattern"])  # and ECMA-262 reads the same subset
            assert not list(_errors(item, item["default"], key)) if "default" in item else True


@pytest.mark.parametrize(
    ("path", "backend"), _FILES, ids=[str(p.relative_to(ROOT)) for p, _ in _FILES]
)
def test_every_documented_run_file_validates(path: Path, backend: str) -> None:
    assert list(_errors(_schema_for(backend), dict(load_yaml(path)))) == []


@pytest.mark.parametrize(
    ("backend", "config", "error"),
    [
        ("generic", {"devRooot": "/d", "resources": []}, "devRooot: unknown key"),
        ("generic", {"resources": [{"resourceName": "a/b", "paths": ["x"]}]}, "paths[0]: does"),
        ("nvidia", {"health": {"probeIntervall": 3}}, "health.probeIntervall: unknown key"),
        ("nvidia", {"migStrategy": "all"}, "migStrategy: must be one of"),
        ("rdma", {"resources": [{"resourceName": "a/b", "mode": "x"}]}, "resources[0].mode"),
        ("fpga", {"family": "xrt", "sysfsRoot": "sys"}, "sysfsRoot: does not match"),
        ("run", {"logging": {"levle": "debug"}}, "logging.levle: unknown key"),
    ],
)
def test_a_mistake_the_reader_refuses_the_schema_refuses(
    backend: str, config: dict[str, Any], error: str
) -> None:
    found = list(_errors(schemas()[backend], config))
    assert any(error in line for line in found), found


def test_the_run_files_keys_are_the_readers() -> None:
    run = schemas()["run"]["properties"]
    assert tuple(run) == SDK_KEYS
    # Each section's keys: a bogus key is refused, listing exactly the schema's keys.
    for section, base in (
        ("logging", {}),
        ("metrics", {}),
        ("cdi", {}),
        ("dra", {"driver": "gpu.example.com"}),
    ):
        config: dict[str, Any] = {section: {**base, "bogus": 1}}
        if section == "dra":
            config["api"] = "dra"
        with pytest.raises(ConfigError) as caught:
            parse_run_config(config)
        listed = str(caught.value).rsplit("expected one of ", 1)[1].split(", ")
        assert listed == list(run[section]["properties"]), section
    rule = {"api": "dra", "dra": {"driver": "gpu.example.com", "devices": [{"bogus": 1}]}}
    with pytest.raises(ConfigError) as caught:
        parse_run_config(rule)
    listed = str(caught.value).rsplit("expected one of ", 1)[1].split(", ")
    assert listed == list(run["dra"]["properties"]["devices"]["items"]["properties"])
