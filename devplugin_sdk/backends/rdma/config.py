"""The RDMA backend's configuration keys: ``load_config`` validates ``resources`` (each device goes
to the first resource whose selectors match it) and the settings they share.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from devplugin_sdk import cdi
from devplugin_sdk.allocation import check_share_count
from devplugin_sdk.backends.rdma.selection import (
    _ENV_NAME,
    _HEX_ID,
    _LINK_TYPES,
    Mode,
    RdmaResource,
    Selector,
)
from devplugin_sdk.config import ConfigReader, shown
from devplugin_sdk.errors import ConfigError

__all__ = ["SCHEMA", "RdmaConfig", "load_config"]


@dataclass(frozen=True, slots=True)
class RdmaConfig:
    """A validated RDMA configuration: resources plus the settings they share.

    Args:
        resources: One per served resource, in config order.
        sysfs_root: Where sysfs is read (``sysfsRoot``).
        dev_root: Where device nodes are checked (``devRoot``).
        rescan_interval: Seconds between rescans, which re-read port state
            (``healthInterval``).
    """

    resources: tuple[RdmaResource, ...]
    sysfs_root: Path = Path("/sys")
    dev_root: Path = Path("/dev")
    rescan_interval: float = 5.0


_MODES: tuple[Mode, ...] = ("exclusive", "shared")
# What an absent key reads as.
_DEFAULT: dict[str, Any] = {f.name: f.default for f in fields(RdmaConfig)}


# YAML key -> Selector field; the keys of the Mellanox and SR-IOV plugins' selectors.
_SELECTOR_KEYS = {
    "vendors": "vendors",
    "deviceIDs": "device_ids",
    "drivers": "drivers",
    "ifNames": "if_names",
    "linkTypes": "link_types",
    "rdmaDevices": "rdma_devices",
    "pciAddresses": "pci_addresses",
}

# The keys, as JSON Schema: ``load_config`` takes each level's keys from here (``known``), and
# schemas/rdma.json is generated from it (scripts/gen_schemas.py).
_PATH = {"type": "string", "pattern": "^/", "description": "an absolute path"}
_STRINGS = {"type": "array", "items": {"type": "string", "minLength": 1}}
_SELECTOR: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        **{key: dict(_STRINGS) for key in _SELECTOR_KEYS},
        "vendors": {"type": "array", "items": {"type": "string", "pattern": _HEX_ID.pattern}},
        "deviceIDs": {"type": "array", "items": {"type": "string", "pattern": _HEX_ID.pattern}},
        "linkTypes": {"type": "array", "items": {"type": "string", "minLength": 1}},
    },
}
_RESOURCE: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": ["resourceName"],
    "properties": {
        "resourceName": {"type": "string", "minLength": 1, "description": "vendor.com/name"},
        "mode": {"enum": list(_MODES), "default": "exclusive"},
        "shares": {
            "type": "integer",
            "minimum": 1,
            "description": "mode shared: containers per HCA",
        },
        "selectors": {
            "anyOf": [_SELECTOR, {"type": "array", "minItems": 1, "items": _SELECTOR}],
            "description": "absent: every device; a list: any group matches",
        },
        "ports": {"type": "array", "items": {"type": "integer", "minimum": 1}},
        "issm": {"type": "boolean", "default": True},
        "rdmaCm": {"type": "boolean", "default": True},
        "cdiKind": {"type": "string", "minLength": 1, "description": "vendor.com/class"},
        "envPrefix": {"type": "string", "pattern": _ENV_NAME.pattern, "default": "RDMA"},
    },
}
#: The backend's keys as a JSON Schema object (its part of a ``devplugin run`` file).
SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["resources"],
    "properties": {
        "resources": {"type": "array", "minItems": 1, "items": _RESOURCE},
        "sysfsRoot": {**_PATH, "default": str(_DEFAULT["sysfs_root"])},
        "devRoot": {**_PATH, "default": str(_DEFAULT["dev_root"])},
        "healthInterval": {
            "type": "number",
            "exclusiveMinimum": 0,
            "default": _DEFAULT["rescan_interval"],
            "description": "seconds between rescans (port state)",
        },
    },
}


def load_config(config: Mapping[str, Any]) -> RdmaConfig:
    """Validate the backend's keys (see ``examples/rdma/config.yaml``).

    Each device goes to the first resource, in config order, whose selectors match it, so an
    HCA is never served twice by accident.

    Args:
        config: The mapping, with ``resources`` and optional ``sysfsRoot``, ``devRoot``,
            ``healthInterval``.

    Returns:
        The validated configuration.

    Raises:
        ConfigError: naming the dotted key and what is wrong with it.
    """
    top = ConfigReader(config)
    top.known(*SCHEMA["properties"])
    sysfs_root = top.path("sysfsRoot", _DEFAULT["sysfs_root"])
    dev_root = top.path("devRoot", _DEFAULT["dev_root"])
    interval = top.interval("healthInterval", _DEFAULT["rescan_interval"])
    resources: list[RdmaResource] = []
    claimed: list[Selector] = []
    for reader in top.sections("resources", required=True):
        resource = _resource(reader, tuple(claimed))
        if any(r.resource_name == resource.resource_name for r in resources):
            raise ConfigError(
                reader.key("resourceName"), f"duplicate {shown(resource.resource_name)}"
            )
        claimed.extend(resource.selectors)
        resources.append(resource)
    return RdmaConfig(
        resources=tuple(resources),
        sysfs_root=sysfs_root,
        dev_root=dev_root,
        rescan_interval=interval,
    )


def _resource(reader: ConfigReader, exclude: tuple[Selector, ...]) -> RdmaResource:
    reader.known(*_RESOURCE["properties"])
    name = reader.resource_name("resourceName")
    mode = reader.choice("mode", _MODES, "exclusive")
    if mode == "shared":
        if not reader.has("shares"):
            raise ConfigError(reader.key("shares"), "is required in mode 'shared'")
        shares = reader.integer("shares", 1, minimum=1)
        check_share_count(reader.key("shares"), shares)
    elif reader.has("shares"):
        raise ConfigError(reader.key("shares"), "only applies to mode 'shared'")
    else:
        shares = 1
    cdi_kind = reader.optional_string("cdiKind")
    if cdi_kind is not None:
        try:
            cdi.validate_kind(cdi_kind)
        except ValueError as exc:
            raise ConfigError(reader.key("cdiKind"), str(exc)) from None
    prefix = reader.string("envPrefix", "RDMA")
    if not _ENV_NAME.match(prefix):
        raise ConfigError(
            reader.key("envPrefix"), f"must be a valid variable name, got {shown(prefix)}"
        )
    return RdmaResource(
        resource_name=name,
        selectors=_selectors(reader),
        mode="shared" if mode == "shared" else "exclusive",
        shares=shares,
        ports=tuple(sorted(reader.integers("ports", frozenset(), minimum=1))),
        issm=reader.boolean("issm", True),
        rdma_cm=reader.boolean("rdmaCm", True),
        cdi_kind=cdi_kind,
        env_prefix=prefix,
        exclude=exclude,
    )


def _selectors(reader: ConfigReader) -> tuple[Selector, ...]:
    """``selectors``: absent (every device), one group, or a non-empty list of groups."""
    raw = reader.data.get("selectors")
    if raw is None:
        return (Selector(),)
    if isinstance(raw, list):
        groups = reader.sections("selectors", required=True)
    else:
        groups = [reader.section("selectors")]
    return tuple(_selector(group) for group in groups)


def _selector(group: ConfigReader) -> Selector:
    """One selector group, every value checked here so that ``Selector`` never refuses it."""
    group.known(*_SELECTOR["properties"])
    values = {key: group.strings(key) for key in _SELECTOR_KEYS}
    for key in ("vendors", "deviceIDs"):
        for i, value in enumerate(values[key]):
            if not _HEX_ID.match(value):
                raise ConfigError(
                    f"{group.key(key)}[{i}]", f"must be a 4-digit hex PCI ID, got {shown(value)}"
                )
    for i, value in enumerate(values["linkTypes"]):
        if value.lower() not in _LINK_TYPES:
            raise ConfigError(
                f"{group.key('linkTypes')}[{i}]",
                f"must be one of {', '.join(sorted(_LINK_TYPES))}, got {shown(value)}",
            )
    return Selector(**{attr: values[key] for key, attr in _SELECTOR_KEYS.items()})
