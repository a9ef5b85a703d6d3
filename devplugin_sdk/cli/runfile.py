"""The ``devplugin run`` file: the SDK's keys beside the backend's own options.

One YAML file holds the backend to run, the paths, the registration path, logging, metrics and
the kubelet API to serve through (``api``, with ``dra`` for Dynamic Resource Allocation); every
other top-level key is the backend's (handed to its ``from_config``). Errors name the key and the
reason. The file is read by ``config.load_yaml``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from devplugin_sdk import _logging, _names
from devplugin_sdk._intervals import INTERVALS, seconds
from devplugin_sdk.api import constants
from devplugin_sdk.config import ConfigReader, FileOptions, shown
from devplugin_sdk.errors import ConfigError

if TYPE_CHECKING:
    from devplugin_sdk.dra import Api, DeviceRule, Dra

__all__ = ["SDK_KEYS", "RunConfig", "parse_run_config"]

#: Top-level keys that belong to the SDK; the rest goes to the backend.
SDK_KEYS = (
    "backend",
    "devicePluginDir",
    "registration",
    "pluginsRegistryDir",
    "rescanInterval",
    "logging",
    "metrics",
    "cdi",
    "api",
    "dra",
)


@dataclass(frozen=True, slots=True)
class RunConfig:
    """What ``devplugin run`` takes from its configuration file.

    Attributes:
        backend: Built-in backend name or ``MODULE:ATTR``; None when only the CLI names it.
        device_plugin_dir: The kubelet's device-plugin directory.
        registration: ``auto``, ``kubelet`` or ``watcher``.
        plugins_registry_dir: The plugin-watcher directory.
        rescan_interval: Seconds between rediscoveries (``Settings.rescan_interval``; 0: none);
            None for the default.
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
    rescan_interval: float | None = None
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
            "rescanInterval": (self.rescan_interval, other.rescan_interval),
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
        raise ConfigError(f"{where}{key}", f"must be a non-empty string, got {shown(value)}")
    if choices and value not in choices:
        raise ConfigError(
            f"{where}{key}", f"must be one of {', '.join(choices)}, got {shown(value)}"
        )
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
            raise ConfigError("cdi.directory", f"must be an absolute path, got {shown(directory)}")
        cdi_dir = Path(directory)
    metrics = _mapping(data, "metrics", ("port", "host", "stuckAfter"))
    port = metrics.get("port")
    if port is not None and (
        isinstance(port, bool) or not isinstance(port, int) or not 0 <= port < 65536
    ):
        raise ConfigError("metrics.port", f"must be a TCP port number (0-65535), got {shown(port)}")
    stuck = seconds(metrics.get("stuckAfter", 30.0), "metrics.stuckAfter")
    level = _string(logging_, "level", "logging.") or "info"
    try:
        _logging.parse_levels(level)
    except ValueError as exc:
        raise ConfigError("logging.level", str(exc)) from None
    fmt = _string(logging_, "format", "logging.", ("text", "json")) or "text"
    registration = _string(data, "registration", "", ("auto", "kubelet", "watcher")) or "auto"
    dp_dir = _string(data, "devicePluginDir", "") or constants.DEVICE_PLUGIN_PATH
    reg_dir = _string(data, "pluginsRegistryDir", "") or constants.PLUGINS_REGISTRY_PATH
    for key, value in (("devicePluginDir", dp_dir), ("pluginsRegistryDir", reg_dir)):
        if not value.startswith("/"):
            raise ConfigError(key, f"must be an absolute path, got {shown(value)}")
    rescan = data.get("rescanInterval")
    if rescan is not None:
        rescan = seconds(rescan, "rescanInterval")
    api, dra = _parse_dra(data)
    return RunConfig(
        backend=_string(data, "backend", ""),
        device_plugin_dir=Path(dp_dir),
        registration=registration,
        plugins_registry_dir=Path(reg_dir),
        rescan_interval=None if rescan is None else float(rescan),
        log_level=level,
        log_format=fmt,
        metrics_port=port,
        metrics_host=_string(metrics, "host", "metrics."),
        stuck_after=float(stuck),
        cdi_dir=cdi_dir,
        api=api,
        dra=dra,
        backend_options=FileOptions(
            ((k, v) for k, v in data.items() if k not in SDK_KEYS), sdk_keys=SDK_KEYS
        ),
    )


def _parse_dra(data: Mapping[str, Any]) -> tuple[Api, Dra | None]:
    """``api`` and the ``dra`` section."""
    top = ConfigReader(data)
    api = cast("Api", top.choice("api", ("devicePlugin", "dra", "both"), "devicePlugin"))
    if not top.has("dra"):
        if api != "devicePlugin":
            raise ConfigError("dra", f"is required with api: {api} (at least dra.driver)")
        return api, None
    if api == "devicePlugin":
        raise ConfigError("dra", "is set but api is devicePlugin; say api: dra or api: both")
    # Imported only for a DRA configuration: a device plugin starts faster without it.
    from devplugin_sdk.dra import DeviceRules, Dra  # noqa: PLC0415

    section = top.section("dra")
    section.known(
        "driver",
        "nodeName",
        "kubeconfig",
        "pluginDir",
        "cdiDir",
        "noExecute",
        "healthTimeout",
        "kubeletRootDir",
        "cleanupInterval",
        "devices",
    )
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
        no_execute=section.boolean("noExecute", False),
        health_timeout=section.integer(
            "healthTimeout",
            30,
            minimum=int(INTERVALS["dra.healthTimeout"].minimum),
            maximum=int(INTERVALS["dra.healthTimeout"].maximum or 0),
        ),
        kubelet_root_dir=(
            section.path("kubeletRootDir", "/") if section.has("kubeletRootDir") else None
        ),
        cleanup_interval=seconds(
            section.data.get("cleanupInterval", 600.0), section.key("cleanupInterval")
        ),
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
    from devplugin_sdk.dra import DeviceRule  # noqa: PLC0415 - see _parse_dra

    return DeviceRule(
        resource=rule.optional_string("resource"),
        ids=rule.strings("ids"),
        attributes=attributes,
    )
