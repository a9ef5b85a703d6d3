"""``devplugin dra``: commands about the DRA side of a ``devplugin run`` file.

``check`` and ``simulate`` (``cli.dra_check``) validate the slices a file's plugins would publish
and evaluate a claim against them, offline.

``devplugin dra deviceclass [TARGET] --config FILE [--extended-resource]`` prints, as YAML, the
DeviceClass of each resource the file's plugins serve as the DRA driver ``dra.driver``
(``dra._deviceclass``), optionally with ``extendedResourceName`` set to the device-plugin
resource name (KEP-5004), so that pods asking for ``nvidia.com/gpu: 1`` are served by DRA. The
plugins are built from the file as ``devplugin run`` builds them, without discovering devices.
Every error is one line naming the key, with exit code 2.
"""

from __future__ import annotations

import argparse
import sys

import yaml

from devplugin_sdk.cli import dra_check
from devplugin_sdk.cli.runfile import parse_run_config
from devplugin_sdk.config import load_yaml
from devplugin_sdk.errors import ConfigError

__all__ = ["register"]


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``dra`` command group (``func=<callable(args)>`` on each subcommand)."""
    group = subparsers.add_parser(
        "dra", help="DRA tools for a devplugin run file: DeviceClasses, check, simulate"
    )
    sub = group.add_subparsers(dest="dra_command", required=True)
    dra_check.register(sub)
    classes = sub.add_parser(
        "deviceclass",
        help="print the DeviceClasses of the configured plugins",
        description="Print (YAML) one DeviceClass per resource the configured plugins serve "
        "through the DRA driver of the file's dra section: its selector is the driver (and the "
        "resource, when the driver serves several). Apply it with kubectl apply -f -.",
    )
    classes.add_argument(
        "target",
        nargs="?",
        help="built-in backend or MODULE:ATTR, as for devplugin run (default: the file's backend)",
    )
    classes.add_argument("--config", required=True, metavar="FILE", help="a devplugin run file")
    classes.add_argument(
        "--extended-resource",
        action="store_true",
        help="set extendedResourceName to the device-plugin resource name (KEP-5004, "
        "Kubernetes 1.34+ with DRAExtendedResource, on by default from 1.36): pods asking for "
        "the extended resource are served by DRA",
    )
    classes.set_defaults(func=_cmd_deviceclass)


def _cmd_deviceclass(args: argparse.Namespace) -> int:
    # Imported here: `devplugin run` never needs them (cold start), and cli imports this module.
    from devplugin_sdk.cli import resolve_plugins  # noqa: PLC0415
    from devplugin_sdk.dra._deviceclass import device_classes  # noqa: PLC0415

    config = parse_run_config(load_yaml(args.config))
    if config.dra is None:
        raise ConfigError("api", "is devicePlugin: set api: dra (or both) and dra.driver")
    target = args.target or config.backend
    if target is None:
        raise ConfigError(
            "backend", "name a backend or MODULE:ATTR on the command line or in the file"
        )
    plugins = resolve_plugins(target, config.backend_options)
    resources = list(dict.fromkeys(p.resource_name for p in plugins))
    documents = device_classes(config.dra.driver, resources, extended=args.extended_resource)
    sys.stdout.write(yaml.safe_dump_all(documents, sort_keys=False, default_flow_style=False))
    return 0
