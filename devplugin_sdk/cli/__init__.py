"""The ``devplugin`` command (also ``python -m devplugin_sdk``): run plugins, run the demo.

``devplugin run NAME --config FILE`` runs a built-in backend (``backends.BUILTIN``);
``devplugin run MODULE:ATTR`` runs your own plugin class or factory. ``fake-kubelet``,
``probe`` and ``conformance`` live in ``_cli_fake_kubelet`` and ``_cli_probe``. Every error a
user can cause is one line on stderr naming the option or key, the value and the cause, with
exit code 2; a runtime failure is one line naming the resource and the hook, with exit code 1;
the global options are accepted before and after the subcommand.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import importlib
import inspect
import logging
import os
import socket
import stat
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

import anyio
import anyio.to_thread

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup

from devplugin_sdk import __version__, _logging, backends, runner
from devplugin_sdk._engine import hooks
from devplugin_sdk._intervals import port_text, seconds_text
from devplugin_sdk._limits import DEFAULT_STUCK_AFTER
from devplugin_sdk._logging import configure_logging, fatal
from devplugin_sdk._names import socket_path_problem
from devplugin_sdk.api import constants
from devplugin_sdk.cli.runfile import RunConfig, parse_run_config
from devplugin_sdk.config import FileOptions, load_yaml
from devplugin_sdk.errors import ConfigError, DevicePluginError, SocketInUseError
from devplugin_sdk.kubelet import _cli_fake_kubelet, _cli_probe
from devplugin_sdk.plugin import DevicePlugin
from devplugin_sdk.settings import Settings

__all__ = ["build_parser", "main", "resolve_plugins"]

log = logging.getLogger("devplugin_sdk")


def resolve_plugins(target: str, config: Mapping[str, Any] | None) -> list[DevicePlugin]:
    """Turn ``devplugin run``'s target into plugins.

    ``target`` is a built-in backend name (its module's ``from_config`` gets ``config``) or
    ``MODULE:ATTR`` where ATTR is a DevicePlugin subclass or a callable returning one plugin or a
    list of them. With backend keys in ``config``, ATTR needs a ``from_config`` classmethod to
    take them; a file with only the SDK's keys (``config`` empty) works without one. MODULE is
    imported with the working directory on the import path, as ``uvicorn`` and ``gunicorn`` do.

    Args:
        target: The built-in backend or ``MODULE:ATTR``.
        config: The file's backend keys; None when there is no file.

    Raises:
        ConfigError: unknown target, a target that produces no plugins or something else, or a
            config the target cannot take.
    """
    if target in backends.BUILTIN:
        module = importlib.import_module(backends.BUILTIN[target])
        try:
            made = _read_by(target, module.from_config, config or {})
        except ConfigError as exc:
            if config is not None:
                raise
            raise ConfigError(
                "--config",
                f"the {target} backend needs a configuration file "
                f"(devplugin run {target} --config FILE); without one: {exc}",
            ) from None
        return _checked(target, made)
    obj = _import_target(target)
    factory = getattr(obj, "from_config", None)
    if config and factory is None:
        keys = ", ".join(str(k)[:40] for k in list(config)[:5])
        raise ConfigError(
            "--config",
            f"{target} has no from_config() to take the file's backend keys ({keys}); "
            "add that classmethod, or keep only the SDK's keys in the file",
        )
    if factory is not None and config is not None:
        made = _read_by(target, factory, config)
    else:
        made = _call(target, obj)
    return _checked(target, made)


def _read_by(target: str, from_config: Any, config: Mapping[str, Any]) -> object:
    """``from_config(config)``, then refuse the file's keys it never asked for (typos): the
    reader keeps the record (``FileOptions.check_read``), so no backend has to list its keys."""
    try:
        made = _building(target, "from_config", from_config, config)
    except ConfigError:
        typo = config.likely_typo() if isinstance(config, FileOptions) else None
        if typo is not None:
            raise typo from None
        raise
    if isinstance(config, FileOptions):
        config.check_read()
    return made


def _building(target: str, hook: str, build: Any, *args: Any) -> object:
    """Call what builds the plugins; what it raises, other than a mistake in the file or the
    plugin's definition, says where it came from (``nvidia: from_config() failed: ...``)."""
    try:
        return build(*args)
    except (ConfigError, TypeError, ValueError):
        raise
    except Exception as exc:
        hooks.note_failure(exc, target, hook)
        raise


def _import_target(target: str) -> object:
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        known = ", ".join(sorted(backends.BUILTIN))
        raise ConfigError(
            "target", f"{target!r} is neither a built-in backend ({known}) nor MODULE:ATTR"
        )
    _working_directory_importable()
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError("target", f"cannot import {module_name!r}: {exc}") from None
    except SyntaxError as exc:  # the module's own mistake, found before anything ran
        raise ConfigError(
            "target", f"cannot import {module_name!r}: {hooks.describe(exc)}"
        ) from None
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ConfigError("target", f"{module_name!r} has no attribute {attr!r}") from None


def _working_directory_importable() -> None:
    """Put the working directory first on the import path (``python -m`` does; the
    ``devplugin`` script, whose path starts with its own directory, does not)."""
    cwd = os.getcwd()
    if not any(entry in ("", ".", cwd) for entry in sys.path):
        sys.path.insert(0, cwd)


def _call(target: str, obj: object) -> object:
    """Call a DevicePlugin class or factory with no arguments, or say why it cannot be."""
    if not callable(obj):
        raise ConfigError("target", f"{target} is {_a(obj)}, not a DevicePlugin class or a factory")
    abstract = getattr(obj, "__abstractmethods__", None)
    if isinstance(obj, type) and abstract:
        missing = ", ".join(sorted(abstract))
        raise ConfigError("target", f"{target} is abstract: it does not define {missing}")
    try:
        inspect.signature(obj).bind()
    except TypeError as exc:
        raise ConfigError(
            "target",
            f"{target} cannot be called without arguments ({exc}); give them defaults, or "
            "add a from_config(mapping) classmethod and pass --config",
        ) from None
    except ValueError:  # no signature (a builtin): just call it
        pass
    return _building(target, getattr(obj, "__name__", "factory"), obj)


def _checked(target: str, made: object) -> list[DevicePlugin]:
    if isinstance(made, DevicePlugin):
        plugins: list[object] = [made]
    elif isinstance(made, (list, tuple)):
        plugins = list(made)
    else:
        raise ConfigError(
            "target", f"{target} returned {_a(made)}; expected a DevicePlugin or a list of them"
        )
    for plugin in plugins:
        if not isinstance(plugin, DevicePlugin):
            raise ConfigError("target", f"{target} produced {_a(plugin)}, not a DevicePlugin")
    if not plugins:
        raise ConfigError(
            "target", f"{target} produced no plugins: no devices found and none configured"
        )
    return plugins  # type: ignore[return-value]  # each one checked above


def _a(value: object) -> str:
    """``a JSONDecoder``: what a value is, never the value (it may be big)."""
    name = type(value).__name__
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def _run_config(args: argparse.Namespace, data: Mapping[str, Any] | None) -> RunConfig:
    """The file's settings (``data``, None without a file) with the command line's on top."""
    base = parse_run_config(data) if data is not None else RunConfig()
    target = args.target or base.backend
    if target is None:
        raise ConfigError(
            "backend", "name a backend or MODULE:ATTR on the command line or in the file"
        )
    overrides = {
        "backend": target,
        "device_plugin_dir": args.device_plugin_dir,
        "registration": args.registration,
        "plugins_registry_dir": args.plugins_registry_dir,
        "metrics_port": args.metrics_port,
        "metrics_host": args.metrics_host,
        "stuck_after": args.stuck_after,
        "log_level": getattr(args, "log_level", None),
        "log_format": getattr(args, "log_format", None),
    }
    return dataclasses.replace(base, **{k: v for k, v in overrides.items() if v is not None})


def _read_run_config(args: argparse.Namespace) -> RunConfig:
    """Read and parse the file, then apply the command line: blocking (a worker thread's job
    when the event loop runs)."""
    return _run_config(args, load_yaml(args.config) if args.config else None)


def _with_cdi(plugins: list[DevicePlugin], config: RunConfig) -> list[DevicePlugin]:
    """Wrap every plugin with ``cdi.use_cdi`` when the configuration asks for CDI."""
    if config.cdi_dir is None:
        return plugins
    from devplugin_sdk import cdi  # noqa: PLC0415 - only with CDI configured (cold start)

    return [cdi.use_cdi(plugin, directory=config.cdi_dir) for plugin in plugins]


def _cmd_run(args: argparse.Namespace) -> int:
    _from_environment(args, os.environ)
    chosen = _node_config(args)
    config = _read_run_config(args)
    configure_logging(config.log_level, config.log_format)
    if chosen is not None:
        log.info("configuration chosen by the node label: %s", chosen)
    assert config.backend is not None
    settings = Settings(
        device_plugin_dir=config.device_plugin_dir,
        registration=config.registration,  # type: ignore[arg-type]
        plugins_registry_dir=config.plugins_registry_dir,
    )
    if config.rescan_interval is not None:
        settings = dataclasses.replace(settings, rescan_interval=config.rescan_interval)
    _preflight(args, config, settings)
    options = config.backend_options if args.config else None
    plugins = _with_cdi(resolve_plugins(config.backend, options), config)
    _check_socket_paths(args, settings, plugins, config.api)
    reload = None
    if args.config:
        path = Path(args.config)

        async def load() -> list[DevicePlugin]:
            # Reading and parsing in a worker thread: a big or slow file never stalls the
            # plugins' gRPC calls. The plugins are built here, on the loop.
            new = await anyio.to_thread.run_sync(_read_run_config, args)
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


def _node_config(args: argparse.Namespace) -> str | None:
    """With ``--node-config-label``, point ``args.config`` at the file the node's label
    chooses; why it was chosen (for the log), or None without the option."""
    if args.node_config_label is None:
        return None
    if not args.config:
        raise ConfigError(
            "--node-config-label",
            "needs --config: the default file, beside the files the label chooses from",
        )
    from devplugin_sdk.cli import nodeconfig  # noqa: PLC0415 - only with the option (cold start)

    path, why = nodeconfig.node_config(Path(args.config), args.node_config_label)
    args.config = str(path)
    return why


def _preflight(args: argparse.Namespace, config: RunConfig, settings: Settings) -> None:
    """Check the directories and the HTTP address before anything starts, so that a bad value
    is one line naming the option, the value and the cause (not an errno from deep inside)."""
    if settings.uses_plugin_watcher():
        option = "--plugins-registry-dir" if args.plugins_registry_dir else "pluginsRegistryDir"
        # Not by creating a file: the kubelet's plugin watcher sees every file created there.
        _check_directory(option, settings.plugins_registry_dir, create=False)
    else:
        option = "--device-plugin-dir" if args.device_plugin_dir else "devicePluginDir"
        _check_directory(option, settings.device_plugin_dir)
    if config.metrics_port is not None:
        _check_listen(
            "--metrics-port" if args.metrics_port is not None else "metrics.port",
            "--metrics-host" if args.metrics_host is not None else "metrics.host",
            config.metrics_host,
            config.metrics_port,
        )


def _check_socket_paths(
    args: argparse.Namespace,
    settings: Settings,
    plugins: Sequence[DevicePlugin],
    api: str = "devicePlugin",
) -> None:
    """Every socket the plugins serve or dial through the device-plugin API fits a Unix
    socket address."""
    if settings.uses_plugin_watcher():
        option = "--plugins-registry-dir" if args.plugins_registry_dir else "pluginsRegistryDir"
        directory, paths = settings.plugins_registry_dir, []
    else:
        option = "--device-plugin-dir" if args.device_plugin_dir else "devicePluginDir"
        directory = settings.device_plugin_dir
        paths = [directory / constants.KUBELET_SOCKET_NAME]
    if api == "dra":  # no device-plugin socket is served (the DRA ones are checked at start)
        return
    for path in [*paths, *(directory / p.effective_socket_name for p in plugins)]:
        problem = socket_path_problem(path)
        if problem is not None:
            raise ConfigError(option, problem)


def _check_directory(option: str, path: Path, *, create: bool = True) -> None:
    """A directory where the plugin can create its socket; a missing one is waited for (the
    kubelet may not have made it yet) and the plugin says so while it waits.

    With ``create``, a file is created and removed there (the only sure test: root passes
    permission checks, yet ``/proc/self`` or a read-only mount still refuse); without, the
    permissions are asked (``access``).
    """
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise ConfigError(option, f"{path}: {exc.strerror}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(option, f"{path} is not a directory")
    if not create:
        if not os.access(path, os.W_OK | os.X_OK):
            raise ConfigError(option, f"{path}: cannot create the plugin's socket there")
        return
    try:
        # A hidden regular file: the kubelet's plugin watcher ignores names starting with '.'.
        fd, probe = tempfile.mkstemp(prefix=".devplugin-check-", dir=path)
    except OSError as exc:
        hint = " (a kernel filesystem?)" if exc.errno == errno.ENOENT else ""
        raise ConfigError(
            option, f"{path}: cannot create the plugin's socket there: {exc.strerror}{hint}"
        ) from None
    os.close(fd)
    os.unlink(probe)


def _check_listen(port_option: str, host_option: str, host: str | None, port: int) -> None:
    """Bind the HTTP address the way the runner will (every address the host resolves to,
    IPv6 sockets IPv6-only), then let go of it."""
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(
            host or None,
            port,
            type=socket.SOCK_STREAM,
            flags=socket.AI_PASSIVE | socket.AI_ADDRCONFIG,
        )
    except socket.gaierror as exc:
        raise ConfigError(host_option, f"{host!r}: cannot resolve: {exc.strerror}") from None
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(address)
            except OSError as exc:
                where = f"{address[0]} port {port}"
                if exc.errno == errno.EADDRINUSE:
                    raise ConfigError(
                        port_option,
                        f"{port} is in use on {address[0]} (another process listens there); "
                        "/healthz, /metrics and /status need a free port",
                    ) from None
                if exc.errno == errno.EACCES:
                    raise ConfigError(
                        port_option, f"{port}: binding {where} needs privileges (ports < 1024)"
                    ) from None
                option = host_option if exc.errno == errno.EADDRNOTAVAIL else port_option
                raise ConfigError(option, f"cannot listen on {where}: {exc.strerror}") from None


def _cmd_demo(args: argparse.Namespace) -> int:
    # Imported here: the demo pulls in the testing tools, which `devplugin run` never needs.
    from devplugin_sdk.cli import demo  # noqa: PLC0415

    return demo.main(json_output=args.json)


class _Parser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line (exit code 2)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _port(text: str) -> int:
    try:
        return port_text(text, "--metrics-port")
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(exc.reason) from None


def _seconds(text: str) -> float:
    """``--stuck-after`` (and ``DEVPLUGIN_STUCK_AFTER``), within ``metrics.stuckAfter``'s bounds."""
    try:
        return seconds_text(text, "metrics.stuckAfter", "--stuck-after")
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(exc.reason) from None


def _directory(text: str) -> Path:
    if not text or "\0" in text:
        raise argparse.ArgumentTypeError(f"must be a directory path, got {text[:40]!r}")
    return Path(text).absolute()


def _add_global_options(parser: argparse.ArgumentParser, default: Any) -> None:
    """``--log-level`` and ``--log-format``, accepted before and after the subcommand."""
    parser.add_argument(
        "--log-level",
        default=default,
        metavar="LEVEL",
        help="debug, info, warning or error, then optional LOGGER=LEVEL items "
        "(debug,grpc=debug); libraries stay at warning unless named "
        "(default: info for run, warning otherwise)",
    )
    parser.add_argument(
        "--log-format", default=default, choices=["text", "json"], help="default: text"
    )


#: ``devplugin run``'s options that the environment may set (``DEVPLUGIN_<OPTION>``, as NVIDIA's
#: plugin reads its flags): the argument's name and how its value is checked. The command line
#: wins over the environment, the environment over the file.
_ENVIRONMENT: dict[str, Any] = {
    "target": None,
    "config": None,
    "device_plugin_dir": _directory,
    "registration": ("auto", "kubelet", "watcher"),
    "plugins_registry_dir": _directory,
    "metrics_port": _port,
    "metrics_host": None,
    "stuck_after": _seconds,
    "log_level": "levels",
    "log_format": ("text", "json"),
    "node_config_label": None,
}


def environment_name(dest: str) -> str:
    """The variable that sets ``devplugin run``'s option ``dest`` (the target: BACKEND)."""
    return "DEVPLUGIN_" + ("BACKEND" if dest == "target" else dest.upper())


def _from_environment(args: argparse.Namespace, environ: Mapping[str, str]) -> None:
    """Fill every option the command line left unset from its ``DEVPLUGIN_<OPTION>``
    variable (an empty value counts as unset), checked as the option's value is."""
    for dest, check in _ENVIRONMENT.items():
        name = environment_name(dest)
        text = environ.get(name, "")
        if getattr(args, dest, None) is not None or not text:
            continue
        value: Any = text
        if isinstance(check, tuple) and text not in check:
            raise ConfigError(name, f"must be one of {', '.join(check)}, got {text[:40]!r}")
        if check == "levels":
            try:
                _logging.parse_levels(text)
            except ValueError as exc:
                raise ConfigError(name, str(exc)) from None
        elif callable(check):
            try:
                value = check(text)
            except argparse.ArgumentTypeError as exc:
                raise ConfigError(name, str(exc)) from None
        setattr(args, dest, value)


def _env(dest: str) -> str:
    return f" [env {environment_name(dest)}]"


def _examples(*commands: str) -> str:
    """The ``examples:`` block at the end of a subcommand's ``--help``."""
    return "examples:\n" + "\n".join(f"  {command}" for command in commands)


def build_parser() -> argparse.ArgumentParser:
    """The ``devplugin`` argument parser."""
    parser: argparse.ArgumentParser = _Parser(
        prog="devplugin", description="Run Kubernetes device plugins built with devplugin-sdk."
    )
    parser.add_argument("--version", action="version", version=f"devplugin-sdk {__version__}")
    _add_global_options(parser, None)
    sub = parser.add_subparsers(dest="command", required=True)

    run_p = sub.add_parser(
        "run",
        help="run device plugins until SIGTERM",
        description="Run device plugins until SIGTERM or SIGINT. MODULE is imported with the "
        "working directory on the import path. Every option can also be set as an environment "
        "variable DEVPLUGIN_<OPTION> (DEVPLUGIN_METRICS_PORT=8080, DEVPLUGIN_LOG_LEVEL=debug, "
        "DEVPLUGIN_LOG_FORMAT=json; the target as DEVPLUGIN_BACKEND; an empty value counts as "
        "unset); the command line wins over the environment, the environment over the "
        "configuration file. Exit codes: 0 stopped by a signal, 1 a runtime failure (a hook "
        "raised, the kubelet refused), 2 a usage or configuration error.",
        formatter_class=_cli_probe.HelpFormatter,
        epilog=_examples(
            "devplugin fake-kubelet --dir /tmp/kubelet &",
            "devplugin run generic --config examples/generic/config.yaml "
            "--device-plugin-dir /tmp/kubelet",
            "devplugin run acme_plugin:AcmePlugin --device-plugin-dir /tmp/kubelet "
            "--log-level debug",
        ),
    )
    run_p.add_argument(
        "target",
        nargs="?",
        help=f"built-in backend ({', '.join(sorted(backends.BUILTIN))}) or MODULE:ATTR; "
        "may come from the config file's `backend` key instead" + _env("target"),
    )
    run_p.add_argument(
        "--config",
        metavar="FILE",
        help="YAML configuration file, reloaded when it changes (default: none; the command "
        "line and the SDK's defaults)" + _env("config"),
    )
    run_p.add_argument(
        "--device-plugin-dir",
        type=_directory,
        default=None,
        metavar="DIR",
        help=f"the kubelet's device-plugin directory (default {constants.DEVICE_PLUGIN_PATH}); "
        "given, it is where the plugin registers, whatever plugins_registry exists"
        + _env("device_plugin_dir"),
    )
    run_p.add_argument(
        "--registration",
        choices=["auto", "kubelet", "watcher"],
        default=None,
        help="register through kubelet.sock or the plugin watcher (default: auto, kubelet.sock "
        "in --device-plugin-dir when only that is given, else the watcher if "
        "--plugins-registry-dir exists)" + _env("registration"),
    )
    run_p.add_argument(
        "--plugins-registry-dir",
        type=_directory,
        default=None,
        metavar="DIR",
        help=f"the kubelet's plugin-watcher directory (default {constants.PLUGINS_REGISTRY_PATH})"
        + _env("plugins_registry_dir"),
    )
    run_p.add_argument(
        "--metrics-port",
        type=_port,
        default=None,
        metavar="PORT",
        help="serve /healthz, /metrics and /status on this TCP port "
        "(metrics need devplugin-sdk[metrics]; default: none served)" + _env("metrics_port"),
    )
    run_p.add_argument(
        "--metrics-host",
        default=None,
        metavar="ADDR",
        help="address for --metrics-port (default: every address)" + _env("metrics_host"),
    )
    run_p.add_argument(
        "--stuck-after",
        type=_seconds,
        default=None,
        metavar="SECONDS",
        help="/healthz fails when a device list stays unsent this long "
        f"(default: {DEFAULT_STUCK_AFTER:g})" + _env("stuck_after"),
    )
    run_p.add_argument(
        "--node-config-label",
        default=None,
        metavar="LABEL",
        help="choose the configuration by this node label, as NVIDIA's "
        "nvidia.com/device-plugin.config: a node labelled LABEL=NAME runs with NAME.yaml "
        "(or NAME) beside --config, a node without it with --config; read from the API "
        "server at start (needs devplugin-sdk[dra], $NODE_NAME and get on nodes; default: "
        "none)" + _env("node_config_label"),
    )
    run_p.set_defaults(func=_cmd_run)

    demo_p = sub.add_parser(
        "demo",
        help="run the generic backend against an embedded FakeKubelet",
        description="Run the generic backend on a temporary device tree against an embedded "
        "fake kubelet and print each step of a plugin's life: registration, the device list, "
        "an allocation, a health change, a kubelet restart. Needs no root, kubelet or hardware.",
        formatter_class=_cli_probe.HelpFormatter,
        epilog=_examples("devplugin demo", "devplugin demo --json | head -1"),
    )
    demo_p.add_argument("--json", action="store_true", help="print the timeline as JSON")
    demo_p.set_defaults(func=_cmd_demo)

    _cli_fake_kubelet.register(sub)
    _cli_probe.register(sub)
    _dra_group(sub)
    for subparser in sub.choices.values():
        _add_global_options(subparser, argparse.SUPPRESS)
    return parser


def _dra_group(sub: Any) -> None:
    from devplugin_sdk.cli import dra  # noqa: PLC0415 - its modules load only with the parser

    dra.register(sub)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``devplugin``; returns the exit code.

    0 success; 1 a runtime failure (a hook raised, the kubelet refused, the plugin under test
    failed); 2 a usage or configuration error; 130 interrupted (Ctrl-C). Whatever ends the
    command is one line on stderr (JSON under ``--log-format json``), with its traceback
    before it at ``--log-level debug``; a closed stdout (``devplugin demo | head -1``) ends it
    quietly with 0.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        # Only `run` is a daemon whose routine events belong in the log; the other commands
        # print their own results.
        default_level = "info" if args.command == "run" else "warning"
        configure_logging(args.log_level or default_level, args.log_format or "text")
    except ValueError as exc:
        parser.error(f"argument --log-level: {exc}")
    try:
        code: int = args.func(args)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        if isinstance(exc, BrokenPipeError) or _only(exc, BrokenPipeError):
            return _stdout_gone()
        return _fatal(exc)
    except BaseExceptionGroup as group:  # a KeyboardInterrupt among other errors
        if _only(group, KeyboardInterrupt):
            return 130
        return _fatal(group)
    return code


def _only(exc: BaseException, kind: type[BaseException]) -> bool:
    leaves = _leaves(exc)
    return bool(leaves) and all(isinstance(leaf, kind) for leaf in leaves)


def _stdout_gone() -> int:
    """The reader of stdout went away: nothing more can be said there, and nothing is wrong.

    stdout is pointed at /dev/null so that flushing it at exit does not fail again (Python's
    own advice for SIGPIPE, docs.python.org/3/library/signal.html#note-on-sigpipe).
    """
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 0


def _fatal(exc: BaseException) -> int:
    """Say what ended the command in one line; return its exit code (2 usage or configuration,
    1 anything else)."""
    leaves = _leaves(exc) or [exc]
    messages = list(dict.fromkeys(_message(leaf) for leaf in leaves))
    traceback = exc if log.isEnabledFor(logging.DEBUG) else None
    fatal(f"devplugin: error: {'; '.join(messages)}", traceback)
    return 2 if all(_usage_error(leaf) for leaf in leaves) else 1


def _message(exc: BaseException) -> str:
    """Our own errors (and the OS's, which name their path) as they are; anything else with its
    type, and with the resource and hook it came from."""
    context = hooks.failure_context(exc)
    if isinstance(exc, ConfigError):  # names its key already, wherever it was found
        return " ".join(str(exc).split())
    if context is not None:
        return f"{context}: {hooks.describe(exc)}"
    if isinstance(exc, (DevicePluginError, ValueError, TypeError, OSError)):
        return " ".join(str(exc).split()) or hooks.describe(exc)
    return hooks.describe(exc)


def _usage_error(exc: BaseException) -> bool:
    """A mistake in the command line, the file or the plugin's definition (exit code 2), found
    before anything ran: not one that a running hook raised."""
    if isinstance(exc, (ConfigError, SocketInUseError)):
        # A backend's discover() may find the mistake; a socket another instance serves is
        # refused as the metrics port in use is (--metrics-port), before taking anything over.
        return True
    if hooks.failure_context(exc) is not None:
        return False
    return isinstance(exc, TypeError) or type(exc) is ValueError


def _leaves(group: BaseException | None) -> list[BaseException]:
    if group is None:
        return []
    if isinstance(group, BaseExceptionGroup):
        return [leaf for inner in group.exceptions for leaf in _leaves(inner)]
    return [group]
