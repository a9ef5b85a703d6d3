"""``devplugin ARGS`` as the image runs it, with one fault switch for the CDI fault tests.

    python _cdi_launch.py [--die-on-file-size-limit] ARGS...

``--die-on-file-size-limit`` restores SIGXFSZ's default action (CPython ignores the signal at
start), so that a write past the process's RLIMIT_FSIZE, which a test lowers with ``prlimit``
at the moment it chooses, kills the process inside write(2): no handler and no ``finally`` run,
exactly what a SIGKILL in the middle of a spec write leaves behind. Core dumps are turned off.
"""

from __future__ import annotations

import resource
import signal
import sys

from devplugin_sdk import cli


def main() -> int:
    args = sys.argv[1:]
    if args[:1] == ["--die-on-file-size-limit"]:
        args = args[1:]
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
    return cli.main(args)


if __name__ == "__main__":
    sys.exit(main())
