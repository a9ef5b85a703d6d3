"""Read a Dockerfile as Docker does, for the tests that carry out its stages without an engine.

It knows what the examples' Dockerfiles use: FROM (with AS), WORKDIR, COPY (with --from), RUN,
ENV, ENTRYPOINT and CMD, in exec (JSON) and shell form, with comments and line continuations.
Anything else (another instruction, a flag, ``$`` substitution, a heredoc) is refused by name, so
a Dockerfile that outgrows this reader fails the tests instead of being half read.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass, field

KEYWORDS = frozenset({"FROM", "WORKDIR", "COPY", "RUN", "ENV", "ENTRYPOINT", "CMD"})


class DockerfileError(ValueError):
    """Something this reader does not understand, at a line of the Dockerfile."""

    def __init__(self, line: int, reason: str) -> None:
        super().__init__(f"Dockerfile line {line}: {reason} (tests/dockerfile.py)")
        self.line = line


@dataclass(frozen=True)
class Instruction:
    """One instruction: its keyword (upper case), its text with continuations joined, and the
    line it starts on."""

    keyword: str
    text: str
    line: int

    @property
    def exec_form(self) -> list[str] | None:
        """The words of the JSON-array (exec) form, or None for the shell form."""
        if not self.text.startswith("["):
            return None
        try:
            words = json.loads(self.text)
        except json.JSONDecodeError:
            return None  # Docker runs text that is not a JSON array as shell form
        if not isinstance(words, list) or not all(isinstance(w, str) for w in words):
            return None
        return words

    def words(self) -> list[str]:
        """The command as Docker runs it: the exec form, or the shell form under /bin/sh -c."""
        exec_form = self.exec_form
        return exec_form if exec_form is not None else ["/bin/sh", "-c", self.text]

    def fail(self, reason: str) -> DockerfileError:
        return DockerfileError(self.line, f"{self.keyword} {self.text}: {reason}")


@dataclass
class Stage:
    """A FROM and the instructions up to the next one."""

    image: str
    name: str | None
    line: int
    instructions: list[Instruction] = field(default_factory=list)


@dataclass(frozen=True)
class Copy:
    """A COPY: sources in the build context (or in stage ``from_stage``), and the destination."""

    sources: tuple[str, ...]
    destination: str
    from_stage: str | None


def parse(text: str) -> list[Stage]:
    """The stages of the Dockerfile ``text``, in order (the last is the image)."""
    for number, raw in enumerate(text.splitlines(), 1):
        if not raw.startswith("#"):
            break  # parser directives come first
        if re.match(r"#\s*escape\s*=", raw, re.I):
            raise DockerfileError(number, "the escape directive is not understood")
    stages: list[Stage] = []
    for line, logical in _logical_lines(text):
        keyword, rest = _first_word(logical)
        keyword = keyword.upper()
        if keyword not in KEYWORDS:
            raise DockerfileError(line, f"{keyword} is not understood")
        if keyword in {"COPY", "RUN"} and "<<" in rest:
            raise DockerfileError(line, "heredocs are not understood")
        if keyword in {"FROM", "WORKDIR", "COPY", "ENV"} and "$" in rest:
            raise DockerfileError(line, "variable substitution is not understood")
        if keyword == "FROM":
            stages.append(_from(line, rest))
        elif not stages:
            raise DockerfileError(line, f"{keyword} before the first FROM")
        else:
            stages[-1].instructions.append(Instruction(keyword, rest, line))
    if not stages:
        raise DockerfileError(1, "no FROM")
    return stages


def stage_index(stages: list[Stage], reference: str, before: int) -> int:
    """The index of the stage that ``COPY --from=reference`` in stage ``before`` names."""
    for index, stage in enumerate(stages[:before]):
        if reference.lower() in {stage.name, str(index)}:
            return index
    raise DockerfileError(stages[before].line, f"--from={reference} names no earlier stage")


def copy_arguments(instruction: Instruction) -> Copy:
    """The sources, destination and ``--from`` of a COPY."""
    rest = instruction.text
    from_stage = None
    while rest.startswith("--"):
        flag, rest = _first_word(rest)
        if not flag.startswith("--from="):
            raise instruction.fail(f"the flag {flag} is not understood")
        from_stage = flag.removeprefix("--from=")
    exec_form = Instruction(instruction.keyword, rest, instruction.line).exec_form
    paths = exec_form if exec_form is not None else rest.split()
    if len(paths) < 2:
        raise instruction.fail("needs a source and a destination")
    *sources, destination = paths
    if len(sources) > 1 and not destination.endswith("/"):
        # Docker's own rule: several sources go into a directory.
        raise instruction.fail("with several sources the destination must end with /")
    return Copy(tuple(sources), destination, from_stage)


def env_arguments(instruction: Instruction) -> dict[str, str]:
    """The variables an ENV sets: ``KEY=value ...`` (quotes as in a shell) or ``KEY value``."""
    first, rest = _first_word(instruction.text)
    if "=" not in first:
        return {first: rest}
    variables = {}
    for word in shlex.split(instruction.text):
        key, equals, value = word.partition("=")
        if not equals or not key:
            raise instruction.fail(f"{word!r} is not KEY=value")
        variables[key] = value
    return variables


def _first_word(text: str) -> tuple[str, str]:
    """(the first word, the rest) of ``text``, the whitespace between and around them dropped."""
    words = text.split(None, 1)
    return (words[0], words[1].strip()) if len(words) == 2 else ("".join(words), "")


def _from(line: int, text: str) -> Stage:
    words = text.split()
    if words and words[0].startswith("--"):
        raise DockerfileError(line, f"FROM {text}: the flag {words[0]} is not understood")
    if len(words) == 1:
        return Stage(words[0], None, line)
    if len(words) == 3 and words[1].upper() == "AS":
        return Stage(words[0], words[2].lower(), line)  # stage names ignore case
    raise DockerfileError(line, f"FROM {text}: expected IMAGE [AS NAME]")


def _logical_lines(text: str) -> Iterator[tuple[int, str]]:
    """(first line number, text) of each instruction: comment lines dropped, even inside a
    continuation, and a line ending in a backslash joined to the next without the newline."""
    pending: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if stripped.startswith("#") or not stripped:
            continue  # Docker drops these inside a continuation too
        if not pending:
            start = number
        if stripped.endswith("\\"):
            pending.append(raw.rstrip()[:-1])
            continue
        pending.append(raw)
        yield start, "".join(pending)
        pending = []
    if pending:
        yield start, "".join(pending)
