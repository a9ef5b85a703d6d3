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
from functools import partial
from pathlib import Path
from typing import TextIO

import anyio

from devplugin_sdk.backends.generic import GenericPlugin
from devplugin_sdk.kubelet.fake import FakeKubelet
from devplugin_sdk.runner import serve

__all__ = ["main", "run_demo"]

RESOURCE = "example.com/widget"


@dataclass(frozen=True, slots=True)
class Step:
    """One line of the timeline."""

    at_ms: float
    took_ms: float
    event: str
    detail: str


class _Timeline:
    """The steps taken so far, printed as they happen."""

    def __init__(self, out: TextIO | None, json_output: bool) -> None:
        self.steps: list[Step] = []
        self.origin = time.perf_counter()
        self.out = out if not json_output else None

    def record(self, event: str, started: float, detail: str = "") -> None:
        now = time.perf_counter()
        step = Step((now - self.origin) * 1000, (now - started) * 1000, event, detail)
        self.steps.append(step)
        if self.out is not None:
            print(
                f"[{step.at_ms:8.1f} ms] {event:<34} {step.took_ms:7.2f} ms  {detail}",
                file=self.out,
                flush=True,
            )

    async def timed(self, event: str, action: Callable[[], Awaitable[str]]) -> None:
        started = time.perf_counter()
        self.record(event, started, await action())


async def run_demo(out: TextIO | None = None, json_output: bool = False) -> list[Step]:
    """Run the demo; print the timeline to ``out`` as it happens and return it."""
    timeline = _Timeline(out, json_output)
    tree = Path(tempfile.mkdtemp(prefix="devplugin-demo-", dir="/tmp"))
    dev = tree / "dev"
    dev.mkdir()
    for i in range(4):
        (dev / f"widget{i}").touch()
    if timeline.out is not None:
        print(
            "devplugin demo: the generic backend on a temporary device tree, against an embedded "
            "FakeKubelet\n"
            f"  devices      {dev}/widget0..3 (appear in containers as /dev/widget0..3)\n"
            f"  resource     {RESOURCE}\n",
            file=timeline.out,
        )
    try:
        async with FakeKubelet() as kubelet:
            plugin = GenericPlugin(RESOURCE, ["/dev/widget*"], root=tree)
            started = time.perf_counter()
            async with anyio.create_task_group() as tg:
                await tg.start(partial(serve, plugin, settings=kubelet.settings()))
                await _lifecycle(timeline, kubelet, dev, started, plugin.effective_socket_name)
                started = time.perf_counter()
                tg.cancel_scope.cancel()
            socket_gone = not (kubelet.directory / plugin.effective_socket_name).exists()
            timeline.record(
                "plugin stopped", started, f"streams ended, socket removed: {socket_gone}"
            )
    finally:
        shutil.rmtree(tree, ignore_errors=True)
    steps = timeline.steps
    if out is not None and json_output:
        json.dump([dataclasses.asdict(step) for step in steps], out, indent=2)
        print(file=out)
    elif out is not None:
        print(
            f"\n{len(steps)} steps in {steps[-1].at_ms:.0f} ms: a device plugin, end to end.",
            file=out,
        )
    return steps


async def _lifecycle(
    timeline: _Timeline, kubelet: FakeKubelet, dev: Path, started: float, socket_name: str
) -> None:
    """The steps while the plugin is served: each waits for what the kubelet sees."""
    await kubelet.wait_for_registrations(RESOURCE, 1)
    timeline.record(
        "registered with the kubelet", started, f"socket {kubelet.directory}/{socket_name}"
    )
    await kubelet.wait_for_allocatable(RESOURCE, 4)
    timeline.record("capacity advertised", started, _counts(kubelet))

    async def allocate() -> str:
        got = await kubelet.allocate(RESOURCE, 2, pod="demo-pod")
        nodes = ", ".join(
            f"{n.container_path} ({n.permissions})" for n in got.allocation.device_nodes
        )
        return f"pod demo-pod got {', '.join(got.device_ids)} -> device nodes {nodes}"

    async def fail() -> str:
        (dev / "widget3").unlink()
        await kubelet.wait_for_health(RESOURCE, "widget3", "Unhealthy")
        return f"removed {dev}/widget3 -> kubelet sees it Unhealthy; {_counts(kubelet)}"

    async def recover() -> str:
        (dev / "widget3").touch()
        await kubelet.wait_for_health(RESOURCE, "widget3", "Healthy")
        return f"recreated it -> Healthy again; {_counts(kubelet)}"

    async def restart() -> str:
        await kubelet.restart()
        await kubelet.wait_for_registrations(RESOURCE, 2)
        await kubelet.wait_for_allocatable(RESOURCE, 4)
        return (
            "kubelet wiped its directory and recreated kubelet.sock -> "
            f"re-registered, allocatable={kubelet.allocatable(RESOURCE)}"
        )

    async def hotplug() -> str:
        (dev / "widget4").touch()
        await kubelet.wait_for_allocatable(RESOURCE, 5)
        return f"created {dev}/widget4 -> capacity={kubelet.capacity(RESOURCE)}"

    await timeline.timed("allocated 2 widgets", allocate)
    await timeline.timed("device failed", fail)
    await timeline.timed("device recovered", recover)
    await timeline.timed("kubelet restarted, plugin back", restart)
    await timeline.timed("device hot-plugged", hotplug)


def _counts(kubelet: FakeKubelet) -> str:
    return f"capacity={kubelet.capacity(RESOURCE)} allocatable={kubelet.allocatable(RESOURCE)}"


def main(json_output: bool = False) -> int:
    """Run the demo on stdout; exit code 0 when every step happened."""
    anyio.run(lambda: run_demo(sys.stdout, json_output), backend="asyncio")
    return 0
