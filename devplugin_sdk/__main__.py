"""``python -m devplugin_sdk`` and the ``devplugin`` command."""

from __future__ import annotations

import gc
import os


def main() -> int:
    """Entry point of ``devplugin``: load the command line with the cyclic GC paused, run it.

    Loading the SDK, grpc, protobuf and anyio creates tens of thousands of objects that live as
    long as the process and next to no cyclic garbage; a running collector scans them again and
    again, about 15 ms of CPU before Register on a 2-core node (docs/performance.md). Once
    loaded they are frozen out of later collections, which then scan only what the plugin
    makes.
    """
    # gRPC's C core writes INFO lines of its own to stderr (a GOAWAY when the process stops
    # while a peer is connected); the command's stderr carries our lines only, and a user who
    # sets GRPC_VERBOSITY still gets theirs.
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    gc.disable()
    try:
        from devplugin_sdk import cli  # noqa: PLC0415 - loaded with the collector paused
    finally:
        gc.freeze()
        gc.enable()
    return cli.main()


if __name__ == "__main__":
    raise SystemExit(main())
