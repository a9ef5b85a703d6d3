"""The documentation: links and anchors resolve, code runs, references match the code.

Link checking needs no MkDocs: relative links in docs/ and README.md must name an existing file
and, with ``#anchor``, a heading of it, slugged both as MkDocs (Python-Markdown's toc) and GitHub
do. When mkdocs and mkdocs-material are installed, ``mkdocs build --strict`` runs as well.
Python blocks compile; blocks marked ``<!-- docs-test: run -->`` run (their ``test_*`` coroutines
too), and ``<!-- docs-test: module NAME -->`` blocks become importable modules for later blocks.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib.util
import inspect
import json
import os
import re
import subprocess
import sys
import types
import unicodedata
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from sdk_helpers import ROOT, sdk_modules

from devplugin_sdk import Device, Health, Settings, cli
from devplugin_sdk.backends import fpga, generic, nvidia, rdma
from devplugin_sdk.errors import ConfigError
from devplugin_sdk.testing import FakeKubelet, serving

DOCS = ROOT / "docs"
PAGES = sorted(DOCS.rglob("*.md"))
MARKDOWN = [*PAGES, ROOT / "README.md"]
# Signature listings, not runnable code.
SIGNATURES_ONLY = {DOCS / "api.md"}

_FENCE = re.compile(r"^(```|~~~)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_INLINE_LINK = re.compile(
    r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)"
)
_REFERENCE_LINK = re.compile(r"^\s{0,3}\[[^\]]+\]:\s+<?(\S+?)>?(?:\s+.*)?$")
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+\1")
_BLOCK = re.compile(r"(?:<!-- docs-test: (run|module \w+) -->\n)?```(\w*)\n(.*?)^```", re.M | re.S)


# ----------------------------------------------------------------------------- parsing


def prose_lines(text: str) -> Iterator[tuple[int, str]]:
    """Lines outside fenced code blocks, with their numbers."""
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        if not fenced:
            yield number, line


def heading_text(raw: str) -> str:
    """A heading as rendered text: code spans unwrapped, links reduced to their text."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", raw)
    return re.sub(r"(`+)(.*?)\1", r"\2", text)


def mkdocs_slug(text: str) -> str:
    # Python-Markdown's toc.slugify (the MkDocs default).
    value = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    value = re.sub(r"[^\w\s-]", "", value).strip().lower()
    return re.sub(r"[-\s]+", "-", value)


def github_slug(text: str) -> str:
    # GitHub: lower case, drop punctuation except '-' and '_', each space becomes '-'.
    value = re.sub(r"[^\w\- ]", "", text.lower())
    return value.replace(" ", "-")


def anchors(path: Path) -> tuple[set[str], set[str]]:
    """The heading anchors of a file: (MkDocs', GitHub's), with each one's suffix for repeats."""
    mk: dict[str, int] = {}
    gh: dict[str, int] = {}
    out_mk: set[str] = set()
    out_gh: set[str] = set()
    for _, line in prose_lines(path.read_text()):
        match = _HEADING.match(line)
        if not match:
            continue
        text = heading_text(match.group(2))
        for slug, seen, out, sep in (
            (mkdocs_slug(text), mk, out_mk, "_"),
            (github_slug(text), gh, out_gh, "-"),
        ):
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}{sep}{n}")
    return out_mk, out_gh


def links(path: Path) -> Iterator[tuple[int, str]]:
    for number, line in prose_lines(path.read_text()):
        prose = _CODE_SPAN.sub("", line)
        for match in _INLINE_LINK.finditer(prose):
            yield number, match.group(1)
        ref = _REFERENCE_LINK.match(prose)
        if ref:
            yield number, ref.group(1)


def blocks(path: Path) -> list[tuple[str | None, str, str]]:
    """Fenced blocks as (marker, language, code)."""
    return [(m.group(1), m.group(2), m.group(3)) for m in _BLOCK.finditer(path.read_text())]


def section(text: str, heading: str) -> str:
    """The text under ``heading`` up to the next heading of the same or a higher level."""
    level = len(heading) - len(heading.lstrip("#"))
    start = text.index(f"\n{heading}\n")
    ends = [
        m.start()
        for m in re.finditer(rf"^#{{1,{level}}} ", text[start + 1 :], re.M)
        if m.start() > 0
    ]
    return text[start : start + 1 + ends[0]] if ends else text[start:]


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


# ----------------------------------------------------------------------------- links


@pytest.mark.parametrize("page", MARKDOWN, ids=_rel)
def test_relative_links_resolve_to_files_and_headings(page: Path) -> None:
    problems: list[str] = []
    for number, target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        where = f"{_rel(page)}:{number}: {target}"
        file_part, _, anchor = target.partition("#")
        dest = (page.parent / file_part).resolve() if file_part else page
        if page.is_relative_to(DOCS) and not dest.is_relative_to(DOCS):
            problems.append(f"{where}: leaves docs/ (MkDocs cannot follow it); name the path")
            continue
        if not dest.is_file():
            problems.append(f"{where}: no such file")
            continue
        if anchor:
            mk, gh = anchors(dest)
            in_site = dest.is_relative_to(DOCS)
            if anchor not in gh or (in_site and anchor not in mk):
                problems.append(f"{where}: no heading with that anchor in {_rel(dest)}")
    assert not problems, "\n".join(problems)


def test_the_link_checker_finds_broken_links(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "# Title\n\n## The 4 MiB limit\n\n[ok](#the-4-mib-limit) [bad](#nope) "
        "[gone](other.md) `[code](x.md)`\n\n```md\n[fenced](y.md)\n```\n"
    )
    assert [t for _, t in links(page)] == ["#the-4-mib-limit", "#nope", "other.md"]
    mk, gh = anchors(page)
    assert "the-4-mib-limit" in mk & gh
    assert "nope" not in mk | gh


def test_slugs_match_mkdocs_and_github() -> None:
    assert mkdocs_slug("`devplugin probe` and `devplugin conformance`") == (
        "devplugin-probe-and-devplugin-conformance"
    )
    assert mkdocs_slug("generic: device files") == github_slug("generic: device files")
    # Where they differ, a link must satisfy both: avoid such headings.
    assert mkdocs_slug("a - b") == "a-b" != github_slug("a - b") == "a---b"


def test_every_page_is_in_the_site_navigation() -> None:
    config = (ROOT / "mkdocs.yml").read_text()
    nav = set(re.findall(r"^\s+- [^:]+: (\S+\.md)\s*$", config, re.M))
    on_disk = {str(p.relative_to(DOCS)) for p in PAGES}
    assert nav == on_disk, f"in nav only: {nav - on_disk}; on disk only: {on_disk - nav}"


@pytest.mark.skipif(
    importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None,
    reason="mkdocs and mkdocs-material are not installed",
)
def test_site_builds_with_strict_link_checks(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-4000:]


# ----------------------------------------------------------------------------- code


@pytest.mark.parametrize("page", [p for p in MARKDOWN if p not in SIGNATURES_ONLY], ids=_rel)
def test_python_blocks_compile(page: Path) -> None:
    for _, language, code in blocks(page):
        if language == "python":
            # Snippets may await at top level, as in an async test or a REPL.
            compile(code, str(page), "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)


def load_module(name: str, code: str, monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    module = types.ModuleType(name)
    monkeypatch.setitem(sys.modules, name, module)
    exec(compile(code, f"<docs {name}>", "exec"), module.__dict__)
    return module


async def run_blocks(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Run the page's marked blocks in order; return the last run block's namespace."""
    namespace: dict[str, Any] = {}
    for marker, _, code in blocks(page):
        if marker is None:
            continue
        if marker.startswith("module "):
            load_module(marker.split()[1], code, monkeypatch)
            continue
        namespace = {"__name__": "docs_snippet"}
        exec(compile(code, str(page), "exec"), namespace)
        for name, value in list(namespace.items()):
            if name.startswith("test_") and inspect.iscoroutinefunction(value):
                params = inspect.signature(value).parameters
                await value(**({"tmp_path": tmp_path} if "tmp_path" in params else {}))
    return namespace


RUNNABLE = [p for p in PAGES if "<!-- docs-test: " in p.read_text()]


@pytest.mark.parametrize("page", RUNNABLE, ids=_rel)
async def test_marked_blocks_run(
    page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    await run_blocks(page, tmp_path, monkeypatch)


def test_quickstart_plugin_is_at_most_30_lines() -> None:
    code = next(c for m, _, c in blocks(DOCS / "quickstart.md") if m == "module acme_plugin")
    assert len(code.splitlines()) <= 30


async def test_cdi_page_shows_the_json_its_example_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    page = DOCS / "cdi.md"
    namespace = await run_blocks(page, tmp_path, monkeypatch)
    shown = next(code for _, language, code in blocks(page) if language == "json")
    assert json.loads(shown) == namespace["spec"].to_dict()


def acme_tree(root: Path) -> tuple[Path, Path]:
    sysfs, dev = root / "sys", root / "dev"
    dev.mkdir()
    for name, numa, state in (("acme0", "0", "ok"), ("acme1", "1", "ok"), ("acme2", "0", "fault")):
        entry = sysfs / "class" / "acme" / name
        (entry / "device").mkdir(parents=True)
        (entry / "device" / "numa_node").write_text(f"{numa}\n")
        (entry / "state").write_text(f"{state}\n")
        (dev / name).touch()
    return sysfs, dev


async def test_writing_a_backend_example_serves_a_fake_host(
    kubelet: FakeKubelet, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    code = next(c for m, _, c in blocks(DOCS / "writing-a-backend.md") if m == "module acme")
    acme = load_module("acme", code, monkeypatch)
    sysfs, dev = acme_tree(tmp_path)
    with pytest.raises(ConfigError, match="healthInterval: must be > 0"):
        acme.AcmePlugin.from_config({"healthInterval": 0})
    with pytest.raises(ConfigError, match="colour: unknown key"):
        acme.AcmePlugin.from_config({"colour": "red"})
    with pytest.raises(ConfigError, match="sysfsRoot: must be an absolute path"):
        acme.AcmePlugin.from_config({"sysfsRoot": "sys"})
    config = {"healthInterval": 0.2, "sysfsRoot": str(sysfs), "devRoot": str(dev)}
    (plugin,) = acme.AcmePlugin.from_config(config)
    resource = "acme.com/widget"
    async with serving(plugin, settings=kubelet.settings()):
        await kubelet.wait_for_allocatable(resource, 2)
        assert kubelet.devices(resource)["acme1"].numa_nodes == (1,)
        assert kubelet.devices(resource)["acme2"].health == "Unhealthy"
        got = await kubelet.allocate(resource, 2)
        assert got.allocation.env == {"ACME_VISIBLE_DEVICES": ",".join(got.device_ids)}
        (dev / "acme1").unlink()  # a rescan through fswatch, at once
        await kubelet.wait_for_health(resource, "acme1", "Unhealthy")
        # Discovered Unhealthy is only the first report: the fault clears, the widget is back.
        (sysfs / "class" / "acme" / "acme2" / "state").write_text("ok\n")
        await kubelet.wait_for_health(resource, "acme2", "Healthy")
        # One unreadable widget is that widget's fault only.
        (sysfs / "class" / "acme" / "acme0" / "state").unlink()
        await kubelet.wait_for_health(resource, "acme0", "Unhealthy")
        assert kubelet.devices(resource)["acme2"].health == "Healthy"


# ----------------------------------------------------------------------------- references


def test_configuration_reference_lists_every_cli_option_and_setting() -> None:
    text = (DOCS / "configuration.md").read_text()
    parser = cli.build_parser()
    options = {o for a in parser._actions for o in a.option_strings if o.startswith("--")}
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name in ("run", "demo"):
        sub = subparsers.choices[name]
        options |= {o for a in sub._actions for o in a.option_strings if o.startswith("--")}
    options.discard("--help")
    missing = sorted(o for o in options if f"`{o}" not in text)
    assert not missing, f"configuration.md does not describe {missing}"
    settings_table = section(text, "## `Settings`")
    fields = [f.name for f in dataclasses.fields(Settings)]
    assert [f for f in fields if f"| `{f}` |" not in settings_table] == []


def expected_keys(
    load: Callable[[Mapping[str, Any]], object], config: Mapping[str, Any]
) -> list[str]:
    """The keys a backend accepts at one level, from its unknown-key error message."""
    with pytest.raises(ConfigError) as caught:
        load(config)
    listed = re.search(r"expected one of:? (.*)$", str(caught.value))
    assert listed is not None, str(caught.value)
    return listed.group(1).split(", ")


@pytest.mark.parametrize(
    ("heading", "load", "configs"),
    [
        ("### generic", generic.from_config, [{"x": 1}, {"resources": [{"x": 1}]}]),
        (
            "### nvidia",
            nvidia.NvidiaConfig.from_mapping,
            [
                {"x": 1},
                {"health": {"x": 1}},
                {"sharing": {"x": 1}},
                {"sharing": {"timeSlicing": {"x": 1}}},
                {"sharing": {"memory": {"x": 1}}},
                {"sharing": {"memory": {"interceptor": {"x": 1}}}},
                {"sharing": {"vgpu": {"x": 1}}},
            ],
        ),
        ("### fpga", fpga.FpgaConfig.from_mapping, [{"x": 1}]),
        (
            "### rdma",
            rdma.load_config,
            [
                {"x": 1},
                {"resources": [{"x": 1}]},
                {"resources": [{"resourceName": "rdma/x", "selectors": {"x": []}}]},
            ],
        ),
    ],
    ids=["generic", "nvidia", "fpga", "rdma"],
)
def test_configuration_reference_lists_every_backend_key(
    heading: str, load: Callable[[Mapping[str, Any]], object], configs: list[dict[str, Any]]
) -> None:
    text = section((DOCS / "configuration.md").read_text(), heading)
    keys = {k for config in configs for k in expected_keys(load, config)}
    undocumented = sorted(k for k in keys if not re.search(rf"`[^`\n]*\b{k}\b[^`\n]*`", text))
    assert not undocumented, f"{heading}: {undocumented}"


# Packages whose own modules the rooms table names by the package alone: the generated code, the
# built-in backends, the kubelet side's fakes and tools, the test kit's fake hardware.
BY_PACKAGE = {
    "api",
    "backends.fpga",
    "backends.generic",
    "backends.nvidia",
    "backends.rdma",
    "kubelet.conformance",
    "kubelet.fake",
    "kubelet.probe",
    "testing.fake_nvml",
    "testing.fpga_trees",
}


def _dotted(span: str) -> str:
    """``dra/_claims/`` or ``runner.py`` as a name below the package: ``dra._claims``, ``runner``."""
    return span.removesuffix("/").removesuffix(".py").replace("/", ".")


def rooms_table() -> list[tuple[str, set[str], list[str]]]:
    """(first cell, rooms, code spans of "what it holds") per row of concepts.md's rooms table.

    A row's rooms are the modules and packages its first cell names (`dra/_claims/`,
    `runner.py`); a row named in words ("options", "core") holds the top-level ones its second
    cell names."""
    text = section((DOCS / "concepts.md").read_text(), "## The rooms")
    top = {m.split(".")[1] for m in sdk_modules() if m != "devplugin_sdk"}
    rows = []
    for line in text.splitlines():
        if not line.startswith("| ") or line.startswith(("| room ", "|---")):
            continue
        first, holds = (cell.strip() for cell in line.strip("|").split("|")[:2])
        spans = re.findall(r"`([^`]+)`", holds)
        rooms = {_dotted(s) for s in re.findall(r"`([^`]+)`", first)}
        rooms = rooms or {_dotted(s) for s in spans if _dotted(s) in top}
        rows.append((first, rooms, spans))
    return rows


def _named(rel: str, room: str, spans: list[str]) -> bool:
    """Whether a row of ``room`` names the module ``rel`` (below the package)."""
    if rel == room or room in BY_PACKAGE:
        return True
    parts = rel[len(room) + 1 :].split(".")
    for depth, part in enumerate(parts, 1):
        package = ".".join((room, *parts[:depth]))
        if depth < len(parts) and f"{part}/" in spans and package in BY_PACKAGE:
            return True
        if part not in spans and f"{part}/" not in spans:
            return False
    return True


def test_the_rooms_table_names_every_module_and_package() -> None:
    rows = rooms_table()
    problems = []
    for module in sdk_modules():
        if module == "devplugin_sdk":
            continue
        rel = module.removeprefix("devplugin_sdk.")
        holding = [
            (room, row)
            for row in rows
            for room in row[1]
            if rel == room or rel.startswith(f"{room}.")
        ]
        if not holding:
            problems.append(f"`{module}`: in no row; add `{rel}` to the row of its layer")
            continue
        room, (first, _, spans) = max(holding, key=lambda held: len(held[0]))
        if not _named(rel, room, spans):
            parts = rel[len(room) + 1 :].split(".")
            names = ", ".join(f"`{p}/`" for p in parts[:-1]) + (", " if parts[1:] else "")
            own = f", or give `{'/'.join(rel.split('.')[:-1])}/` a row" if parts[1:] else ""
            problems.append(f"`{module}`: name {names}`{parts[-1]}` in the row of {first}{own}")
    assert not problems, "docs/concepts.md's rooms table misses:\n" + "\n".join(problems)


def test_the_rooms_table_names_nothing_that_is_gone() -> None:
    """Every room exists, and each lower-case name in "what it holds" is a module below the row's
    rooms or something one of them defines (`serving`, `load_yaml`)."""
    modules = {m.removeprefix("devplugin_sdk.") for m in sdk_modules()}
    stale = []
    for first, rooms, spans in rooms_table():
        stale += [f"{first}: no module {room}" for room in rooms if room not in modules]
        for span in spans:
            if not re.fullmatch(r"[a-z_][a-z0-9_]*/?", span):
                continue
            name = span.removesuffix("/")
            below = any(
                m.startswith(f"{r}.") and m.endswith(f".{name}") for r in rooms for m in modules
            )
            defined = any(
                hasattr(importlib.import_module(f"devplugin_sdk.{r}"), name)
                for r in rooms
                if r in modules
            )
            if not (below or defined or name in rooms):
                stale.append(
                    f"{first}: `{span}` names no module below the row's rooms, nor anything they define"
                )
    assert not stale, "docs/concepts.md's rooms table names what is gone:\n" + "\n".join(stale)


def test_health_strings_in_the_docs_are_the_kubelets() -> None:
    # Pages quote the exact strings; a typo here would mislead people grepping logs.
    for page in PAGES:
        for word in re.findall(r'"(Healthy|Unhealthy|healthy|unhealthy)"', page.read_text()):
            assert word in {h.value for h in Health}, f"{page.name}: {word!r}"
    assert Device("x").health.value == "Healthy"
