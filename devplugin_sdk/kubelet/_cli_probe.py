"""The ``devplugin probe`` and ``devplugin conformance`` subcommands: arguments and output.

``register(subparsers)`` adds both to the ``devplugin`` parser (``cli.py`` calls it); the work is
done by ``probe`` and ``conformance``. Exit codes: 0 success, 1 the plugin failed or could not be
reached, 2 bad arguments, 130 interrupted (Ctrl-C). Results go to stdout, errors to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Coroutine
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import anyio

from devplugin_sdk._limits import Limits
from devplugin_sdk.api import constants

if TYPE_CHECKING:
    from devplugin_sdk.kubelet import probe

__all__ = ["HelpFormatter", "parse_allocate", "register", "run_conformance", "run_probe"]


class HelpFormatter(argparse.HelpFormatter):
    """argparse's help, with the ``examples:`` epilog kept line by line (commands to copy)."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if text.startswith("examples:"):
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``probe`` and ``conformance`` subcommands, each with ``func=<callable(args)>``."""
    _add_probe(subparsers)
    _add_conformance(subparsers)


def _add_probe(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "probe",
        help="show what the kubelet gets from a running plugin",
        description=(
            "Connect to a device plugin's socket the way the kubelet does and print what the "
            "kubelet would get: options, the first ListAndWatch list and, with --allocate, the "
            "preferred choice and the container response. Works with any plugin. Exit codes: "
            "0 success, 1 the plugin failed or could not be reached, 2 bad arguments."
        ),
        formatter_class=HelpFormatter,
        epilog="examples:\n  devplugin probe --socket /tmp/kubelet/acme.com_widget.sock\n"
        "  devplugin probe --socket /tmp/kubelet/acme.com_widget.sock --allocate 2\n"
        "  devplugin probe --socket /tmp/kubelet/acme.com_widget.sock --watch --json",
    )
    p.add_argument("--socket", required=True, type=Path, metavar="PATH", help="plugin socket")
    p.add_argument(
        "--allocate",
        metavar="N|ID,ID",
        type=parse_allocate,
        help=(
            "allocate N devices the kubelet's way (GetPreferredAllocation when advertised, then "
            "Allocate), or exactly the listed IDs; a trailing comma makes '3,' an ID "
            "(default: no allocation)"
        ),
    )
    p.add_argument("--watch", action="store_true", help="keep ListAndWatch open, print changes")
    p.add_argument(
        "--json", action="store_true", help="JSON output (one line per change with --watch)"
    )
    p.add_argument(
        "--timeout",
        type=_positive,
        default=constants.KUBELET_DIAL_TIMEOUT_S,
        metavar="SECONDS",
        help="dial timeout and deadline of each call (default: %(default)g, the kubelet's dial)",
    )
    p.set_defaults(func=run_probe)


def _add_conformance(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    c = subparsers.add_parser(
        "conformance",
        help="check that a device plugin obeys the kubelet protocol",
        description=(
            "Run the protocol conformance suite against a device plugin, written with this SDK "
            "or not: one line per check (PASS, WARN, FAIL or SKIP), then a summary. A check "
            "fails where the kubelet would break or misbehave, and warns where it copes but "
            "the plugin's intent is lost. Exit code 0 when no check fails (and, with --strict, "
            "none warns)."
        ),
        formatter_class=HelpFormatter,
        epilog="examples:\n  devplugin conformance --socket /tmp/kubelet/acme.com_widget.sock\n"
        "  devplugin conformance --register-dir /tmp/kubelet --strict",
    )
    target = c.add_mutually_exclusive_group(required=True)
    target.add_argument(
        "--socket", type=Path, metavar="PATH", help="a plugin's socket (registered elsewhere)"
    )
    target.add_argument(
        "--register-dir",
        type=Path,
        metavar="DIR",
        help=(
            "act as the kubelet on DIR/kubelet.sock (DIR's files are deleted, as at kubelet "
            "start), test every plugin that registers, then restart the kubelet"
        ),
    )
    c.add_argument(
        "--dra",
        action="store_true",
        help="check a DRA kubelet plugin: --socket is its registration socket in "
        "plugins_registry (or its DRA socket); only claims that do not exist are sent",
    )
    c.add_argument("--json", action="store_true", help="one JSON document instead of lines")
    c.add_argument(
        "--strict", action="store_true", help="warnings fail too (exit code 1 on any WARN)"
    )
    _add_limits(c)
    c.set_defaults(func=run_conformance)


def _add_limits(c: argparse.ArgumentParser) -> None:
    """The options that set ``conformance.Limits``, defaulting to its defaults."""
    defaults = Limits()
    c.add_argument(
        "--timeout",
        type=_positive,
        default=defaults.timeout,
        metavar="SECONDS",
        help="dial timeout and deadline of each call or stream wait (default: %(default)g)",
    )
    c.add_argument(
        "--fast-within",
        type=_positive,
        default=defaults.fast_within,
        metavar="SECONDS",
        help="how fast options and the first list must come (default: %(default)g)",
    )
    c.add_argument(
        "--max-devices",
        type=int,
        default=defaults.max_devices,
        metavar="N",
        help="allocate at most N devices one by one (default: %(default)d)",
    )
    c.add_argument(
        "--wait",
        type=_positive,
        default=defaults.register_wait,
        metavar="SECONDS",
        help="--register-dir: how long to wait for a registration (default: %(default)g)",
    )
    c.add_argument(
        "--expect",
        type=int,
        default=defaults.expect,
        metavar="N",
        help="--register-dir: wait for N resources to register (default: %(default)d)",
    )
    c.add_argument(
        "--restart-timeout",
        type=_positive,
        default=defaults.restart_timeout,
        metavar="SECONDS",
        help="--register-dir: time allowed to re-register after a kubelet restart "
        "(default: %(default)g)",
    )


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def parse_allocate(text: str) -> int | tuple[str, ...]:
    """``--allocate``: an integer is a device count; anything else is comma-separated IDs.

    Raises:
        argparse.ArgumentTypeError: an empty list or a count below 1.
    """
    if text.isdigit():
        count = int(text)
        if count < 1:
            raise argparse.ArgumentTypeError("the device count must be >= 1")
        return count
    ids = tuple(part.strip() for part in text.split(",") if part.strip())
    if not ids:
        raise argparse.ArgumentTypeError(f"no device IDs in {text!r}")
    return ids


def _run(main: Callable[[], Coroutine[Any, Any, int]]) -> int:
    try:
        return anyio.run(main, backend="asyncio")
    except KeyboardInterrupt:
        return 130  # 128 + SIGINT, as a shell reports an interrupted command


# ------------------------------------------------------------------------------------------ probe


def run_probe(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """``devplugin probe``: print what the kubelet gets; 0 on success, 1 on any failure."""
    stream = out or sys.stdout

    async def main() -> int:
        return await _probe(args, stream, out or sys.stderr)

    return _run(main)


async def _probe(args: argparse.Namespace, out: TextIO, err: TextIO | None = None) -> int:
    # Loaded for this command only: ``devplugin run`` starts faster without it.
    from devplugin_sdk.kubelet import probe  # noqa: PLC0415

    client: probe.PluginClient | None = None
    try:
        client = await probe.PluginClient.connect(
            args.socket, timeout=args.timeout, rpc_timeout=args.timeout
        )
        report = await probe.probe(client, allocate=args.allocate)
        if args.json:
            _print(out, json.dumps(report.to_json()))
        else:
            _print(out, _format_report(report))
        if args.watch:
            if not args.json:
                _print(out, "watching ListAndWatch (Ctrl-C to stop)")
            async for devices, changes in probe.watch(client, since=report.devices):
                _print(out, _format_change(devices, changes, json_lines=args.json))
    except probe.ProbeError as exc:
        _print_error(err or sys.stderr, exc, json_output=args.json)
        return 1
    finally:
        if client is not None:
            with anyio.CancelScope(shield=True):
                await client.close()
    return 0


def _print(out: TextIO, text: str) -> None:
    print(text, file=out, flush=True)


def _print_error(out: TextIO, exc: probe.ProbeError, *, json_output: bool) -> None:
    if json_output:
        _print(out, json.dumps({"error": {"kind": exc.kind, "message": str(exc)}}))
    else:
        _print(out, f"devplugin: error: {exc}")


def _format_report(report: probe.ProbeReport) -> str:
    options = report.options
    devices = report.devices
    lines = [
        f"socket      {report.socket}",
        f"connected   in {_ms(report.connect_seconds)}",
        f"options     pre_start_required={_bool(options.pre_start_required)} "
        f"get_preferred_allocation_available={_bool(options.preferred_allocation)} "
        f"(in {_ms(report.options_seconds)})",
        f"devices     capacity {len(devices.by_id())}, allocatable {len(devices.healthy)} "
        f"(first list after {_ms(report.list_seconds)}, {devices.size} bytes)",
    ]
    if devices.devices:
        width = max(len("ID"), *(len(d.id) for d in devices.devices))
        lines.append(f"  {'ID':<{width}}  {'HEALTH':<9}  NUMA")
        lines.extend(
            f"  {d.id:<{width}}  {d.health:<9}  {_numa(d.numa_nodes)}" for d in devices.devices
        )
    if report.allocation is not None:
        lines.extend(_format_allocation(report.allocation))
    lines.extend(f"note        {note}" for note in report.notes)
    return "\n".join(lines)


def _format_allocation(report: probe.AllocationReport) -> list[str]:
    requested = (
        f"{report.requested} device(s)"
        if isinstance(report.requested, int)
        else ",".join(report.requested)
    )
    lines = [f"allocate    {requested}"]
    if report.preferred is not None:
        lines.append(f"  preferred   {','.join(report.preferred) or '(no answer)'}")
    lines.append(f"  allocated   {','.join(report.device_ids)}")
    if report.containers != 1:
        lines.append(
            f"  warning     {report.containers} container responses (the kubelet reads the first)"
        )
    a = report.allocation
    lines.extend(
        f"  device      {n.host_path} -> {n.container_path} ({n.permissions})"
        for n in a.device_nodes
    )
    lines.extend(
        f"  mount       {m.host_path} -> {m.container_path}{' (ro)' if m.read_only else ''}"
        for m in a.mounts
    )
    lines.extend(f"  env         {k}={v}" for k, v in sorted(a.env.items()))
    lines.extend(f"  annotation  {k}={v}" for k, v in sorted(a.annotations.items()))
    lines.extend(f"  cdi         {name}" for name in a.cdi_devices)
    if not (a.device_nodes or a.mounts or a.env or a.annotations or a.cdi_devices):
        lines.append("  (empty container response)")
    return lines


def _format_change(
    devices: probe.DeviceList, changes: list[probe.DeviceChange], *, json_lines: bool
) -> str:
    stamp = datetime.fromtimestamp(devices.received_at).astimezone()
    if json_lines:
        return json.dumps(
            {
                "time": stamp.isoformat(timespec="milliseconds"),
                "capacity": len(devices.by_id()),
                "allocatable": len(devices.healthy),
                "changes": [c.to_json() for c in changes],
                "devices": [d.to_json() for d in devices.devices],
            }
        )
    summary = "; ".join(c.describe() for c in changes)
    return (
        f"{stamp.strftime('%H:%M:%S.%f')[:-3]}  capacity {len(devices.by_id())}, "
        f"allocatable {len(devices.healthy)}: {summary}"
    )


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def _bool(value: bool) -> str:
    return "true" if value else "false"


def _numa(nodes: tuple[int, ...]) -> str:
    return ",".join(map(str, nodes)) if nodes else "-"


# ------------------------------------------------------------------------------- conformance


def run_conformance(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """``devplugin conformance``: 0 when no check failed (nor warned, with ``--strict``)."""
    stream = out or sys.stdout

    async def main() -> int:
        return await _conformance(args, stream, out or sys.stderr)

    return _run(main)


async def _conformance(args: argparse.Namespace, out: TextIO, err: TextIO | None = None) -> int:
    # The checks bring the fake kubelet and the DRA client: loaded for this command only.
    from devplugin_sdk.kubelet import conformance  # noqa: PLC0415

    limits = Limits(
        fast_within=args.fast_within,
        timeout=args.timeout,
        max_devices=max(args.max_devices, 1),
        register_wait=args.wait,
        expect=max(args.expect, 1),
        restart_timeout=args.restart_timeout,
    )
    resource: list[str | None] = [None]

    def line(result: conformance.CheckResult) -> None:
        if args.json:
            return
        if result.resource is not None and result.resource != resource[0]:
            _print(out, f"== {result.resource}")
        resource[0] = result.resource
        _print(out, result.line())

    def waiting(socket_path: Path) -> None:
        if not args.json:
            _print(out, f"serving {socket_path}; waiting for a plugin to register")

    errors = err or sys.stderr
    try:
        if args.dra:
            if args.socket is None:
                _print(errors, "devplugin: error: --dra needs --socket (its registration socket)")
                return 2
            report = await conformance.check_dra_socket(args.socket, limits, line)
        elif args.socket is not None:
            report = await conformance.check_socket(args.socket, limits, line)
        else:
            report = await conformance.check_register_dir(
                args.register_dir, limits, line, on_waiting=waiting
            )
    except conformance.ConformanceError as exc:
        if args.json:
            _print(errors, json.dumps({"error": {"kind": "setup", "message": str(exc)}}))
        else:
            _print(errors, f"devplugin: error: {exc}")
        return 1
    if args.json:
        _print(out, json.dumps(report.to_json(strict=args.strict)))
    elif args.strict and report.count("warn"):
        _print(out, f"{report.summary()} (--strict: warnings fail)")
    else:
        _print(out, report.summary())
    return 0 if report.succeeded(strict=args.strict) else 1
