"""Build the package and install a wheel offline, for the packaging and image tests.

Builds use the dev extra's hatchling with no build isolation, so no index is needed. A fresh venv
borrows this venv's site-packages for what pip would otherwise download: a plain path in a .pth
file, so the checkout's editable install (a .pth file of its own there) does not come along.
"""

from __future__ import annotations

import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(
    *command: str | Path, cwd: Path = ROOT, check: bool = True
) -> subprocess.CompletedProcess[str]:
    """Run ``command`` to its end (90 s at most); with ``check``, fail the test on an error."""
    result = subprocess.run(
        [str(c) for c in command],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
        stdin=subprocess.DEVNULL,
    )
    if check:
        assert result.returncode == 0, result.stdout + result.stderr
    return result


def pip(
    python: Path, *args: str | Path, cwd: Path = ROOT, check: bool = True
) -> subprocess.CompletedProcess[str]:
    """This venv's pip, acting on the environment of ``python``."""
    return run(
        sys.executable, "-m", "pip", "--python", python, "--disable-pip-version-check", *args,
        cwd=cwd, check=check,
    )  # fmt: skip


def build_sdist_and_wheel(out: Path) -> tuple[Path, Path]:
    """(sdist, wheel) of the checkout in ``out``, the wheel built from the sdist as pip does
    from an index."""
    code = "import sys, hatchling.build as b; print(b.build_sdist(sys.argv[1]))"
    name = run(sys.executable, "-c", code, out).stdout.strip().splitlines()[-1]
    sdist = out / name
    pip(Path(sys.executable), "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", out, sdist)
    (wheel,) = out.glob("*.whl")
    return sdist, wheel


def fresh_venv(path: Path) -> Path:
    """A venv at ``path`` without pip, with this venv's packages importable; its python."""
    run(sys.executable, "-m", "venv", "--without-pip", path)
    (site,) = (path / "lib").glob("python3*/site-packages")
    (site / "deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    return path / "bin" / "python"
