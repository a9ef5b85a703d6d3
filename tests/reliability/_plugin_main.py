"""A plugin process for the reliability tests: a static SDK plugin run with ``devplugin_sdk.run``.

    python _plugin_main.py --dir DIR [--resource NAME] [--count N] [--allocate-delay S]

It serves ``--count`` devices ``d0..`` with test-speed settings (those of
``FakeKubelet.settings()``) until SIGTERM/SIGINT, exactly as a plugin author's ``main`` does.
Each Allocate prints ``allocating <ids>`` on stdout before its hook returns, so that a test
knows when an allocation is in flight; ``--allocate-delay`` keeps it in flight that long.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

import anyio

from devplugin_sdk import Allocation, Device, DeviceNode, Settings, run
from devplugin_sdk.testing import StaticPlugin


class ReliabilityPlugin(StaticPlugin):
    """Static devices; Allocate announces itself and may take a while."""

    def __init__(self, resource_name: str, count: int, allocate_delay: float) -> None:
        devices = [Device(f"d{i}", device_nodes=(DeviceNode(f"/dev/d{i}"),)) for i in range(count)]
        super().__init__(resource_name, devices)
        self.allocate_delay = allocate_delay

    async def allocate(self, devices: Sequence[Device]) -> Allocation:
        print("allocating", ",".join(d.id for d in devices), flush=True)
        if self.allocate_delay:
            await anyio.sleep(self.allocate_delay)  # slow hardware preparation
        return Allocation.merge(devices)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--resource", default="reliability.example.com/dev")
    parser.add_argument("--count", type=int, default=4)
    parser.add_argument("--allocate-delay", type=float, default=0.0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    settings = Settings(
        device_plugin_dir=args.dir,
        register_timeout=15.0,
        register_backoff_initial=0.02,
        register_backoff_max=0.5,
        restart_poll_interval=0.5,
        stream_lost_grace=1.0,
        reregister_delay=0.2,
        health_interval=0.5,
        stop_grace=2.0,
    )
    run(ReliabilityPlugin(args.resource, args.count, args.allocate_delay), settings=settings)


if __name__ == "__main__":
    main()
