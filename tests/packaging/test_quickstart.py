"""The quickstart, done as a reader does it: its files and its commands, from the page itself.

docs/quickstart.md's plugin and ``acme.yaml`` are written to a working directory, and every
command of "Run it against a fake kubelet" runs through a shell with the installed ``devplugin``
script on the PATH (only the page's /tmp paths are swapped for this test's own): the fake
kubelet and the plugin as long-running processes, the others to their end. What the page says
happens is then checked on the fake kubelet's output (issue 18: the quickstart works with no
source reading).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import anyio.to_thread
import pytest
from cli_process import running
from sdk_helpers import ROOT

PAGE = ROOT / "docs" / "quickstart.md"
SECTION = "## Run it against a fake kubelet"

pytestmark = pytest.mark.timeout(60)  # the page's health poll is 10 s; processes start in ~1 s


def _section(text: str, heading: str) -> str:
    start = text.index(f"\n{heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else None]


def _blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", text, re.M | re.S)


@pytest.fixture
def places(tmp_path: Path) -> Iterator[dict[str, Path]]:
    """The page's /tmp paths, mapped to this test's (the kubelet's one short, for sockets)."""
    short = Path(tempfile.mkdtemp(prefix="dpk-qs-", dir="/tmp"))
    try:
        yield {"/tmp/kubelet": short / "kubelet", "/tmp/acme-dev": tmp_path / "acme-dev"}
    finally:
        shutil.rmtree(short, ignore_errors=True)


def _swap(text: str, places: dict[str, Path]) -> str:
    for page_path in sorted(places, key=len, reverse=True):
        text = text.replace(page_path, str(places[page_path]))
    return text


def _shell(line: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    bin_dir = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("PYTHONPATH", None)  # only what `pip install .` installed
    return subprocess.run(
        ["bash", "-c", line],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


async def test_the_quickstart_works_as_written(tmp_path: Path, places: dict[str, Path]) -> None:
    script = Path(sys.executable).with_name("devplugin")
    if not script.exists():  # pragma: no cover - ./scripts/test installs it
        pytest.skip("the devplugin script is not installed beside this Python")
    page = PAGE.read_text()
    section = _section(page, SECTION)
    work = tmp_path / "work"
    work.mkdir()
    plugin_code = re.search(
        r"<!-- docs-test: module acme_plugin -->\n```python\n(.*?)^```", page, re.M | re.S
    )
    assert plugin_code is not None
    (work / "acme_plugin.py").write_text(plugin_code.group(1))
    (config,) = _blocks(section, "yaml")
    (work / "acme.yaml").write_text(_swap(config, places))
    lines = [_swap(line, places) for block in _blocks(section, "sh") for line in block.splitlines()]
    assert [shlex.split(line)[:2] for line in lines if line.startswith("devplugin")] == [
        ["devplugin", "fake-kubelet"],
        ["devplugin", "run"],
        ["devplugin", "probe"],
    ]
    kubelet_args = shlex.split(lines[0])[1:]
    setup, plugin_line, probe_line, rm_line, *_ = lines[1:]
    assert _shell(setup, work).returncode == 0

    async with (
        running(*kubelet_args, script=str(script), cwd=work) as kubelet,
        running(*shlex.split(plugin_line)[1:], script=str(script), cwd=work) as plugin,
    ):
        await kubelet.wait_for(
            "acme.com/widget: registered (endpoint acme.com_widget.sock)", stream="stdout"
        )
        await kubelet.wait_for(
            "acme.com/widget: device list: capacity 2, allocatable 2", stream="stdout"
        )

        probe = await anyio.to_thread.run_sync(_shell, probe_line, work)
        assert probe.returncode == 0, probe.stderr
        assert "devices     capacity 2, allocatable 2" in probe.stdout
        assert "allocated   acme0" in probe.stdout
        assert "env         ACME_WIDGET=acme0" in probe.stdout
        assert _shell(rm_line, work).returncode == 0

        # Ctrl-C, then the same command again: the plugin registers again at once.
        kubelet.signal(signal.SIGINT)
        assert await kubelet.exited() == 0  # no SIGTERM on top: Ctrl-C alone ends it
        async with running(*kubelet_args, script=str(script), cwd=work) as again:
            await again.wait_for("removed 1 plugin socket(s) left from before", stream="stdout")
            await again.wait_for("acme.com/widget: registered", stream="stdout")
            # The page's rescanInterval (2 s) took acme1 out of the list.
            await again.wait_for("capacity 1, allocatable 1", stream="stdout")

            # acme.yaml is watched: a new devRoot restarts the plugin on that directory.
            elsewhere = tmp_path / "elsewhere"
            elsewhere.mkdir()
            for name in ("acme0", "acme1", "acme2"):
                (elsewhere / name).touch()
            text = (work / "acme.yaml").read_text()
            (work / "acme.yaml").write_text(
                text.replace(str(places["/tmp/acme-dev"]), str(elsewhere))
            )
            await again.wait_for(
                "acme.com/widget: device list: capacity 3, allocatable 3", stream="stdout"
            )
        assert await plugin.stop() == 0
    assert plugin.lines("reloaded (")
