"""Footprint: RSS and CPU of an idle plugin process serving three resources.

The plugin process uses production settings (``Settings()`` with only the directory changed)
and serves three kinds of plugin, 8 devices each: pushed health only (``watch()`` idle until
an event), polled health (``check_health`` every ``health_interval``, 10 s) and the generic
backend (8 files followed with fswatch: inotify, plus a re-glob every ``healthInterval``, 2 s).
Once all three are registered with a FakeKubelet, it samples the process for ``--seconds``
(60 by default) and prints RSS, CPU time, threads and context switches (a wakeup count: what
polls, and how often). ``--kinds static`` (or ``polled``, ``generic``) measures one kind alone.

    python benchmarks/bench_footprint.py [--seconds 60]
"""

from __future__ import annotations

import _common
import anyio

from devplugin_sdk.testing import FakeKubelet

KINDS = ("static", "polled", "generic")
DEVICES = 8


async def main() -> None:
    args_parser = _common.parser(__doc__ or "")
    args_parser.add_argument("--seconds", type=float, default=60.0)
    args_parser.add_argument("--kinds", default=",".join(KINDS), help="one resource per kind")
    args = args_parser.parse_args()
    kinds = [k for k in args.kinds.split(",") if k]
    unknown = set(kinds) - set(KINDS)
    if unknown:
        args_parser.error(f"unknown kinds {', '.join(sorted(unknown))}; known: {', '.join(KINDS)}")
    resources = [f"bench.example.com/{kind}{i}" for i, kind in enumerate(kinds)]
    _common.print_header(
        "Idle footprint", seconds=args.seconds, kinds=",".join(kinds), devices=DEVICES
    )
    options: list[str] = []
    for resource, kind in zip(resources, kinds, strict=True):
        options += ["--resource", f"{resource}={DEVICES}", "--kind", kind]
    async with (
        FakeKubelet() as kubelet,
        _common.plugin_process("--dir", str(kubelet.directory), *options) as process,
    ):
        for resource in resources:
            await kubelet.wait_for_allocatable(resource, DEVICES, timeout=30)
        # Let start-up work (first health poll, imports finishing) settle before sampling.
        await anyio.sleep(1.0)
        before = _common.process_stats(process.pid)
        threads_before = _common.thread_wakeups(process.pid)
        peak = before.rss_bytes
        elapsed = 0.0
        while elapsed < args.seconds:
            step = min(5.0, args.seconds - elapsed)
            await anyio.sleep(step)
            elapsed += step
            peak = max(peak, _common.process_stats(process.pid).rss_bytes)
        after = _common.process_stats(process.pid)
        threads_after = _common.thread_wakeups(process.pid)
        registered = all(kubelet.is_registered(r) for r in resources)
    cpu = after.cpu_seconds - before.cpu_seconds
    wakeups = after.voluntary_switches - before.voluntary_switches
    print(f"RSS: {_common.mib(after.rss_bytes)} (peak {_common.mib(peak)})")
    print(
        f"CPU: {cpu * 1e3:.1f} ms over {args.seconds:g} s = "
        f"{cpu / args.seconds * 100:.3f} % of a core"
    )
    print(f"threads: {after.threads}")
    print(
        f"voluntary context switches: {wakeups} = {wakeups / args.seconds:.1f}/s "
        f"(involuntary: {after.involuntary_switches - before.involuntary_switches})"
    )
    for thread, count in sorted(threads_after.items()):
        woke = count - threads_before.get(thread, 0)
        print(f"  thread {thread}: {woke / args.seconds:.1f} wakeups/s")
    print(f"still registered at the end: {registered}")
    _common.target("idle RSS", after.rss_bytes / 2**20, 50.0, unit="MiB")
    _common.target("idle CPU", cpu / args.seconds * 100, 0.5, unit="% of a core")


if __name__ == "__main__":
    anyio.run(main, backend="asyncio")
