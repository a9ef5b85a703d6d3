"""The configuration file of ``devplugin run``: SDK keys plus the backend's own options.

One YAML file holds the backend to run, the paths, the registration path, logging, metrics and
the kubelet API to serve through (``api``, with ``dra`` for Dynamic Resource Allocation); every
other top-level key is the backend's (handed to its ``from_config``). Errors name the key and the
reason. ``load_yaml`` is the one YAML reader of the SDK.
"""

from __future__ import annotations

import difflib
import math
import os
import reprlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import yaml

from devplugin_sdk import _names
from devplugin_sdk.api import constants
from devplugin_sdk.dra import Api, DeviceRule, DeviceRules, Dra
from devplugin_sdk.errors import ConfigError

__all__ = [
    "SDK_KEYS",
    "ConfigReader",
    "RunConfig",
    "load_yaml",
    "parse_run_config",
    "shown",
]

#: Top-level keys that belong to the SDK; the rest goes to the backend.
SDK_KEYS = (
    "backend",
    "devicePluginDir",
    "registration",
    "pluginsRegistryDir",
    "logging",
    "metrics",
    "cdi",
    "api",
    "dra",
)


def load_yaml(path: str | os.PathLike[str]) -> Mapping[str, Any]:
    """Read a YAML mapping from ``path``.

    Raises:
        ConfigError: unreadable file, YAML syntax error (with line and column), or not a mapping.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(str(path), f"cannot read: {exc.strerror or exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = exc.problem or exc.context or "syntax error"
        if exc.problem and exc.context and exc.context_mark:
            # "while parsing a flow sequence", from where it started: often the real mistake.
            problem += f" ({exc.context} from line {exc.context_mark.line + 1})"
        raise ConfigError(str(path), f"invalid YAML{where}: {problem}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(str(path), f"invalid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise ConfigError(str(path), f"the top level must be a mapping, got {type(data).__name__}")
    return data


def shown(value: object, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters, for error messages.

    A value from a file can be huge (or a YAML alias bomb): an error message never spells it out.
    """
    if isinstance(value, (Mapping, list, tuple, set)) and len(value) > 16:
        return f"<{type(value).__name__} of {len(value)} items>"
    text = reprlib.repr(value) if isinstance(value, (Mapping, list, tuple, set)) else repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


_UNSET: Any = object()


class ConfigReader:
    """Typed reads from one level of a YAML mapping; every error names the dotted key.

    The one reader every backend's ``from_config`` uses, so that keys, types and ranges are
    checked the same way everywhere: ``reader.section("health").number("probeInterval", 5)``
    fails with ``ConfigError("health.probeInterval", "must be a number of seconds, got 'x'")``.

    Args:
        data: The mapping (None reads as empty).
        prefix: Its dotted key (``""`` at the top level, ``resources[2]`` in a list).

    Raises:
        ConfigError: ``data`` is not a mapping.
    """

    def __init__(self, data: object, prefix: str = "") -> None:
        if data is None:
            data = {}
        if not isinstance(data, Mapping):
            raise ConfigError(prefix or "<root>", f"must be a mapping, got {type(data).__name__}")
        self.data: Mapping[str, Any] = data
        self.prefix = prefix

    def key(self, name: str) -> str:
        """The dotted key of ``name`` at this level."""
        return f"{self.prefix}.{name}" if self.prefix else name

    def has(self, name: str) -> bool:
        """Whether ``name`` is set (to anything but null)."""
        return self.data.get(name) is not None

    def known(self, *names: str, hint: Mapping[str, str] | None = None) -> None:
        """Reject keys other than ``names`` (``hint`` gives a reason for specific keys).

        The error names the unknown key, the closest known one and every known one.
        """
        hints = hint or {}
        for name in self.data:
            if name in hints:
                raise ConfigError(self.key(str(name)), hints[name])
            if name not in names:
                close = difflib.get_close_matches(str(name), names, n=1)
                guess = f"did you mean {close[0]!r}? " if close else ""
                raise ConfigError(
                    self.key(shown(name, 60) if not isinstance(name, str) else name[:60]),
                    f"unknown key; {guess}expected one of {', '.join(names)}",
                )

    def section(self, name: str) -> ConfigReader:
        """The reader of a nested mapping (empty when the key is absent or null)."""
        return ConfigReader(self.data.get(name), self.key(name))

    def sections(self, name: str, *, required: bool = False) -> list[ConfigReader]:
        """Readers of a list of mappings, keyed ``name[0]``, ``name[1]``...

        Raises:
            ConfigError: not a list, an item not a mapping, or (``required``) missing or empty.
        """
        value = self.data.get(name)
        if value is None and not required:
            return []
        if not isinstance(value, list) or (required and not value):
            raise ConfigError(self.key(name), f"must be a non-empty list, got {shown(value)}")
        return [ConfigReader(item, f"{self.key(name)}[{i}]") for i, item in enumerate(value)]

    def boolean(self, name: str, default: bool) -> bool:
        value = self.data.get(name, default)
        if not isinstance(value, bool):
            raise ConfigError(self.key(name), f"must be true or false, got {shown(value)}")
        return value

    def integer(self, name: str, default: int, *, minimum: int, maximum: int | None = None) -> int:
        value = self.data.get(name, default)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(self.key(name), f"must be an integer, got {shown(value)}")
        if value < minimum:
            raise ConfigError(self.key(name), f"must be >= {minimum}, got {value}")
        if maximum is not None and value > maximum:
            raise ConfigError(self.key(name), f"must be <= {maximum}, got {value}")
        return value

    def number(
        self, name: str, default: float | None, *, positive: bool = False, nullable: bool = False
    ) -> float | None:
        """A number of seconds (``>= 0``, or ``> 0`` when ``positive``); None if ``nullable``."""
        value = self.data.get(name, default)
        if value is None and nullable:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
            raise ConfigError(self.key(name), f"must be a number of seconds, got {shown(value)}")
        if value < 0 or (positive and value == 0):
            raise ConfigError(self.key(name), f"must be {'> 0' if positive else '>= 0'}")
        return float(value)

    def interval(self, name: str, default: float) -> float:
        """A positive number of seconds."""
        value = self.number(name, default, positive=True)
        assert value is not None  # not nullable
        return value

    def string(self, name: str, default: str = _UNSET) -> str:
        """A non-empty string; required when no default is given."""
        value = self.data.get(name, default)
        if value is _UNSET:
            raise ConfigError(self.key(name), "is required")
        if not isinstance(value, str) or not value:
            raise ConfigError(self.key(name), f"must be a non-empty string, got {shown(value)}")
        return value

    def optional_string(self, name: str) -> str | None:
        """A non-empty string, or None when absent or null."""
        return self.string(name) if self.has(name) else None

    def choice(self, name: str, allowed: Sequence[str], default: str = _UNSET) -> str:
        value = self.data.get(name, default)
        if value is _UNSET:
            raise ConfigError(self.key(name), f"is required: one of {', '.join(allowed)}")
        if not isinstance(value, str) or value not in allowed:
            raise ConfigError(
                self.key(name), f"must be one of {', '.join(allowed)}, got {shown(value)}"
            )
        return value

    def choices(
        self, name: str, allowed: Sequence[str], default: tuple[str, ...]
    ) -> tuple[str, ...]:
        """One of ``allowed`` or a non-empty list of them (duplicates dropped, order kept)."""
        value = self.data.get(name, list(default))
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list) or not items:
            raise ConfigError(
                self.key(name), f"must be one of {', '.join(allowed)} or a non-empty list of them"
            )
        for i, item in enumerate(items):
            if not isinstance(item, str) or item not in allowed:
                raise ConfigError(
                    f"{self.key(name)}[{i}]",
                    f"must be one of {', '.join(allowed)}, got {shown(item)}",
                )
        return tuple(dict.fromkeys(items))

    def strings(
        self, name: str, default: Sequence[str] = (), *, required: bool = False
    ) -> tuple[str, ...]:
        """A list of non-empty strings (a single string is not a list)."""
        value = self.data.get(name)
        if value is None:
            if required:
                raise ConfigError(self.key(name), "is required: a non-empty list of strings")
            return tuple(default)
        if not isinstance(value, list) or (required and not value):
            what = "a non-empty list" if required else "a list"
            raise ConfigError(self.key(name), f"must be {what} of strings, got {shown(value)}")
        for i, item in enumerate(value):
            if not isinstance(item, str) or not item:
                raise ConfigError(
                    f"{self.key(name)}[{i}]", f"must be a non-empty string, got {shown(item)}"
                )
        return tuple(value)

    def integers(self, name: str, default: frozenset[int], *, minimum: int) -> frozenset[int]:
        """A list of integers ``>= minimum``; ``default`` when absent."""
        value = self.data.get(name)
        if value is None:
            return default
        if not isinstance(value, list):
            raise ConfigError(self.key(name), f"must be a list of integers, got {shown(value)}")
        for i, item in enumerate(value):
            if isinstance(item, bool) or not isinstance(item, int) or item < minimum:
                raise ConfigError(
                    f"{self.key(name)}[{i}]", f"must be an integer >= {minimum}, got {shown(item)}"
                )
        return frozenset(value)

    def string_map(self, name: str) -> dict[str, str]:
        """A mapping of strings to strings (environment variables, labels...)."""
        section = self.section(name)
        for key, value in section.data.items():
            if not isinstance(key, str) or not key:
                raise ConfigError(
                    self.key(name), f"keys must be non-empty strings, got {shown(key)}"
                )
            if not isinstance(value, str):
                raise ConfigError(section.key(key), f"must be a string, got {shown(value)}")
        return dict(section.data)

    def path(self, name: str, default: str | Path) -> Path:
        """An absolute path."""
        value = self.string(name, str(default))
        if not value.startswith("/"):
            raise ConfigError(self.key(name), f"must be an absolute path, got {shown(value)}")
        if "\0" in value:
            raise ConfigError(self.key(name), "must not contain NUL")
        return Path(value)

    def resource_name(self, name: str, default: str = _UNSET, *, domain: str | None = None) -> str:
        """An extended resource name the kubelet accepts (``vendor.com/thing``).

        With ``domain``, a bare name (no ``/``) stands for ``<domain>/<name>``, which is returned.
        """
        value = self.string(name, default)
        if domain is not None and "/" not in value:
            value = f"{domain}/{value}"
        problem = _names.resource_name_problem(value)
        if problem is not None:
            raise ConfigError(self.key(name), f"invalid resource name {shown(value)}: {problem}")
        try:
            # The plugin's default socket is named after the resource: it must be valid too.
            _names.validate_socket_name(_names.default_socket_name(value))
        except ValueError as exc:
            raise ConfigError(self.key(name), f"{shown(value)}: {exc}") from None
        return value

    def domain(self, name: str, default: str = _UNSET) -> str:
        """The domain part of extended resource names (``vendor.com``), as the kubelet takes it."""
        value = self.string(name, default)
        problem = _names.resource_name_problem(f"{value}/x")
        if problem is not None:
            raise ConfigError(
                self.key(name), f"invalid resource-name domain {shown(value)}: {problem}"
            )
        return value


@dataclass(frozen=True, slots=True)
class RunConfig:
    """What ``devplugin run`` takes from its configuration file.

    Attributes:
        backend: Built-in backend name or ``MODULE:ATTR``; None when only the CLI names it.
        device_plugin_dir: The kubelet's device-plugin directory.
        registration: ``auto``, ``kubelet`` or ``watcher``.
        plugins_registry_dir: The plugin-watcher directory.
        log_level: Logging level name.
        log_format: ``text`` or ``json``.
        metrics_port: Port of /healthz, /metrics and /status; None for none.
        metrics_host: Address to bind it to; None for every interface.
        stuck_after: Seconds an unsent device list may wait before /healthz fails.
        cdi_dir: Serve every plugin through CDI, writing specs here (``cdi.use_cdi``); None
            hands out device nodes, mounts and env directly.
        api: ``devicePlugin``, ``dra`` or ``both`` (``runner.serve``'s ``api``).
        dra: The DRA driver (the ``dra`` section), with ``api`` ``dra`` or ``both``.
        backend_options: Every other top-level key, for the backend's ``from_config``.
    """

    backend: str | None = None
    device_plugin_dir: Path = Path(constants.DEVICE_PLUGIN_PATH)
    registration: str = "auto"
    plugins_registry_dir: Path = Path(constants.PLUGINS_REGISTRY_PATH)
    log_level: str = "info"
    log_format: str = "text"
    metrics_port: int | None = None
    metrics_host: str | None = None
    stuck_after: float = 30.0
    cdi_dir: Path | None = None
    api: Api = "devicePlugin"
    dra: Dra | None = None
    backend_options: Mapping[str, Any] = field(default_factory=dict)

    def restart_needed(self, other: RunConfig) -> list[str]:
        """Keys whose change a hot reload cannot apply (they need a process restart)."""
        fixed = {
            "backend": (self.backend, other.backend),
            "devicePluginDir": (self.device_plugin_dir, other.device_plugin_dir),
            "registration": (self.registration, other.registration),
            "pluginsRegistryDir": (self.plugins_registry_dir, other.plugins_registry_dir),
            "cdi": (self.cdi_dir, other.cdi_dir),
            "api": (self.api, other.api),
            "dra": (self.dra, other.dra),
            "metrics": (
                (self.metrics_port, self.metrics_host, self.stuck_after),
                (other.metrics_port, other.metrics_host, other.stuck_after),
            ),
        }
        return [key for key, (old, new) in fixed.items() if old != new]


def _string(
    data: Mapping[str, Any], key: str, where: str, choices: tuple[str, ...] = ()
) -> str | None:
    value = data.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{where}{key}", f"must be a non-empty string, got {value!r}")
    if choices and value not in choices:
        raise ConfigError(f"{where}{key}", f"must be one of {', '.join(choices)}, got {value!r}")
    return value


def _mapping(data: Mapping[str, Any], key: str, allowed: tuple[str, ...]) -> Mapping[str, Any]:
    reader = ConfigReader(data.get(key), key)
    reader.known(*allowed)
    return reader.data


def parse_run_config(data: Mapping[str, Any]) -> RunConfig:
    """Split and validate a ``devplugin run`` configuration mapping.

    Raises:
        ConfigError: naming the key and the reason.
    """
    logging_ = _mapping(data, "logging", ("level", "format"))
    cdi = _mapping(data, "cdi", ("directory",))
    cdi_dir: Path | None = None
    if "cdi" in data:
        directory = _string(cdi, "directory", "cdi.") or "/var/run/cdi"
        if not directory.startswith("/"):
            raise ConfigError("cdi.directory", f"must be an absolute path, got {directory!r}")
        cdi_dir = Path(directory)
    metrics = _mapping(data, "metrics", ("port", "host", "stuckAfter"))
    port = metrics.get("port")
    if port is not None and (
        isinstance(port, bool) or not isinstance(port, int) or not 0 <= port < 65536
    ):
        raise ConfigError("metrics.port", f"must be a TCP port number, got {port!r}")
    stuck = metrics.get("stuckAfter", 30.0)
    if isinstance(stuck, bool) or not isinstance(stuck, (int, float)) or stuck <= 0:
        raise ConfigError("metrics.stuckAfter", f"must be a number of seconds > 0, got {stuck!r}")
    level = _string(logging_, "level", "logging.", ("debug", "info", "warning", "error")) or "info"
    fmt = _string(logging_, "format", "logging.", ("text", "json")) or "text"
    registration = _string(data, "registration", "", ("auto", "kubelet", "watcher")) or "auto"
    dp_dir = _string(data, "devicePluginDir", "") or constants.DEVICE_PLUGIN_PATH
    reg_dir = _string(data, "pluginsRegistryDir", "") or constants.PLUGINS_REGISTRY_PATH
    for key, value in (("devicePluginDir", dp_dir), ("pluginsRegistryDir", reg_dir)):
        if not value.startswith("/"):
            raise ConfigError(key, f"must be an absolute path, got {value!r}")
    api, dra = _parse_dra(data)
    return RunConfig(
        backend=_string(data, "backend", ""),
        device_plugin_dir=Path(dp_dir),
        registration=registration,
        plugins_registry_dir=Path(reg_dir),
        log_level=level,
        log_format=fmt,
        metrics_port=port,
        metrics_host=_string(metrics, "host", "metrics."),
        stuck_after=float(stuck),
        cdi_dir=cdi_dir,
        api=api,
        dra=dra,
        backend_options={k: v for k, v in data.items() if k not in SDK_KEYS},
    )


def _parse_dra(data: Mapping[str, Any]) -> tuple[Api, Dra | None]:
    """``api`` and the ``dra`` section."""
    top = ConfigReader(data)
    api = cast(Api, top.choice("api", ("devicePlugin", "dra", "both"), "devicePlugin"))
    if not top.has("dra"):
        if api != "devicePlugin":
            raise ConfigError("dra", f"is required with api: {api} (at least dra.driver)")
        return api, None
    if api == "devicePlugin":
        raise ConfigError("dra", "is set but api is devicePlugin; say api: dra or api: both")
    section = top.section("dra")
    section.known("driver", "nodeName", "kubeconfig", "pluginDir", "cdiDir", "devices")
    driver = section.string("driver")
    problem = _names.driver_name_problem(driver)
    if problem is not None:
        raise ConfigError(
            section.key("driver"), f"invalid DRA driver name {shown(driver)}: {problem}"
        )
    node = section.optional_string("nodeName")
    if node is not None and (_names.pool_name_problem(node) is not None or "/" in node):
        raise ConfigError(section.key("nodeName"), f"{shown(node)} is not a node name")
    rules = tuple(_device_rule(rule) for rule in section.sections("devices"))
    return api, Dra(
        driver=driver,
        node_name=node,
        kubeconfig=section.path("kubeconfig", "/") if section.has("kubeconfig") else None,
        plugin_dir=section.path("pluginDir", "/") if section.has("pluginDir") else None,
        cdi_dir=section.path("cdiDir", "/var/run/cdi"),
        devices=DeviceRules(rules) if rules else None,
    )


def _device_rule(rule: ConfigReader) -> DeviceRule:
    """One entry of ``dra.devices``: ``resource``, ``ids`` (globs), ``attributes``."""
    rule.known("resource", "ids", "attributes")
    if not rule.data:
        raise ConfigError(rule.prefix, "an empty rule would match every device; give a field")
    attributes: dict[str, tuple[Any, ...]] = {}
    section = rule.section("attributes")
    for name, value in section.data.items():
        problem = _names.attribute_name_problem(name) if isinstance(name, str) else "not a string"
        if problem is not None:
            raise ConfigError(section.key(str(name)), f"invalid attribute name: {problem}")
        values = value if isinstance(value, list) else [value]
        for item in values:
            if not isinstance(item, (str, int, bool)) or item == "":
                raise ConfigError(
                    section.key(name),
                    f"values must be strings, integers or booleans, got {shown(item)}",
                )
        attributes[name] = tuple(values)
    return DeviceRule(
        resource=rule.optional_string("resource"),
        ids=rule.strings("ids"),
        attributes=attributes,
    )
