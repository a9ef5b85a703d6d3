"""``devplugin demo``: the whole lifecycle on a bare machine, with the milliseconds each step took.

It runs the generic backend on a temporary device tree against an embedded FakeKubelet (no
kubelet, no hardware, no root): registration, capacity, an allocation's device nodes, a device
failing and recovering, a kubelet restart and the re-registration, a hot-plugged device, and a
clean shutdown.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import anyio

from devplugin_sdk._fake_kubelet import FakeKubelet
from devplugin_sdk.backends.generic import GenericPlugin

# TODO(lead): ``serving`` belongs to the runner; import it from its engine home once it has one,
# so that no shipped command imports devplugin_sdk.testing.
from devplugin_sdk.testing import serving

__all__ = ["main", "run_demo"]

RESOURCE = "example.com/widget"


@dataclass(frozen=True, slots=True)
class Step:
    """One line of the timeline."""

    at_ms: float
    took_ms: float
    event: str
    detail: str


async def run_demo(out: TextIO | None = None, json_output: bool = False) -> list[Step]:
    """Run the demo; print the timeline to ``out`` as it happens and return it."""
    steps: list[Step] = []
    origin = time.perf_counter()
    tree = Path(tempfile.mkdtemp(prefix="devplugin-demo-", dir="/tmp"))
    dev = tree / "dev"
    dev.mkdir()
    for i in range(4):
        (dev / f"widget{i}").touch()

    def record(event: str, started: float, detail: str = "") -> None:
        now = time.perf_counter()
        step = Step((now - origin) * 1000, (now - started) * 1000, event, detail)
        steps.append(step)
        if out is not None and not json_output:
            print(
                f"[{step.at_ms:8.1f} ms] {event:<34} {step.took_ms:7.2f} ms  {detail}",
                file=out,
                flush=True,
            )

    if out is not None and not json_output:
        print(
            "devplugin demo: the generic backend on a temporary device tree, against an embedded "
            "FakeKubelet\n"
            f"  devices      {dev}/widget0..3 (appear in containers as /dev/widget0..3)\n"
            f"  resource     {RESOURCE}\n",
            file=out,
        )

    async def timed(event: str, action: Callable[[], Awaitable[str]]) -> None:
        started = time.perf_counter()
        detail = await action()
        record(event, started, detail)

    try:
        async with FakeKubelet() as kubelet:
            plugin = GenericPlugin(RESOURCE, ["/dev/widget*"], root=tree)
            started = time.perf_counter()
            async with serving(plugin, settings=kubelet.settings()):
                await kubelet.wait_for_registrations(RESOURCE, 1)
                record(
                    "registered with the kubelet",
                    started,
                    f"socket {kubelet.directory}/{plugin.effective_socket_name}",
                )
                await kubelet.wait_for_allocatable(RESOURCE, 4)
                record(
                    "capacity advertised",
                    started,
                    _counts(kubelet),
                )

                async def allocate() -> str:
                    got = await kubelet.allocate(RESOURCE, 2, pod="demo-pod")
                    nodes = ", ".join(
                        f"{n.container_path} ({n.permissions})" for n in got.allocation.device_nodes
                    )
                    return f"pod demo-pod got {', '.join(got.device_ids)} -> device nodes {nodes}"

                await timed("allocated 2 widgets", allocate)

                async def fail() -> str:
                    (dev / "widget3").unlink()
                    await kubelet.wait_for_health(RESOURCE, "widget3", "Unhealthy")
                    counts = _counts(kubelet)
                    return f"removed {dev}/widget3 -> kubelet sees it Unhealthy; {counts}"

                await timed("device failed", fail)

                async def recover() -> str:
                    (dev / "widget3").touch()
                    await kubelet.wait_for_health(RESOURCE, "widget3", "Healthy")
                    return f"recreated it -> Healthy again; {_counts(kubelet)}"

                await timed("device recovered", recover)

                async def restart() -> str:
                    await kubelet.restart()
                    await kubelet.wait_for_registrations(RESOURCE, 2)
                    await kubelet.wait_for_allocatable(RESOURCE, 4)
                    return (
                        "kubelet wiped its directory and recreated kubelet.sock -> "
                        f"re-registered, allocatable={kubelet.allocatable(RESOURCE)}"
                    )

                await timed("kubelet restarted, plugin back", restart)

                async def hotplug() -> str:
                    (dev / "widget4").touch()
                    await kubelet.wait_for_allocatable(RESOURCE, 5)
                    return f"created {dev}/widget4 -> capacity={kubelet.capacity(RESOURCE)}"

                await timed("device hot-plugged", hotplug)
                started = time.perf_counter()
            socket_gone = not (kubelet.directory / plugin.effective_socket_name).exists()
            record("plugin stopped", started, f"streams ended, socket removed: {socket_gone}")
    finally:
        shutil.rmtree(tree, ignore_errors=True)
    if out is not None and json_output:
        json.dump([dataclasses.asdict(step) for step in steps], out, indent=2)
        print(file=out)
    elif out is not None:
        print(
            f"\n{len(steps)} steps in {steps[-1].at_ms:.0f} ms: a device plugin, end to end.",
            file=out,
        )
    return steps


def _counts(kubelet: FakeKubelet) -> str:
    return f"capacity={kubelet.capacity(RESOURCE)} allocatable={kubelet.allocatable(RESOURCE)}"


def main(json_output: bool = False) -> int:
    """Run the demo on stdout; exit code 0 when every step happened."""
    anyio.run(lambda: run_demo(sys.stdout, json_output), backend="asyncio")
    return 0
