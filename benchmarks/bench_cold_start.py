"""Cold start: from starting a plugin process to the kubelet holding its registration.

Each run starts a plugin process against a FakeKubelet in this process, and times the moment
the kubelet accepted Register and the moment the resource became allocatable; then stops the
process with SIGTERM. Two plugin processes are timed:

* ``devplugin run generic --config FILE`` (the shipped CLI and a built-in backend, as the
  generic image runs it; one resource of 8 files);
* ``benchmarks/_plugin_process.py`` (the benchmarks' own harness; it also imports the test
  tools).

For context it also times a bare ``python -c pass``, ``import devplugin_sdk`` (its names load
on first use) and ``import devplugin_sdk.runner`` (what serving needs: grpc, protobuf, anyio).
Bytecode is compiled ahead into a private cache (``PYTHONPYCACHEPREFIX``), as ``pip install``
does for an image; ``--source`` times compiling every module from source instead (what a
checkout under ``PYTHONDONTWRITEBYTECODE=1`` does).

    python benchmarks/bench_cold_start.py [--runs 20] [--source]
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

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


def precompile(prefix: Path) -> None:
    """Compile every module on the path into ``prefix`` and make child processes read it."""
    roots = [p for p in sys.path if p and Path(p).is_dir() and not p.endswith(".zip")]
    compile_all = [sys.executable, "-X", f"pycache_prefix={prefix}", "-m", "compileall"]
    subprocess.run(
        [*compile_all, "-q", "-j", "0", *roots],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        check=False,  # a file that does not compile (a test fixture) is not imported either
    )
    os.environ["PYTHONPYCACHEPREFIX"] = str(prefix)


async def timed_runs(
    kubelet: FakeKubelet, command: list[str], runs: int
) -> tuple[list[float], list[float]]:
    """Spawn ``command`` ``runs`` times; times to registered and to allocatable."""
    registered: list[float] = []
    allocatable: list[float] = []
    for _ in range(runs):
        before = len(kubelet.successful_registrations(RESOURCE))
        started = time.perf_counter()
        process = await anyio.open_process(command, stdin=subprocess.DEVNULL, stdout=None)
        try:
            await kubelet.wait_for_registrations(RESOURCE, before + 1, timeout=30)
            registered.append(time.perf_counter() - started)
            await kubelet.wait_for_allocatable(RESOURCE, DEVICES, timeout=30)
            allocatable.append(time.perf_counter() - started)
        finally:
            with anyio.CancelScope(shield=True):
                process.terminate()
                await process.wait()
                await process.aclose()
        await kubelet.wait_for_allocatable(RESOURCE, 0, timeout=30)
    return registered, allocatable


async def main() -> None:
    args_parser = _common.parser(__doc__ or "")
    args_parser.add_argument("--runs", type=int, default=20)
    args_parser.add_argument("--source", action="store_true", help="no bytecode compiled ahead")
    args = args_parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="dp-cold-") as scratch:
        root = Path(scratch)
        if not args.source:
            precompile(root / "pycache")
        _common.print_header(
            "Cold start",
            runs=args.runs,
            devices=DEVICES,
            bytecode="compiled from source each run" if args.source else "compiled ahead",
        )
        _common.report("python -c pass", await interpreter("pass", args.runs))
        for module in ("devplugin_sdk", "devplugin_sdk.runner"):
            _common.report(
                f"python -c 'import {module}'", await interpreter(f"import {module}", args.runs)
            )
        dev = root / "dev"
        dev.mkdir()
        for index in range(DEVICES):
            (dev / f"bench{index}").touch()
        config = root / "config.yaml"
        config.write_text(f"resources:\n  - resourceName: {RESOURCE}\n    paths: [{dev}/bench*]\n")
        async with FakeKubelet() as kubelet:
            cli = [sys.executable, "-m", "devplugin_sdk", "run", "generic"]
            cli += ["--config", str(config), "--device-plugin-dir", str(kubelet.directory)]
            harness = [sys.executable, str(_common.PLUGIN_PROCESS), "--dir", str(kubelet.directory)]
            harness += ["--resource", f"{RESOURCE}={DEVICES}"]
            cli_registered, cli_allocatable = await timed_runs(kubelet, cli, args.runs)
            registered, allocatable = await timed_runs(kubelet, harness, args.runs)
    summary = _common.report("devplugin run generic: start -> registered", cli_registered)
    _common.report("devplugin run generic: start -> allocatable", cli_allocatable)
    _common.report("harness process: start -> registered", registered)
    _common.report("harness process: start -> allocatable", allocatable)
    _common.target("cold start (devplugin run), median", summary.p50, 0.15, unit="s")


if __name__ == "__main__":
    anyio.run(main, backend="asyncio")
