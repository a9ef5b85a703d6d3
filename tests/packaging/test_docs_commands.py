"""Every command and file a reader is told to run or save, run from the Markdown as written.

README.md, docs/*.md and the examples' READMEs mark what a reader runs with an HTML comment before the fence (issue
27: the README's example did nothing on a laptop, its test snippet timed out, 5 of 17 documented
commands failed). Each page is one reader, in a fresh working directory, top to bottom:

* ``<!-- docs-test: module NAME -->`` and ``<!-- docs-test: file PATH -->``: the block is
  saved there (``NAME.py``), as the page says to save it;
* ``<!-- docs-test: sh -->``: the block runs in bash (``set -e``) and must succeed;
  ``sh install``: its venv creation and ``pip install`` steps are left out (the package is
  installed here already; ``tests/packaging`` builds and installs it) and ``.venv/bin/`` is
  this environment's; ``sh repo`` runs the same way in the clone itself (the examples' tests);
* ``<!-- docs-test: background -->``: each line starts as a long-running process (the fake
  kubelet, ``devplugin run``), stopped with Ctrl-C when the page ends;
* ``until="TEXT"`` on either: after the block, wait until a background process prints a line
  with TEXT (from the block's start on).

``<!-- docs-test: run -->`` blocks run in-process in ``test_docs.py``. What runs here runs as
a laptop would: with ``devplugin`` and ``python`` of this environment first on the PATH, no
PYTHONPATH, as an unprivileged user (``nobody`` when the suite runs as root and this Python is
open to it; otherwise as the suite's user), every ``/tmp/X``
of the page swapped for a private directory, no device of the machine and no kubelet.
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
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import pytest
from anyio.streams.text import TextReceiveStream
from sdk_helpers import ROOT

pytestmark = pytest.mark.timeout(180)

PAGES = sorted(
    [ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), *(ROOT / "examples").glob("*/README.md")]
)
_MARKED = re.compile(
    r"^<!-- docs-test: (?P<marker>[^\n]*?) -->\n```(?P<language>\w*)\n(?P<code>.*?)^```",
    re.M | re.S,
)
_UNTIL = re.compile(r'\s*until="([^"]*)"')
_TMP = re.compile(r"/tmp/[\w.-]+")
_WAIT = 45.0  # seconds: generous bounds (the quickstart's health poll is 10 s)
_NOBODY = 65534


@dataclass
class Step:
    kind: str  # file, sh, install, background
    code: str
    target: str = ""
    until: str | None = None


def steps(page: Path) -> list[Step]:
    """The page's marked blocks, in order (``run`` blocks are test_docs.py's)."""
    found: list[Step] = []
    for match in _MARKED.finditer(page.read_text()):
        marker, code = match.group("marker").strip(), match.group("code")
        until = _UNTIL.search(marker)
        words = _UNTIL.sub("", marker).split()
        text = until.group(1) if until else None
        if words[0] == "module":
            found.append(Step("file", code, f"{words[1]}.py"))
        elif words[0] == "file":
            found.append(Step("file", code, words[1]))
        elif words == ["sh"]:
            found.append(Step("sh", code, until=text))
        elif words == ["sh", "install"]:
            found.append(Step("install", code, until=text))
        elif words == ["sh", "repo"]:
            found.append(Step("repo", code, until=text))
        elif words == ["background"]:
            found.append(Step("background", code, until=text))
        elif words != ["run"]:
            raise AssertionError(f"{page.name}: unknown docs-test marker {marker!r}")
    return found


RUNNABLE = [p for p in PAGES if any(s.kind != "file" for s in steps(p))]


def without_install(code: str, bin_dir: str) -> str:
    """An install block with its venv and pip steps left out, on this environment's bin."""
    lines = []
    for line in code.splitlines():
        kept = [
            part.strip()
            for part in line.split("&&")
            if not re.search(r"-m venv |pip install", part)
        ]
        if kept:
            lines.append(" && ".join(kept).replace(".venv/bin/", f"{bin_dir}/"))
    return "\n".join(lines) + "\n"


@dataclass
class Output:
    """What the background processes printed, for ``until``."""

    lines: list[str] = field(default_factory=list)
    changed: anyio.Event = field(default_factory=anyio.Event)

    async def collect(self, stream: anyio.abc.ByteReceiveStream, name: str) -> None:
        buffer = ""
        async for chunk in TextReceiveStream(stream, errors="replace"):
            buffer += chunk
            *done, buffer = buffer.split("\n")
            self.lines.extend(f"{name}: {line}" for line in done)
            self.changed.set()
            self.changed = anyio.Event()

    async def wait_for(self, text: str, since: int, what: str) -> None:
        """Wait for a line with ``text`` among those from the ``since``-th on."""
        with anyio.move_on_after(_WAIT):
            while True:
                changed = self.changed
                if any(text in line for line in self.lines[since:]):
                    return
                await changed.wait()
        shown = "\n".join(self.lines[-40:])
        # AssertionError, not pytest.fail: its BaseException would end anyio's test runner.
        raise AssertionError(f"{what}: no line with {text!r} in {_WAIT:.0f} s; last:\n{shown}")


@dataclass
class Reader:
    """One reader of a page: a working directory, a shell, the processes left running."""

    work: Path
    env: dict[str, str]
    places: dict[str, Path]
    user: dict[str, Any]
    output: Output = field(default_factory=Output)
    processes: list[anyio.abc.Process] = field(default_factory=list)

    def swap(self, text: str) -> str:
        return _TMP.sub(lambda m: str(self._place(m.group(0))), text)

    def _place(self, page_path: str) -> Path:
        if page_path not in self.places:
            self.places[page_path] = self.places["/tmp"] / page_path.removeprefix("/tmp/")
        return self.places[page_path]

    async def shell(
        self, code: str, what: str, cwd: Path | None = None, *, bin_dir: str | None = None
    ) -> None:
        # The page's /tmp paths are swapped first: this environment's own paths (a clone under
        # /tmp, as CI's may be) must stay as they are.
        swapped = self.swap(code)
        if bin_dir is not None:
            swapped = without_install(swapped, bin_dir)
        script = f"set -e\n{swapped}"
        # In the clone (``sh repo``) as the suite's user: the checkout is not nobody's.
        user = self.user if cwd is None else {}
        with anyio.fail_after(120):
            result = await anyio.run_process(
                ["bash", "-c", script], cwd=cwd or self.work, env=self.env, check=False, **user
            )
        out = result.stdout.decode(errors="replace") + result.stderr.decode(errors="replace")
        assert result.returncode == 0, f"{what} exited {result.returncode}:\n{code}\n{out[-6000:]}"

    async def background(self, tg: anyio.abc.TaskGroup, code: str) -> None:
        for line in self.swap(code).splitlines():
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            process = await anyio.open_process(
                ["bash", "-c", f"exec {line}"], cwd=self.work, env=self.env, **self.user
            )
            self.processes.append(process)
            name = shlex.split(line)[:2][-1]
            assert process.stdout is not None
            assert process.stderr is not None
            tg.start_soon(self.output.collect, process.stdout, name)
            tg.start_soon(self.output.collect, process.stderr, name)

    async def stop(self) -> None:
        """Ctrl-C for each process left running, as the reader does; kill after a bound."""
        with anyio.CancelScope(shield=True):
            for process in reversed(self.processes):
                if process.returncode is None:
                    process.send_signal(signal.SIGINT)
                with anyio.move_on_after(15):
                    await process.wait()
                if process.returncode is None:
                    process.kill()
                    await process.wait()


def _runs_as_nobody() -> bool:
    """Whether this environment's Python starts for ``nobody`` (not where it lives under a
    0700 home, e.g. pyenv's /root/.pyenv: then the commands run as this user, still without
    any path that needs root)."""
    try:
        result = subprocess.run(
            [sys.executable, "-c", "import devplugin_sdk"],
            user=_NOBODY,
            group=_NOBODY,
            extra_groups=[],
            cwd="/",
            capture_output=True,
            timeout=60,
            check=False,
        )
    except PermissionError:
        return False
    return result.returncode == 0


@pytest.fixture
def laptop() -> Iterator[tuple[Path, Path, dict[str, Any]]]:
    """A working directory and a short private /tmp stand-in, owned by the user who runs the
    commands (``nobody`` when the suite runs as root: no privilege a laptop user lacks)."""
    work = Path(tempfile.mkdtemp(prefix="dpk-doc-"))
    short = Path(tempfile.mkdtemp(prefix="dpk-d-", dir="/tmp"))  # sockets: 107 bytes at most
    user: dict[str, Any] = {}
    if os.geteuid() == 0 and _runs_as_nobody():
        for path in (work, short):
            os.chown(path, _NOBODY, _NOBODY)
        user = {"user": _NOBODY, "group": _NOBODY, "extra_groups": []}
    try:
        yield work, short, user
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(short, ignore_errors=True)


@asynccontextmanager
async def reading(
    laptop: tuple[Path, Path, dict[str, Any]],
) -> AsyncIterator[tuple[Reader, anyio.abc.TaskGroup]]:
    work, short, user = laptop
    bin_dir = str(Path(sys.executable).parent)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTEST_ADDOPTS")}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    if user:
        env["HOME"] = str(work)
    reader = Reader(work, env, {"/tmp": short}, user)
    async with anyio.create_task_group() as tg:
        try:
            yield reader, tg
        finally:
            await reader.stop()


@pytest.mark.parametrize("page", RUNNABLE, ids=lambda p: str(p.relative_to(ROOT)))
async def test_the_page_runs_as_written(
    page: Path, laptop: tuple[Path, Path, dict[str, Any]]
) -> None:
    bin_dir = str(Path(sys.executable).parent)
    async with reading(laptop) as (reader, tg):
        for number, step in enumerate(steps(page), 1):
            what = f"{page.name}, marked block {number} ({step.kind})"
            since = len(reader.output.lines)
            if step.kind == "file":
                target = reader.work / step.target
                target.write_text(reader.swap(step.code))
                if reader.user:
                    os.chown(target, _NOBODY, _NOBODY)
            elif step.kind == "sh":
                await reader.shell(step.code, what)
            elif step.kind == "install":
                await reader.shell(step.code, what, bin_dir=bin_dir)
            elif step.kind == "repo":
                await reader.shell(step.code, what, cwd=ROOT, bin_dir=bin_dir)
            else:
                await reader.background(tg, step.code)
            if step.until is not None:
                await reader.output.wait_for(step.until, since, what)
        tg.cancel_scope.cancel()


def test_the_readme_and_the_quickstart_show_one_program_and_one_test() -> None:
    def block(page: Path, marker: str) -> str:
        (code,) = [s.code for s in steps(page) if s.kind == "file" and s.target == marker]
        return code

    readme, quickstart = ROOT / "README.md", ROOT / "docs" / "quickstart.md"
    for name in ("acme_plugin.py", "test_acme_plugin.py", "acme.yaml"):
        assert block(readme, name) == block(quickstart, name), name
    assert len(block(readme, "acme_plugin.py").splitlines()) <= 30


def test_the_marker_parser_reads_every_kind() -> None:
    page = (
        '<!-- docs-test: background until="up" -->\n```sh\nserve\n```\n'
        "<!-- docs-test: file a.yaml -->\n```yaml\nx: 1\n```\n"
        "<!-- docs-test: sh install -->\n```sh\npython3 -m venv .venv && .venv/bin/pip install . "
        "&& .venv/bin/devplugin demo\n```\n"
    )
    with tempfile.NamedTemporaryFile("w", suffix=".md") as handle:
        handle.write(page)
        handle.flush()
        found = steps(Path(handle.name))
    assert [(s.kind, s.target, s.until) for s in found] == [
        ("background", "", "up"),
        ("file", "a.yaml", None),
        ("install", "", None),
    ]
    assert without_install(found[2].code, "/venv/bin") == "/venv/bin/devplugin demo\n"
