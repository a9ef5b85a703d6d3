"""The example images, built and started as Docker would, offline and without a container engine.

CI machines have no docker, podman or buildah. Each stage of an ``examples/*/Dockerfile`` (read by
tests/dockerfile.py) is carried out here, with the repository as the build context, in a
directory that stands for the stage's ``/``:

- ``FROM python:...`` is a fresh venv at ``<root>/usr/local``, the base image's Python (this
  machine's version, not the tag's); it borrows this venv's packages for what pip would download
  (tests/packaging_helpers.py).
- COPY copies exactly what it names, as Docker does, and fails on a source the context lacks.
- RUN knows the commands the Dockerfiles use, joined by ``&&``: ``pip wheel`` (offline:
  ``--no-build-isolation --no-deps --no-index``), ``pip install`` and ``rm -rf``. It refuses
  anything else by name.
- The image then starts as a pod would run it: ENTRYPOINT with CMD's arguments and ENV, its paths
  mapped into its root, against a FakeKubelet, until a resource registers and lists its devices.

The process is not chrooted: host paths that its config names (/sys, /dev, /host/...) are this
machine's, as a DaemonSet's hostPath mounts would be, and the plugins serve what they find there
(often nothing, on CI). The NVIDIA image gets NVML from the NVIDIA container runtime (its ENV asks
for it); here the SDK's fake NVML stands in, run from the image's own wheel.
"""

from __future__ import annotations

import glob
import hashlib
import os
import posixpath
import re
import shlex
import shutil
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import dockerfile
import pytest
from cli_process import running
from packaging_helpers import ROOT, fresh_venv, pip

from devplugin_sdk.testing import FakeKubelet

pytestmark = pytest.mark.timeout(60)  # 4 images, 5 broken ones, the guide's: 15 to 20 s on 2 cores

IMAGES = sorted(ROOT.glob("examples/*/Dockerfile"))
# `pip wheel` offline: this venv's hatchling instead of a downloaded one, no dependencies.
OFFLINE = ("--no-build-isolation", "--no-deps", "--no-index")
# The NVIDIA container runtime mounts the host's NVML when a container sets this; the fake
# machine the image gets instead.
NVIDIA_RUNTIME = "NVIDIA_VISIBLE_DEVICES"
FAKE_MACHINE = "t4_pcie"


class StepFailed(Exception):
    """A RUN step exited with an error."""

    def __init__(self, instruction: dockerfile.Instruction, output: str) -> None:
        super().__init__(f"Dockerfile line {instruction.line}: RUN {instruction.text}\n{output}")
        self.instruction = instruction


@dataclass
class Built:
    """A stage carried out: its root, its Python, and what it keeps for the start."""

    root: Path
    python: Path
    workdir: str = "/"
    env: dict[str, str] = field(default_factory=dict)
    entrypoint: list[str] = field(default_factory=list)
    cmd: list[str] = field(default_factory=list)
    # Each wheel `pip install` was given: {member: sha256} (RUN removes the files afterwards).
    installed: dict[str, dict[str, str]] = field(default_factory=dict)

    def path(self, name: str) -> Path:
        """Where the image's ``name`` (relative to WORKDIR) is under the root."""
        absolute = posixpath.normpath(posixpath.join(self.workdir, name))  # "/.." is "/"
        return self.root / absolute.lstrip("/")

    def mapped(self, value: str) -> str:
        """``value``, ``--flag=value`` or ``a:b`` with each absolute path mapped into the root."""
        flag, equals, rest = value.partition("=") if value.startswith("--") else ("", "", value)
        items = [str(self.path(i)) if i.startswith("/") else i for i in rest.split(os.pathsep)]
        return flag + equals + os.pathsep.join(items)


def build(text: str, where: Path) -> list[Built]:
    """Carry out every stage of the Dockerfile ``text`` under ``where``; the last is the image."""
    # Docker would filter the context through it; this builder does not know how.
    assert not (ROOT / ".dockerignore").exists(), (
        "teach tests/packaging/test_images.py .dockerignore"
    )
    stages = dockerfile.parse(text)
    built: list[Built] = []
    for index, stage in enumerate(stages):
        if not stage.image.startswith("python:"):
            raise dockerfile.DockerfileError(stage.line, f"no stand-in for {stage.image}")
        root = where / f"stage-{index}"
        current = Built(root, fresh_venv(root / "usr" / "local"))
        for instruction in stage.instructions:
            if instruction.keyword == "WORKDIR":
                current.workdir = posixpath.normpath(posixpath.join("/", instruction.text))
                current.path(".").mkdir(parents=True, exist_ok=True)
            elif instruction.keyword == "COPY":
                _copy(instruction, current, stages, built)
            elif instruction.keyword == "RUN":
                _run(instruction, current)
            elif instruction.keyword == "ENV":
                current.env.update(dockerfile.env_arguments(instruction))
            elif instruction.keyword == "ENTRYPOINT":
                current.entrypoint = instruction.words()
            else:
                current.cmd = instruction.words()
        built.append(current)
    return built


def _copy(
    instruction: dockerfile.Instruction,
    stage: Built,
    stages: list[dockerfile.Stage],
    built: list[Built],
) -> None:
    copy = dockerfile.copy_arguments(instruction)
    if copy.from_stage is None:
        base, origin = ROOT, "the repository"
    else:
        base = built[dockerfile.stage_index(stages, copy.from_stage, len(built))].root
        origin = f"stage {copy.from_stage}"
    destination = stage.path(copy.destination)
    for source in copy.sources:
        relative = posixpath.normpath(source.lstrip("/"))
        if relative.startswith(".."):
            raise instruction.fail(f"{source} is outside the build context")
        found = sorted(base.glob(relative)) if set("*?[") & set(relative) else [base / relative]
        found = [f for f in found if f.exists()]
        if not found:
            raise instruction.fail(f"{source} is not in {origin}")
        for path in found:
            if path.is_dir():  # its contents, not the directory itself
                shutil.copytree(path, destination, symlinks=True, dirs_exist_ok=True)
                continue
            into = copy.destination.endswith("/") or destination.is_dir()
            target = destination / path.name if into else destination
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, target)


def _run(instruction: dockerfile.Instruction, stage: Built) -> None:
    workdir = stage.path(".")
    for words in _commands(instruction, stage):
        command, arguments = words[:2], words[2:]
        if command == ["pip", "wheel"]:
            result = pip(stage.python, "wheel", *OFFLINE, *arguments, cwd=workdir, check=False)
        elif command == ["pip", "install"]:
            for wheel in (workdir / w for w in arguments if w.endswith(".whl")):
                stage.installed[wheel.name] = _digests(wheel)
            # --ignore-installed: the checkout's editable install, seen through the borrowed
            # packages, is not in the base image.
            flags = ("--no-deps", "--no-index", "--ignore-installed")
            result = pip(stage.python, "install", *flags, *arguments, cwd=workdir, check=False)
        elif command == ["rm", "-rf"]:
            for name in arguments:
                path = workdir / name
                assert path.is_relative_to(stage.root), path
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path)
                else:
                    path.unlink(missing_ok=True)
            continue
        else:
            raise instruction.fail(
                f"tests/packaging/test_images.py does not know how to run {words}"
            )
        if result.returncode != 0:
            raise StepFailed(instruction, result.stdout + result.stderr)


def _commands(instruction: dockerfile.Instruction, stage: Built) -> Iterator[list[str]]:
    """The commands of a RUN, image paths mapped into the root; the shell's ``&&`` and globs."""
    exec_form = instruction.exec_form
    if exec_form is not None:
        yield [stage.mapped(w) for w in exec_form]
        return
    for part in instruction.text.split("&&"):
        if set(part) & set(";|&<>$`(){}\\\n"):
            raise instruction.fail(f"the shell syntax of {part.strip()!r} is not understood")
        tokens = part.split()
        if len(shlex.split(part)) != len(tokens):
            raise instruction.fail(f"quoted spaces in {part.strip()!r} are not understood")
        words: list[str] = []
        for token in tokens:
            [word] = shlex.split(token)
            word = stage.mapped(word)
            quoted = token[0] in "'\""
            pattern = not quoted and set("*?[") & set(word)
            matches = sorted(glob.glob(word, root_dir=stage.path("."))) if pattern else []
            words.extend(matches or [word])  # sh leaves a pattern that matches nothing as it is
        yield words


def _digests(wheel: Path) -> dict[str, str]:
    with zipfile.ZipFile(wheel) as archive:
        return {n: hashlib.sha256(archive.read(n)).hexdigest() for n in archive.namelist()}


def problems(text: str, where: Path, wheel: Path) -> list[str]:
    """What building the Dockerfile ``text`` under ``where`` and comparing the wheel it installs
    with ``wheel`` find wrong: []."""
    try:
        *_, final = build(text, where)
    except StepFailed as failed:
        return [str(failed)]
    return differences(final, wheel)


def differences(image: Built, wheel: Path) -> list[str]:
    """How the wheels the image installed differ from ``wheel`` (the repository's): []."""
    if list(image.installed) != [wheel.name]:
        return [f"installed {sorted(image.installed)}, not {wheel.name}"]
    theirs, ours = image.installed[wheel.name], _digests(wheel)
    return [
        f"{name}: {'missing' if name not in theirs else 'extra' if name not in ours else 'differs'}"
        for name in sorted(theirs.keys() | ours.keys())
        if theirs.get(name) != ours.get(name)
    ]


def start_command(image: Built, kubelet_directory: Path) -> tuple[list[str], dict[str, str]]:
    """ENTRYPOINT + CMD and ENV as the container would get them: the image's paths mapped into
    its root, the metrics on any free port of 127.0.0.1, and the kubelet's directory (which the
    DaemonSet mounts) the FakeKubelet's."""
    assert image.entrypoint[:2] != ["/bin/sh", "-c"], "a shell-form ENTRYPOINT ignores CMD"
    program, *args = [*image.entrypoint, *image.cmd]
    bin_directory = image.path("/usr/local/bin")  # first on the python images' PATH
    found = shutil.which(program, path=str(bin_directory))
    assert found is not None, f"{program} is not in the image's /usr/local/bin"
    command = [found]
    if NVIDIA_RUNTIME in image.env:
        assert program == "devplugin", program  # the fake NVML's runner stands in for it only
        runner = "devplugin_sdk.testing.fake_nvml"
        command = [str(image.python), "-m", runner, "--machine", FAKE_MACHINE, "--"]
    arguments = [image.mapped(a) for a in args]
    for index, argument in enumerate(arguments):
        if argument == "--metrics-port":
            arguments[index + 1] = "0"
        elif argument.startswith("--metrics-port="):
            arguments[index] = "--metrics-port=0"
    arguments += ["--metrics-host", "127.0.0.1", "--device-plugin-dir", str(kubelet_directory)]
    arguments += ["--registration", "kubelet"]
    env = {k: image.mapped(v) for k, v in image.env.items()}
    env["PATH"] = f"{bin_directory}{os.pathsep}{os.environ['PATH']}"
    return [*command, *arguments], env


# ----------------------------------------------------------------------------- the images


@pytest.fixture(scope="module", params=IMAGES, ids=lambda path: path.parent.name)
def image(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Built:
    dockerfile_path: Path = request.param
    where = tmp_path_factory.mktemp(dockerfile_path.parent.name)
    *_, final = build(dockerfile_path.read_text(encoding="utf-8"), where)
    return final


def test_the_image_installs_the_wheel_the_repository_builds(
    image: Built, distributions: tuple[Path, Path]
) -> None:
    """Every file of it (the license too), byte for byte."""
    assert differences(image, distributions[1]) == []


async def test_the_image_starts_and_registers_with_the_kubelet(image: Built) -> None:
    async with FakeKubelet() as kubelet:
        [program, *args], env = start_command(image, kubelet.directory)
        async with running(*args, script=program, cwd=image.path("."), env=env) as plugin:

            def listing() -> bool:
                return any(
                    r.error is None and kubelet.messages(r.resource_name) > 0
                    for r in kubelet.registrations
                )

            try:
                await kubelet.wait_for(listing, 15, "a resource registered, listing its devices")
            except TimeoutError as error:
                raise AssertionError(f"{error}\n{plugin.text()}") from None
            assert await plugin.stop() == 0, plugin.text()


def test_the_deployment_guides_dockerfile_installs_the_wheel_the_repository_builds(
    tmp_path: Path, distributions: tuple[Path, Path]
) -> None:
    """docs/deployment.md's image (its config comes from a ConfigMap, so it is not started)."""
    guide = (ROOT / "docs" / "deployment.md").read_text("utf-8")
    [text] = re.findall(r"^```dockerfile\n(.*?)^```", guide, re.M | re.S)
    assert problems(text, tmp_path, distributions[1]) == []


# ----------------------------------------------------------------------------- too little


def leaving_out(text: str, name: str) -> str:
    """``text`` with ``name`` taken out of its COPY sources (the line, if it was the only one)."""
    lines = []
    for line in text.splitlines(keepends=True):
        words = line.split()
        if words[:1] == ["COPY"] and name in words[1:-1]:
            words.remove(name)
            if len(words) > 2:
                lines.append(" ".join(words) + "\n")
        else:
            lines.append(line)
    assert "".join(lines) != text, f"no COPY of {name}"
    return "".join(lines)


@pytest.mark.parametrize(
    "name", ["pyproject.toml", "README.md", "LICENSE", "hatch_build.py", "devplugin_sdk"]
)
def test_an_image_that_copies_too_little_fails_these_checks(
    name: str, tmp_path: Path, distributions: tuple[Path, Path]
) -> None:
    """Without one of the files `pip wheel` reads, the build fails or makes another wheel (the
    generic image with all of them is among the images above)."""
    text = leaving_out((ROOT / "examples" / "generic" / "Dockerfile").read_text("utf-8"), name)
    assert problems(text, tmp_path, distributions[1]) != []


# ----------------------------------------------------------------------------- the reader


def test_the_reader_joins_continuations_and_reads_both_forms() -> None:
    stages = dockerfile.parse(
        "# a comment\n"
        "FROM python:3.12-slim AS build\n"
        "COPY a b \\\n"
        "  # dropped, as Docker drops it\n"
        "  ./\n"
        "FROM python:3.12-slim\n"
        'COPY --from=build ["/wheels", "/wheels"]\n'
        "ENV A=1 \\\n"
        '    B="two words"\n'
        "ENV LEGACY some value\n"
        'ENTRYPOINT ["devplugin", "run"]\n'
        "CMD --help\n"
    )
    assert [(s.image, s.name) for s in stages] == [
        ("python:3.12-slim", "build"),
        ("python:3.12-slim", None),
    ]
    [copy] = stages[0].instructions
    assert dockerfile.copy_arguments(copy) == dockerfile.Copy(("a", "b"), "./", None)
    assert copy.line == 3
    copy_from, env, legacy, entrypoint, cmd = stages[1].instructions
    assert dockerfile.copy_arguments(copy_from) == dockerfile.Copy(("/wheels",), "/wheels", "build")
    assert dockerfile.stage_index(stages, "build", 1) == dockerfile.stage_index(stages, "0", 1) == 0
    assert dockerfile.env_arguments(env) == {"A": "1", "B": "two words"}
    assert dockerfile.env_arguments(legacy) == {"LEGACY": "some value"}
    assert entrypoint.words() == ["devplugin", "run"]
    assert cmd.words() == ["/bin/sh", "-c", "--help"]


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("FROM python:3.12\nARG VERSION\n", "line 2: ARG is not understood"),
        ("FROM python:3.12\nCOPY --chown=1 a /a\n", "the flag --chown=1 is not understood"),
        ("FROM python:3.12\nENV A=$B\n", "variable substitution is not understood"),
        ("FROM python:3.12\nCOPY a b c\n", "the destination must end with /"),
        ("FROM python:3.12\nCOPY --from=later a /a\n", "--from=later names no earlier stage"),
        ("WORKDIR /src\n", "WORKDIR before the first FROM"),
        ("# escape=`\nFROM python:3.12\n", "line 1: the escape directive is not understood"),
    ],
)
def test_the_reader_refuses_what_it_does_not_understand(text: str, reason: str) -> None:
    with pytest.raises(dockerfile.DockerfileError, match=reason):
        read_every_argument(text)


def read_every_argument(text: str) -> None:
    stages = dockerfile.parse(text)
    for index, stage in enumerate(stages):
        for instruction in stage.instructions:
            if instruction.keyword == "ENV":
                dockerfile.env_arguments(instruction)
            elif instruction.keyword == "COPY":
                copy = dockerfile.copy_arguments(instruction)
                if copy.from_stage is not None:
                    dockerfile.stage_index(stages, copy.from_stage, index)
