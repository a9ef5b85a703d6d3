"""A deployable FPGA device plugin: AMD/Xilinx Alveo (XRT) or Intel DFL boards, set up by YAML.

The built-in backend finds the boards, names one resource per shell (or AFU/interface ID) and
keeps their health current; this subclass adds what a site usually wants on top: boards on one
NUMA node for multi-board pods, and an environment variable telling the container which boards
it got. Run it with ``devplugin run plugin:FpgaExamplePlugin --config config.yaml``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from typing_extensions import Self

from devplugin_sdk import Allocation, Device
from devplugin_sdk.allocation import TopologyScorer
from devplugin_sdk.backends.fpga import FpgaPlugin

# Intel's CRI hook programs a region-mode port before the container starts when the
# container carries this annotation (intel-device-plugins-for-kubernetes fpga_plugin.go).
INTEL_MODE_ANNOTATION = "com.intel.fpga.mode"


class FpgaExamplePlugin(FpgaPlugin):
    """``FpgaPlugin`` with NUMA-aware preferred allocation and an ``FPGA_DEVICES`` variable."""

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> list[Self]:
        """One plugin per resource found or declared (the backend's keys, see config.yaml).

        Raises:
            ConfigError: naming the full dotted key and the reason.
        """
        return super().from_config(config)

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
