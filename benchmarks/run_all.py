"""Run every benchmark in turn with the settings docs/performance.md records.

    python benchmarks/run_all.py [--quick] [--only allocate,health,...]

``--quick`` cuts every count (a smoke run, a minute or two, figures noisier); the full run
takes about ten minutes on a 2-core VM. Each benchmark prints its machine line first.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import _common

HERE = Path(__file__).resolve().parent

FULL: dict[str, list[str]] = {
    "allocate": ["bench_allocate.py", "--calls", "5000"],
    "allocate-split": ["bench_allocate.py", "--calls", "5000", "--split"],
    "health": ["bench_health.py", "--events", "2000"],
    "health-split": ["bench_health.py", "--events", "2000", "--split"],
    "restart": ["bench_restart.py", "--restarts", "100"],
    "cold-start": ["bench_cold_start.py", "--runs", "20"],
    "scale": ["bench_scale.py", "--flips", "20"],
    "footprint": ["bench_footprint.py", "--seconds", "60"],
    "sharing": ["bench_sharing.py", "--calls", "200", "--mib-calls", "50"],
    "dra": ["bench_dra.py", "--claims", "500", "--flips", "500"],
    "publish": ["bench_publish.py"],
    "upgrade": ["bench_upgrade.py", "--upgrades", "100"],
    "fleet": ["bench_fleet.py", "--nodes", "1000"],
}
QUICK: dict[str, list[str]] = {
    "allocate": ["bench_allocate.py", "--calls", "500", "--warmup", "50"],
    "allocate-split": ["bench_allocate.py", "--calls", "500", "--warmup", "50", "--split"],
    "health": ["bench_health.py", "--events", "200"],
    "health-split": ["bench_health.py", "--events", "200", "--split"],
    "restart": ["bench_restart.py", "--restarts", "20"],
    "cold-start": ["bench_cold_start.py", "--runs", "3"],
    "scale": ["bench_scale.py", "--sizes", "1000,10000", "--flips", "5"],
    "footprint": ["bench_footprint.py", "--seconds", "10"],
    "sharing": ["bench_sharing.py", "--calls", "20", "--mib-calls", "5"],
    "dra": ["bench_dra.py", "--claims", "50", "--flips", "50"],
    "publish": ["bench_publish.py", "--storm", "500", "--flips", "560", "--window", "2"],
    "upgrade": ["bench_upgrade.py", "--upgrades", "10"],
    "fleet": ["bench_fleet.py", "--nodes", "100", "--steady-minutes", "10", "--changes", "20"],
}


def main() -> None:
    args_parser = _common.parser(__doc__ or "")
    args_parser.add_argument("--quick", action="store_true")
    args_parser.add_argument("--only", default="", help="comma-separated names: " + ",".join(FULL))
    args = args_parser.parse_args()
    plan = QUICK if args.quick else FULL
    names = [n for n in args.only.split(",") if n] or list(plan)
    failed = []
    for name in names:
        script, *options = plan[name]
        print(f"\n### {name}: python benchmarks/{script} {' '.join(options)}", flush=True)
        result = subprocess.run([sys.executable, str(HERE / script), *options], check=False)
        if result.returncode != 0:
            failed.append(name)
    if failed:
        sys.exit(f"benchmarks that did not finish: {', '.join(failed)}")


if __name__ == "__main__":
    main()
