"""What `pip install .` produces: an sdist and a wheel that carry the license and the metadata a
package index shows, and a command that works from the installed wheel alone (issue 18, item 6).

Built offline with the dev extra's hatchling (no build isolation, so no index is needed), by
the ``distributions`` fixture (tests/conftest.py, tests/packaging_helpers.py).
"""

from __future__ import annotations

import email.parser
import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
from packaging_helpers import ROOT, fresh_venv, pip

import devplugin_sdk

pytestmark = pytest.mark.timeout(120)  # two builds and a venv: about 15 s on 2 cores


def _metadata(wheel: Path) -> email.message.Message:
    with zipfile.ZipFile(wheel) as archive:
        (name,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        return email.parser.Parser().parsestr(archive.read(name).decode())


def test_the_license_text_is_in_the_sdist_and_the_wheel(distributions: tuple[Path, Path]) -> None:
    sdist, wheel = distributions
    license_text = (ROOT / "LICENSE").read_bytes()
    assert b"Apache License" in license_text
    assert b"Version 2.0, January 2004" in license_text
    with tarfile.open(sdist) as archive:
        (member,) = [m for m in archive.getmembers() if m.name.endswith("/LICENSE")]
        extracted = archive.extractfile(member)
        assert extracted is not None
        assert extracted.read() == license_text
        names = {m.name.split("/", 1)[1] for m in archive.getmembers() if "/" in m.name}
    # The README sends readers to docs/ by path: the sdist carries it.
    assert {"hatch_build.py", "README.md", "pyproject.toml", "docs/index.md"} <= names
    with zipfile.ZipFile(wheel) as archive:
        assert archive.read("devplugin_sdk-0.1.0.dist-info/licenses/LICENSE") == license_text


def test_the_metadata_has_what_an_index_page_shows(distributions: tuple[Path, Path]) -> None:
    metadata = _metadata(distributions[1])
    assert metadata["Version"] == devplugin_sdk.__version__
    assert metadata["License-Expression"] == "Apache-2.0"
    assert metadata["License-File"] == "LICENSE"
    assert metadata["Requires-Python"] == ">=3.10"
    classifiers = metadata.get_all("Classifier") or []
    assert "Programming Language :: Python :: 3.10" in classifiers
    assert "Typing :: Typed" in classifiers
    # No guessed project URL: the repository records no public address (see pyproject.toml).
    assert metadata.get_all("Project-URL") is None


def test_the_readme_has_no_relative_links(distributions: tuple[Path, Path]) -> None:
    """The README is the index page's description: a relative link there leads nowhere."""
    description = _metadata(distributions[1]).get_payload()
    assert isinstance(description, str)
    assert "](docs/" not in description
    assert "devplugin-sdk/devplugin-sdk" not in description
    assert "](./" not in description


def test_the_installed_wheel_runs_without_the_source_tree(
    distributions: tuple[Path, Path], tmp_path: Path
) -> None:
    """The wheel alone in a fresh venv (its dependencies borrowed from this one)."""
    venv = tmp_path / "venv"
    # --ignore-installed: the checkout's editable install, seen through the borrowed packages,
    # is not this venv's to replace.
    pip(fresh_venv(venv), "install", "--no-deps", "--ignore-installed", "-q", distributions[1])
    (site,) = (venv / "lib").glob("python3*/site-packages")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    where = subprocess.run(
        [venv / "bin" / "python", "-c", "import devplugin_sdk; print(devplugin_sdk.__file__)"],
        cwd=tmp_path, capture_output=True, text=True, timeout=60, env=env, check=True,
    )  # fmt: skip
    assert where.stdout.startswith(str(site))
    version = subprocess.run(
        [venv / "bin" / "devplugin", "--version"],
        cwd=tmp_path, capture_output=True, text=True, timeout=60, env=env, check=False,
    )  # fmt: skip
    assert version.returncode == 0, version.stderr
    assert version.stdout.strip() == f"devplugin-sdk {devplugin_sdk.__version__}"


def test_an_older_python_gets_one_clear_line(tmp_path: Path) -> None:
    """hatch_build.py, run as the build backend loads it, by a Python it pretends is 3.9."""
    code = (
        "import sys, runpy\n"
        "sys.version_info = (3, 9, 18, 'final', 0)\n"
        f"runpy.run_path({str(ROOT / 'hatch_build.py')!r})\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 1
    assert result.stderr.startswith("devplugin-sdk requires Python >= 3.10; this is Python 3.9.18")
