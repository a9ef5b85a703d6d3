"""Cold start: from starting a plugin process to the kubelet holding its registration.

Each run starts ``python benchmarks/_plugin_process.py`` (one resource, production settings)
against a FakeKubelet in this process, and times the moment the kubelet accepted Register and
the moment the resource became allocatable; then stops the process with SIGTERM. For context
it also times a bare ``python -c pass`` and ``python -c "import devplugin_sdk"``.

    python benchmarks/bench_cold_start.py [--runs 20]
"""

from __future__ import annotations

import subprocess
import sys
import time

import _common
import anyio

from devplugin_sdk.testing import FakeKubelet

RESOURCE = "bench.example.com/dev"
DEVICES = 8


async def interpreter(code: str, runs: int) -> list[float]:
    samples = []
    for _ in range(runs):
        started = time.perf_counter()
        await anyio.run_process([sys.executable, "-c", code], stdout=subprocess.DEVNULL)
        samples.append(time.perf_counter() - started)
    return samples


async def main() -> None:
    args_parser = _common.parser(__doc__ or "")
    args_parser.add_argument("--runs", type=int, default=20)
    args = args_parser.parse_args()
    _common.print_header("Cold start", runs=args.runs, devices=DEVICES)
    _common.report("python -c pass", await interpreter("pass", args.runs))
    _common.report(
        "python -c 'import devplugin_sdk'", await interpreter("import devplugin_sdk", args.runs)
    )
    registered: list[float] = []
    allocatable: list[float] = []
    async with FakeKubelet() as kubelet:
        for run in range(args.runs):
            started = time.perf_counter()
            async with _common.plugin_process(
                "--dir", str(kubelet.directory), "--resource", f"{RESOURCE}={DEVICES}"
            ):
                await kubelet.wait_for_registrations(RESOURCE, run + 1, timeout=30)
                registered.append(time.perf_counter() - started)
                await kubelet.wait_for_allocatable(RESOURCE, DEVICES, timeout=30)
                allocatable.append(time.perf_counter() - started)
            await kubelet.wait_for_allocatable(RESOURCE, 0, timeout=30)
    summary = _common.report("process start -> registered", registered)
    _common.report("process start -> allocatable", allocatable)
    _common.target("cold start, median", summary.p50, 0.5, unit="s")


if __name__ == "__main__":
    anyio.run(main, backend="asyncio")
