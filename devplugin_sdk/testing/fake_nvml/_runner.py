"""``python -m devplugin_sdk.testing.fake_nvml``: install a fake machine as ``pynvml`` and run
``devplugin``.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from devplugin_sdk.testing.fake_nvml._machines import MACHINES, a100_mig


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m devplugin_sdk.testing.fake_nvml",
        description="Run `devplugin` with a fake NVML machine installed as pynvml.",
        epilog="example: --machine dgx_a100 --host-root /tmp/host -- "
        "run plugin:SiteGpuPlugin --config config.yaml",
    )
    parser.add_argument("--machine", choices=sorted(MACHINES), default="dgx_a100")
    parser.add_argument(
        "--mig",
        action="append",
        metavar="PROFILES",
        help="a100_mig only: one GPU per flag, its MIG profiles comma-separated "
        "(3g.40gb,1g.10gb) or 'off'; default one GPU with 3g.40gb,2g.20gb,1g.10gb,1g.10gb",
    )
    parser.add_argument(
        "--host-root",
        type=Path,
        help="write the machine's sys/, dev/ and proc/ trees under this directory",
    )
    parser.add_argument("devplugin_args", nargs=argparse.REMAINDER, help="-- then devplugin's")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Install a fake machine as ``pynvml`` and run ``devplugin`` with the remaining arguments.

    Returns:
        ``devplugin``'s exit status (2 for a bad command line of this runner).
    """
    parser = _parser()
    args = parser.parse_args(argv)
    rest = list(args.devplugin_args)
    if rest[:1] == ["--"]:
        rest = rest[1:]
    if not rest:
        parser.error("give devplugin's arguments after --, e.g. -- run plugin:X --config FILE")
    if args.mig and args.machine != "a100_mig":
        parser.error("--mig needs --machine a100_mig")
    if args.mig:
        layouts = [None if m == "off" else tuple(m.split(",")) for m in args.mig]
        try:
            nvml = a100_mig(layouts)
        except ValueError as exc:
            parser.error(str(exc))
    else:
        nvml = MACHINES[args.machine]()
    if args.host_root is not None:
        nvml.write_host(args.host_root)
    # Imported here: the CLI pulls in the whole engine, which the fake itself never needs.
    from devplugin_sdk import cli  # noqa: PLC0415

    with nvml.installed():
        return cli.main(rest)
