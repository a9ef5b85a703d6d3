"""A deployable RDMA device plugin: InfiniBand HCAs, RoCE NICs and their SR-IOV VFs, set up by YAML.

The built-in backend finds the RDMA devices, serves one resource per selector group (whole
devices or shares of them) and keeps their health current from port state; this subclass adds
what MPI and NCCL jobs usually need on top: variables naming the HCAs and ports the container got.
Run it with ``python plugin.py --config config.yaml [--metrics-port 9452]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from devplugin_sdk import Allocation, ConfigError, Device, Settings, healthz, run
from devplugin_sdk.backends.rdma import RdmaPlugin, load_config

log = logging.getLogger("rdma-plugin")


class RdmaExamplePlugin(RdmaPlugin):
    """``RdmaPlugin`` that also sets ``NCCL_IB_HCA`` and ``UCX_NET_DEVICES``."""

    async def allocate(self, devices: Sequence[Device]) -> Allocation:
        """The backend's nodes and ``RDMA_DEVICES``/``RDMA_NETDEVS``, plus the HCA lists in the
        forms NCCL (``=mlx5_0:1,mlx5_1:1``, ``=`` for exact names) and UCX (``mlx5_0:1,...``)
        take."""
        allocation = await super().allocate(devices)
        ports: dict[str, None] = {}
        for device in devices:
            name = device.attributes["rdma_device"]
            for port in device.attributes["ports"].split(","):
                ports.setdefault(f"{name}:{port}")
        env = {
            **allocation.env,
            "NCCL_IB_HCA": "=" + ",".join(ports),
            "UCX_NET_DEVICES": ",".join(ports),
        }
        return dataclasses.replace(allocation, env=env)


def load_plugins(path: Path, **overrides: Any) -> list[RdmaExamplePlugin]:
    """Read the YAML config at ``path`` and return one plugin per resource.

    Args:
        path: The config file (see config.yaml).
        overrides: ``sysfs_root``, ``dev_root``, ``health_interval`` win over the file (tests
            point the roots at fake trees).

    Raises:
        ConfigError: the file is not a valid RDMA backend config.
    """
    try:
        config = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(str(path), f"cannot read: {exc}") from exc
    return load_config(config, **overrides).plugins(RdmaExamplePlugin)


def build_parser() -> argparse.ArgumentParser:
    """The command line: ``--config``, ``--metrics-port``, ``--log-level``."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--config", type=Path, default=Path(__file__).with_name("config.yaml"))
    parser.add_argument(
        "--metrics-port",
        type=int,
        help="serve /healthz, /metrics and /status on this TCP port (devplugin_sdk.healthz); "
        "with hostNetwork it is a port of the node",
    )
    parser.add_argument("--log-level", default="INFO")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Serve the RDMA resources until SIGTERM; exit 2 on a bad config."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(levelname)s %(name)s: %(message)s")
    try:
        plugins = load_plugins(args.config)
    except ConfigError as exc:
        parser.exit(2, f"bad configuration: {exc}\n")
    for plugin in plugins:
        log.info(
            "serving %s (%s) from %s",
            plugin.resource_name,
            plugin.resource.mode,
            plugin.sysfs_root,
        )
    # A resource that matches nothing yet still registers, with zero capacity: devices that
    # appear later (driver loaded after us, VFs created) are picked up by the rescans. Each
    # plugin re-reads port state on its own healthInterval (DevicePlugin.health_interval).
    settings = Settings()
    if args.metrics_port is None:
        run(*plugins, settings=settings)
    else:
        healthz.run(plugins, port=args.metrics_port, settings=settings)
    return 0


if __name__ == "__main__":
    sys.exit(main())
