"""The ``devplugin`` command (also ``python -m devplugin_sdk``): run plugins, run the demo.

``devplugin run NAME --config FILE`` runs a built-in backend (``backends.BUILTIN``);
``devplugin run MODULE:ATTR`` runs your own plugin class or factory.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import logging
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup, ExceptionGroup

from devplugin_sdk import _cli_probe, backends, cdi, runner
from devplugin_sdk._logging import configure_logging
from devplugin_sdk.api import constants
from devplugin_sdk.config import RunConfig, load_yaml, parse_run_config
from devplugin_sdk.errors import ConfigError, DevicePluginError
from devplugin_sdk.plugin import DevicePlugin
from devplugin_sdk.settings import Settings

__all__ = ["build_parser", "main", "resolve_plugins"]

log = logging.getLogger("devplugin_sdk")


def resolve_plugins(target: str, config: Mapping[str, Any] | None) -> list[DevicePlugin]:
    """Turn ``devplugin run``'s target into plugins.

    ``target`` is a built-in backend name (its module's ``from_config`` gets ``config``) or
    ``MODULE:ATTR`` where ATTR is a DevicePlugin subclass (with a ``from_config`` classmethod
    when a config is given) or a callable returning one plugin or a list of them.

    Raises:
        ConfigError: unknown target, or a config the target cannot take.
    """
    if target in backends.BUILTIN:
        module = importlib.import_module(backends.BUILTIN[target])
        return _checked(target, module.from_config(config or {}))
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        known = ", ".join(sorted(backends.BUILTIN))
        raise ConfigError(
            "target", f"{target!r} is neither a built-in backend ({known}) nor MODULE:ATTR"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError("target", f"cannot import {module_name!r}: {exc}") from None
    try:
        obj = getattr(module, attr)
    except AttributeError:
        raise ConfigError("target", f"{module_name!r} has no attribute {attr!r}") from None
    if config is not None:
        factory = getattr(obj, "from_config", None)
        if factory is None:
            raise ConfigError("--config", f"{target} has no from_config() to take a configuration")
        made = factory(config)
    elif callable(obj):  # a DevicePlugin subclass or a factory
        made = obj()
    else:
        raise ConfigError("target", f"{target} is not a DevicePlugin class or factory")
    return _checked(target, made)


def _checked(target: str, made: object) -> list[DevicePlugin]:
    plugins = [made] if isinstance(made, DevicePlugin) else list(made)  # type: ignore[call-overload]
    for plugin in plugins:
        if not isinstance(plugin, DevicePlugin):
            raise ConfigError(
                "target", f"{target} produced {type(plugin).__name__}, not a DevicePlugin"
            )
    if not plugins:
        raise ConfigError(
            "target", f"{target} produced no plugins: no devices found and none configured"
        )
    return plugins


def _run_config(args: argparse.Namespace) -> RunConfig:
    """The file's settings with the command line's on top."""
    base = parse_run_config(load_yaml(Path(args.config))) if args.config else RunConfig()
    target = args.target or base.backend
    if target is None:
        raise ConfigError(
            "backend", "name a backend or MODULE:ATTR on the command line or in the file"
        )
    overrides = {
        "backend": target,
        "device_plugin_dir": Path(args.device_plugin_dir) if args.device_plugin_dir else None,
        "registration": args.registration,
        "plugins_registry_dir": Path(args.plugins_registry_dir)
        if args.plugins_registry_dir
        else None,
        "metrics_port": args.metrics_port,
        "metrics_host": args.metrics_host,
        "stuck_after": args.stuck_after,
        "log_level": args.log_level,
        "log_format": args.log_format,
    }
    return dataclasses.replace(base, **{k: v for k, v in overrides.items() if v is not None})


def _with_cdi(plugins: list[DevicePlugin], config: RunConfig) -> list[DevicePlugin]:
    """Wrap every plugin with ``cdi.use_cdi`` when the configuration asks for CDI."""
    if config.cdi_dir is None:
        return plugins
    return [cdi.use_cdi(plugin, directory=config.cdi_dir) for plugin in plugins]


def _cmd_run(args: argparse.Namespace) -> int:
    config = _run_config(args)
    configure_logging(config.log_level, config.log_format)
    assert config.backend is not None
    options = config.backend_options if args.config else None
    plugins = _with_cdi(resolve_plugins(config.backend, options), config)
    settings = Settings(
        device_plugin_dir=config.device_plugin_dir,
        registration=config.registration,  # type: ignore[arg-type]
        plugins_registry_dir=config.plugins_registry_dir,
    )
    reload = None
    if args.config:
        path = Path(args.config)

        def load() -> list[DevicePlugin]:
            new = _run_config(args)
            fixed = config.restart_needed(new)
            if fixed:
                log.warning(
                    "%s changed in %s; restart the plugin to apply it", ", ".join(fixed), path
                )
            configure_logging(new.log_level, new.log_format)
            return _with_cdi(resolve_plugins(config.backend or "", new.backend_options), config)

        reload = runner.Reload(load=load, config_path=path)
    http = None
    if config.metrics_port is not None:
        http = runner.Http(
            port=config.metrics_port, host=config.metrics_host, stuck_after=config.stuck_after
        )
    runner.run(
        *plugins,
        settings=settings,
        http=http,
        reload=reload,
        api=config.api,
        dra=config.dra,
    )
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    # Imported here: the demo pulls in the testing tools, which `devplugin run` never needs.
    from devplugin_sdk import demo  # noqa: PLC0415

    return demo.main(json_output=args.json)


def build_parser() -> argparse.ArgumentParser:
    """The ``devplugin`` argument parser."""
    parser = argparse.ArgumentParser(
        prog="devplugin", description="Run Kubernetes device plugins built with devplugin-sdk."
    )
    parser.add_argument(
        "--log-level",
        default=None,
        help="debug, info, warning or error (default: info for run, warning otherwise)",
    )
    parser.add_argument("--log-format", default=None, choices=["text", "json"])
    sub = parser.add_subparsers(dest="command", required=True)

    run_p = sub.add_parser("run", help="run device plugins until SIGTERM")
    run_p.add_argument(
        "target",
        nargs="?",
        help=f"built-in backend ({', '.join(sorted(backends.BUILTIN))}) or MODULE:ATTR; "
        "may come from the config file's `backend` key instead",
    )
    run_p.add_argument("--config", help="YAML configuration file")
    run_p.add_argument(
        "--device-plugin-dir",
        default=None,
        help=f"the kubelet's device-plugin directory (default {constants.DEVICE_PLUGIN_PATH})",
    )
    run_p.add_argument(
        "--registration",
        choices=["auto", "kubelet", "watcher"],
        default=None,
        help="register through kubelet.sock or the plugin watcher (auto: watcher if "
        "--plugins-registry-dir exists)",
    )
    run_p.add_argument(
        "--plugins-registry-dir",
        default=None,
        help=f"the kubelet's plugin-watcher directory (default {constants.PLUGINS_REGISTRY_PATH})",
    )
    run_p.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        metavar="PORT",
        help="serve /healthz, /metrics and /status on this TCP port "
        "(metrics need devplugin-sdk[metrics])",
    )
    run_p.add_argument(
        "--metrics-host", default=None, metavar="ADDR", help="address for --metrics-port"
    )
    run_p.add_argument(
        "--stuck-after",
        type=float,
        default=None,
        metavar="SECONDS",
        help="/healthz fails when a device list stays unsent this long",
    )
    run_p.set_defaults(func=_cmd_run)

    demo_p = sub.add_parser("demo", help="run the generic backend against an embedded FakeKubelet")
    demo_p.add_argument("--json", action="store_true", help="print the timeline as JSON")
    demo_p.set_defaults(func=_cmd_demo)

    _cli_probe.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``devplugin``; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        # Only `run` is a daemon whose routine events belong in the log; the other commands
        # print their own results.
        default_level = "info" if args.command == "run" else "warning"
        configure_logging(args.log_level or default_level, args.log_format or "text")
    except ValueError as exc:
        parser.error(str(exc))
    try:
        code: int = args.func(args)
    except (DevicePluginError, ValueError, OSError) as exc:
        print(f"devplugin: error: {exc}", file=sys.stderr)
        return 2
    except ExceptionGroup as group:
        # Several plugins failed at once (runner.raise_errors): one line each, or the traceback
        # of what is not an expected error.
        expected = (DevicePluginError, ValueError, OSError)
        matched, rest = group.split(expected)
        if rest is not None:
            raise
        for error in _leaves(matched):
            print(f"devplugin: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # pragma: no cover
        return 130
    return code


def _leaves(group: BaseException | None) -> list[BaseException]:
    if group is None:
        return []
    if isinstance(group, BaseExceptionGroup):
        return [leaf for inner in group.exceptions for leaf in _leaves(inner)]
    return [group]
