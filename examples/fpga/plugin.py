"""A deployable FPGA device plugin: AMD/Xilinx Alveo (XRT) or Intel DFL boards, set up by YAML.

The built-in backend finds the boards, names one resource per shell (or AFU/interface ID) and
keeps their health current; this subclass adds what a site usually wants on top: boards on one
NUMA node for multi-board pods, and an environment variable telling the container which boards
it got. Run it with ``python plugin.py --config config.yaml [--metrics-port 9450]``.
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
from devplugin_sdk.allocation import TopologyScorer
from devplugin_sdk.backends.fpga import FpgaConfig, FpgaPlugin, build_plugins

log = logging.getLogger("fpga-plugin")

# Intel's CRI hook programs a region-mode port before the container starts when the
# container carries this annotation (intel-device-plugins-for-kubernetes fpga_plugin.go).
INTEL_MODE_ANNOTATION = "com.intel.fpga.mode"


class FpgaExamplePlugin(FpgaPlugin):
    """``FpgaPlugin`` with NUMA-aware preferred allocation and an ``FPGA_DEVICES`` variable."""

    async def preferred_allocation(
        self, available: Sequence[Device], must_include: Sequence[Device], size: int
    ) -> Sequence[str]:
        """Prefer boards that share a NUMA node (FPGAs have no peer links worth scoring)."""
        scorer = TopologyScorer(
            link_score=lambda a, b: 0.0,
            numa_nodes={d.id: d.numa_nodes[0] if d.numa_nodes else None for d in available},
        )
        return scorer.choose([d.id for d in available], size, [d.id for d in must_include])

    async def allocate(self, devices: Sequence[Device]) -> Allocation:
        """The backend's device nodes, plus ``FPGA_DEVICES=<id>,<id>`` (PCI addresses)."""
        allocation = await super().allocate(devices)
        env = {**allocation.env, "FPGA_DEVICES": ",".join(d.id for d in devices)}
        annotations = dict(allocation.annotations)
        if self.config.family == "dfl" and self.config.mode == "region":
            annotations[INTEL_MODE_ANNOTATION] = f"{self.config.domain}/region"
        return dataclasses.replace(allocation, env=env, annotations=annotations)


def load_plugins(path: Path, **overrides: Any) -> list[FpgaExamplePlugin]:
    """Read the YAML config at ``path`` and return one plugin per resource found or declared.

    Args:
        path: The config file (see config.yaml).
        overrides: Config keys that win over the file (tests point the roots at fake trees).

    Raises:
        ConfigError: the file is not a valid FPGA backend config.
    """
    try:
        config = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(str(path), f"cannot read: {exc}") from exc
    return build_plugins(
        FpgaConfig.from_mapping(config, **overrides), plugin_class=FpgaExamplePlugin
    )


def build_parser() -> argparse.ArgumentParser:
    """The command line: ``--config``, ``--metrics-port``, ``--log-level``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=Path(__file__).with_name("config.yaml"))
    parser.add_argument(
        "--metrics-port",
        type=int,
        help="serve /healthz, /metrics and /status on this TCP port (devplugin_sdk.healthz)",
    )
    parser.add_argument("--log-level", default="INFO")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Serve the FPGA resources until SIGTERM; exit 1 when there is nothing to serve."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(levelname)s %(name)s: %(message)s")
    try:
        plugins = load_plugins(args.config)
    except ConfigError as exc:
        parser.exit(2, f"bad configuration: {exc}\n")
    if not plugins:
        log.error("no FPGA board found and no resource declared under 'rename'; nothing to serve")
        return 1
    for plugin in plugins:
        log.info("serving %s for %s", plugin.resource_name, ", ".join(sorted(plugin.keys)))
    settings = Settings(health_interval=plugins[0].config.health_interval)
    if args.metrics_port is None:
        run(*plugins, settings=settings)
    else:
        healthz.run(plugins, port=args.metrics_port, settings=settings)
    return 0


if __name__ == "__main__":
    sys.exit(main())
