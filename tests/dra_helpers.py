"""Helpers of the DRA tests: the driver name most of them serve as, and a stand-in
``nvidia-smi`` for the NVIDIA backend's claim configuration."""

from __future__ import annotations

import stat
import sys
from pathlib import Path

DRIVER = "widget.acme.com"


def fake_nvidia_smi(tmp_path: Path) -> tuple[tuple[str, ...], Path]:
    """A stand-in ``nvidia-smi`` (a real process) that appends its arguments to a log, one line
    a call; it fails (exit 3) for an argument containing ``GPU-fail``."""
    log = tmp_path / "nvidia-smi.log"
    script = tmp_path / "nvidia-smi.py"
    script.write_text(
        "import sys\n"
        f"open({str(log)!r}, 'a').write(' '.join(sys.argv[1:]) + '\\n')\n"
        "sys.exit(3 if 'GPU-fail' in ' '.join(sys.argv) else 0)\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return (sys.executable, str(script)), log


def calls(log: Path) -> list[str]:
    """The recorded ``nvidia-smi`` calls, and the log emptied."""
    said = log.read_text().splitlines() if log.exists() else []
    log.write_text("")
    return said
