"""The generic backend's configuration keys: ``from_config`` reads ``resources`` (each a
shorthand of globs or a list of groups) into one ``GenericPlugin`` each, and every error names the
dotted key and what is wrong with it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from devplugin_sdk.allocation import check_share_count
from devplugin_sdk.backends.generic.groups import (
    _HEX_ID,
    GROUP_BY,
    USB_CLASSES,
    Group,
    PathSpec,
    PathType,
    UsbSpec,
    _group_by_problem,
    _mount_path_problem,
    _pattern_problem,
    _permissions_problem,
)
from devplugin_sdk.backends.generic.plugin import DEFAULT_HEALTH_INTERVAL, GenericPlugin
from devplugin_sdk.config import ConfigReader, shown
from devplugin_sdk.errors import ConfigError
from devplugin_sdk.plugin import DevicePlugin

__all__ = ["SCHEMA", "from_config"]

# The keys, as JSON Schema: ``from_config`` takes each level's keys from here (``known``), and
# schemas/generic.json is generated from it (scripts/gen_schemas.py).
_PATH = {"type": "string", "pattern": "^/", "description": "an absolute path"}
_HEX = {"type": "string", "pattern": _HEX_ID.pattern}
_SHARES = {"type": "integer", "minimum": 1, "default": 1}
_PATH_SPEC: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": ["path"],
    "properties": {
        "path": {**_PATH, "description": "an absolute glob; each match is one node or mount"},
        "mountPath": {**_PATH, "description": "where the container sees it (default: path)"},
        "type": {"enum": ["Device", "Mount"], "default": "Device"},
        "readOnly": {"type": "boolean", "default": False, "description": "type: Mount only"},
        "permissions": {
            "type": "string",
            "pattern": r"^(?!.*(.).*\1)[rwm]{1,3}$",
            "default": "rw",
            "description": "type: Device only: the cgroup access (r, w, m)",
        },
        "optional": {"type": "boolean", "default": False},
    },
}
_USB_SPEC: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": ["vendor", "product"],
    "properties": {
        "vendor": {**_HEX, "description": 'USB vendor ID in quotes, e.g. "0403"'},
        "product": {**_HEX, "description": 'USB product ID in quotes, e.g. "6001"'},
        "serial": {"type": "string", "minLength": 1},
        "include": {
            "anyOf": [
                {"enum": list(USB_CLASSES)},
                {"type": "array", "minItems": 1, "items": {"enum": list(USB_CLASSES)}},
            ]
        },
    },
}
_GROUP: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "paths": {"type": "array", "items": _PATH_SPEC},
        "usb": {"type": "array", "items": _USB_SPEC},
        "shared": {"type": "array", "items": _PATH_SPEC},
        "groupBy": {"enum": list(GROUP_BY)},
        "pciVendors": {"type": "array", "minItems": 1, "items": _HEX},
        "count": {**_SHARES, "description": "containers per device of the group"},
    },
}
_RESOURCE: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": ["resourceName"],
    "properties": {
        "resourceName": {"type": "string", "minLength": 1, "description": "vendor.com/name"},
        "paths": {
            "type": "array",
            "minItems": 1,
            "items": {"type": "string", "pattern": "^/"},
            "description": "absolute globs; each match is one device",
        },
        "share": {**_SHARES, "description": "containers per match (IDs get ::N)"},
        "groups": {"type": "array", "minItems": 1, "items": _GROUP},
    },
}
#: The backend's keys as a JSON Schema object (its part of a ``devplugin run`` file).
SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["resources"],
    "properties": {
        "resources": {"type": "array", "minItems": 1, "items": _RESOURCE},
        "healthInterval": {
            "type": "number",
            "exclusiveMinimum": 0,
            "default": DEFAULT_HEALTH_INTERVAL,
            "description": "seconds between full rescans",
        },
        "sysfsRoot": {**_PATH, "default": "/sys"},
        "devRoot": {**_PATH, "default": "/dev"},
    },
}


def _keys(schema: Mapping[str, Any]) -> tuple[str, ...]:
    return tuple(schema["properties"])


def from_config(config: Mapping[str, Any]) -> list[DevicePlugin]:
    """One ``GenericPlugin`` per entry of ``resources`` (the backend contract of ``devplugin run``).

    The keys::

        healthInterval: 2                   # optional: seconds between full rescans
        sysfsRoot: /sys                     # optional: where sysfs is read
        devRoot: /dev                       # optional: where paths under /dev are read
        resources:
          - resourceName: example.com/widget  # extended resource name, unique in the file
            paths: ["/dev/widget*"]           # the shorthand: each existing match is one device
            share: 1                          # optional: containers per match (IDs get ::N)
          - resourceName: amd.com/gpu
            groups:                           # or groups: see docs/configuration.md
              - groupBy: pciDevice
                pciVendors: ["1002"]
                paths: [{path: "/dev/dri/renderD*"}, {path: "/dev/dri/card*"}]
                shared: [{path: /dev/kfd}]

    Args:
        config: The backend's part of the configuration file (its top-level keys less the
            SDK's own).

    Returns:
        The plugins, in configuration order.

    Raises:
        ConfigError: naming the dotted key (``resources[1].groups[0].paths[2].type``) and what
            is wrong with it.
    """
    reader = ConfigReader(config)
    reader.known(*_keys(SCHEMA))
    interval = reader.interval("healthInterval", DEFAULT_HEALTH_INTERVAL)
    sysfs_root = reader.path("sysfsRoot", "/sys")
    dev_root = reader.path("devRoot", "/dev")
    plugins: list[DevicePlugin] = []
    first_seen: dict[str, str] = {}
    for entry in reader.sections("resources", required=True):
        entry.known(
            *_keys(_RESOURCE),
            hint={"name": "renamed to resourceName (the key every backend uses)"},
        )
        name = entry.resource_name("resourceName")
        if name in first_seen:
            raise ConfigError(
                entry.key("resourceName"), f"duplicate of {first_seen[name]} ({shown(name)})"
            )
        first_seen[name] = entry.key("resourceName")
        paths, share, groups = _devices(entry)
        plugins.append(
            GenericPlugin(
                name,
                paths,
                share,
                groups=groups,
                sysfs_root=sysfs_root,
                dev_root=dev_root,
                health_interval=interval,
                config_key=entry.prefix,
            )
        )
    return plugins


def _shares(reader: ConfigReader, name: str) -> int:
    """A count of containers per device (``share``, a group's ``count``); the list of what is
    found is checked again at discovery, when the devices are known."""
    count = reader.integer(name, 1, minimum=1)
    check_share_count(reader.key(name), count)
    return count


def _devices(entry: ConfigReader) -> tuple[Sequence[str], int, list[Group]]:
    """One resource's devices: the shorthand's globs and share, or its groups."""
    if entry.has("groups"):
        for key, why in (
            ("paths", "give either paths (one device per match) or groups, not both"),
            ("share", "is for paths; with groups, give each group a count"),
        ):
            if entry.has(key):
                raise ConfigError(entry.key(key), why)
        return (), 1, [_group(group) for group in entry.sections("groups", required=True)]
    if not entry.has("paths"):
        raise ConfigError(
            entry.key("paths"), "is required: a non-empty list of path globs (or give groups)"
        )
    paths = entry.strings("paths", required=True)
    for number, pattern in enumerate(paths):
        problem = _pattern_problem(pattern)
        if problem is not None:
            raise ConfigError(f"{entry.key('paths')}[{number}]", f"{problem}, got {shown(pattern)}")
    return paths, _shares(entry, "share"), []


def _group(reader: ConfigReader) -> Group:
    reader.known(*_keys(_GROUP))
    paths = tuple(_path_spec(item) for item in reader.sections("paths"))
    usb = tuple(_usb_spec(item) for item in reader.sections("usb"))
    shared = tuple(_path_spec(item) for item in reader.sections("shared"))
    if paths and usb:
        raise ConfigError(reader.key("usb"), "a group has paths or usb, not both")
    if not paths and not usb:
        raise ConfigError(
            reader.key("paths"), "a group needs paths (a non-empty list) or usb: it has no device"
        )
    group_by: str | None = None
    if reader.has("groupBy"):
        group_by = reader.choice("groupBy", GROUP_BY)
        if usb:
            raise ConfigError(reader.key("groupBy"), "groups paths; a usb group has none")
        for k, spec in enumerate(paths):
            problem = _group_by_problem(group_by, (spec,))
            if problem is not None:
                key = "type" if spec.mount else "path"
                raise ConfigError(f"{reader.key('paths')}[{k}].{key}", problem)
    pci_vendors: tuple[str, ...] = ()
    if reader.has("pciVendors"):
        if group_by is None:
            raise ConfigError(reader.key("pciVendors"), "needs groupBy: pciDevice")
        pci_vendors = reader.strings("pciVendors", required=True)
        for i, vendor in enumerate(pci_vendors):
            if not _HEX_ID.match(vendor):
                raise ConfigError(
                    f"{reader.key('pciVendors')}[{i}]",
                    f"must be a PCI vendor ID of 1 to 4 hex digits, got {shown(vendor)}",
                )
    count = _shares(reader, "count")
    return Group(paths, usb, shared, group_by, pci_vendors, count)


def _path_spec(reader: ConfigReader) -> PathSpec:
    reader.known(*_keys(_PATH_SPEC))
    path = reader.string("path")
    problem = _pattern_problem(path)
    if problem is not None:
        raise ConfigError(reader.key("path"), f"{problem}, got {shown(path)}")
    mount_path = reader.optional_string("mountPath")
    if mount_path is not None:
        problem = _mount_path_problem(mount_path)
        if problem is not None:
            raise ConfigError(reader.key("mountPath"), f"{problem}, got {shown(mount_path)}")
    kind: PathType = (
        "Mount" if reader.choice("type", ("Device", "Mount"), "Device") == "Mount" else "Device"
    )
    read_only = reader.boolean("readOnly", False)
    if "readOnly" in reader.data and kind == "Device":
        raise ConfigError(
            reader.key("readOnly"),
            "is for type: Mount; a device node's access is its permissions (r, rw, rwm)",
        )
    permissions = "rw"
    if "permissions" in reader.data:
        if kind == "Mount":
            raise ConfigError(
                reader.key("permissions"), "is for type: Device; a mount has readOnly"
            )
        value = reader.data["permissions"]
        problem = _permissions_problem(value)
        if problem is not None:
            raise ConfigError(reader.key("permissions"), problem)
        permissions = value
    optional = reader.boolean("optional", False)
    return PathSpec(path, mount_path, kind, read_only, permissions, optional)


def _usb_spec(reader: ConfigReader) -> UsbSpec:
    reader.known(*_keys(_USB_SPEC))
    ids: dict[str, str] = {}
    for name in ("vendor", "product"):
        value = reader.data.get(name)
        if value is None:
            raise ConfigError(reader.key(name), 'is required: a hex ID in quotes, e.g. "0403"')
        if not isinstance(value, str):
            # YAML reads 0403 as the octal number 259 and 1209 as a decimal: IDs are text.
            raise ConfigError(
                reader.key(name),
                f'must be a hex ID in quotes, e.g. "0403" (YAML read a {type(value).__name__}: '
                f"{shown(value)})",
            )
        if not _HEX_ID.match(value):
            raise ConfigError(reader.key(name), f"must be 1 to 4 hex digits, got {shown(value)}")
        ids[name] = value
    serial = reader.optional_string("serial")
    include = reader.choices("include", USB_CLASSES, ()) if reader.has("include") else ()
    return UsbSpec(ids["vendor"], ids["product"], serial, include)
