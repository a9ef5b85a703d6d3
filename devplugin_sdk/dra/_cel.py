"""CEL selectors evaluated within the API server's bounds, for ``dra simulate``.

The API server refuses a selector longer than ``CELSelectorExpressionMaxLength`` (10 KiB) before
compiling it, one whose estimated cost passes ``CELSelectorExpressionMaxCost`` (1,000,000), and
stops an evaluation at that cost (k8s.io/kubernetes ``pkg/apis/resource/validation/validation.go``
``validateCELSelector``; k8s.io/dynamic-resource-allocation ``cel/compile.go``, ``cel.CostLimit``);
cel-go's parser refuses nesting deeper than 250 (``parser.NewParser``'s default recursion limit,
which Kubernetes' environment keeps). The ``cel`` extra (common-expression-language) has no cost
model, so the length and nesting are checked here before compiling, and the evaluation runs in a
worker process with a deadline per selector and a memory bound (``RLIMIT_AS``): an exponential
selector is refused in seconds instead of running for minutes in gigabytes. The DRA environment's
functions (``quantity()``, ``semver()``...) live here because the worker needs them.
"""

from __future__ import annotations

import contextlib
import json
import queue
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from devplugin_sdk.types import Quantity

__all__ = [
    "EVALUATION_SECONDS",
    "MAX_LENGTH",
    "MAX_NESTING",
    "MEMORY_BYTES",
    "QUANTITY",
    "SEMVER",
    "amount",
    "evaluate",
    "expression_problem",
]

#: ``CELSelectorExpressionMaxLength`` (k8s.io/api resource/v1 types.go).
MAX_LENGTH = 10 * 1024
#: cel-go's parser recursion limit (the common-expression-language crate stops near 96 levels,
#: in a message that quotes the whole expression: deeper than that, its error is cut).
MAX_NESTING = 250
#: The time one selector may take over every device. The API server's bound is a cost of
#: 1,000,000 per device, a few milliseconds of cel-go; the scheduler gives up on a node after
#: its filter timeout (10 s by default).
EVALUATION_SECONDS = 2.0
#: The worker's address space: about 50 MiB at rest with the cel extra loaded.
MEMORY_BYTES = 512 << 20
#: Characters of an expression quoted in an error.
QUOTED = 80

QUANTITY = "__quantity__"
SEMVER = "__semver__"
_SEMVER_RE = re.compile(
    r"(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)(?:-([0-9A-Za-z.-]+))?(?:\+[0-9A-Za-z.-]+)?"
)
_STRING = re.compile(r"""[rR]?(?:'''.*?'''|\"\"\".*?\"\"\"|'(?:\\.|[^'\\])*'|"(?:\\.|[^"\\])*")""")
_OPENING, _CLOSING = "([{", ")]}"

#: One selector's outcome on one device: True, False, or the runtime error's text.
Outcome = bool | str


def quoted(expression: str) -> str:
    """The expression as an error quotes it: at most ``QUOTED`` characters."""
    short = expression if len(expression) <= QUOTED else expression[: QUOTED - 3] + "..."
    return repr(short)


def expression_problem(expression: str) -> str | None:
    """Why the API server refuses ``expression`` before compiling it (length, nesting), or None."""
    if len(expression) > MAX_LENGTH:
        return (
            f"CEL selector {quoted(expression)} is {len(expression)} characters, longer than "
            f"{MAX_LENGTH} (CELSelectorExpressionMaxLength)"
        )
    depth = deepest = 0
    for char in _STRING.sub("''", expression):  # brackets inside string literals do not nest
        if char in _OPENING:
            depth += 1
            deepest = max(deepest, depth)
        elif char in _CLOSING:
            depth -= 1
    if deepest > MAX_NESTING:
        return (
            f"CEL selector {quoted(expression)} is nested deeper than {MAX_NESTING} levels "
            f"({deepest}; the API server's parser limit)"
        )
    return None


class Refused(Exception):
    """One selector refused while compiling or evaluating it (``index`` in the list given)."""

    def __init__(self, index: int, message: str) -> None:
        super().__init__(message)
        self.index = index
        self.message = message


def evaluate(
    expressions: Sequence[str], devices: Sequence[Mapping[str, Any]]
) -> tuple[list[list[Outcome]], list[Refused]]:
    """Each expression's outcome on each device (the ``device`` variable of CEL), in a worker
    process bounded in time per expression and in memory; and the expressions refused (their
    rows are empty). A worker that runs out of either is replaced for the expressions after."""
    results: list[list[Outcome]] = [[] for _ in expressions]
    refused: list[Refused] = []
    start = 0
    while start < len(expressions):
        done, failure = _run_worker(expressions, devices, start, results)
        if failure is not None:
            refused.append(failure)
            start = failure.index + 1
        else:
            start = done
    return results, refused


def _run_worker(
    expressions: Sequence[str],
    devices: Sequence[Mapping[str, Any]],
    start: int,
    results: list[list[Outcome]],
) -> tuple[int, Refused | None]:
    """Evaluate from ``start`` in one worker; returns where it got to and what stopped it."""
    command = [sys.executable, "-m", "devplugin_sdk.dra._cel", str(MEMORY_BYTES)]
    worker = subprocess.Popen(  # our own interpreter and module
        command,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    lines: queue.Queue[str | None] = queue.Queue()
    reader = threading.Thread(target=_read_lines, args=(worker, lines), daemon=True)
    reader.start()
    try:
        assert worker.stdin is not None
        payload = {"expressions": list(expressions[start:]), "devices": list(devices)}
        with contextlib.suppress(BrokenPipeError):
            worker.stdin.write(json.dumps(payload))
            worker.stdin.close()
        index = start
        while index < len(expressions):
            deadline = time.monotonic() + EVALUATION_SECONDS
            line = _next_line(lines, deadline)
            if line is None:  # past the deadline, or the worker's output ended: it died
                return index, _stopped(worker, index, len(devices), lines.empty())
            answer = json.loads(line)
            if "error" in answer:
                return index, Refused(index, answer["error"])
            results[index] = answer["outcomes"]
            index += 1
        return index, None
    finally:
        if worker.poll() is None:
            worker.kill()
        worker.wait()
        reader.join(timeout=5)  # the output ends with the worker
        for pipe in (worker.stdin, worker.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()


def _read_lines(worker: subprocess.Popen[str], lines: queue.Queue[str | None]) -> None:
    assert worker.stdout is not None
    for line in worker.stdout:
        lines.put(line)
    lines.put(None)


def _next_line(lines: queue.Queue[str | None], deadline: float) -> str | None:
    """The worker's next line; None when its output ended (the end is left in the queue) or
    the deadline passed (the queue is empty)."""
    try:
        line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
    except queue.Empty:
        return None
    if line is None:
        lines.put(None)
    return line


def _stopped(worker: subprocess.Popen[str], index: int, devices: int, timed_out: bool) -> Refused:
    """Why the worker gave no answer for expression ``index``: it ran past its time, or died."""
    if timed_out:
        return Refused(
            index,
            f"evaluation on {devices} devices ran past {EVALUATION_SECONDS:g} s (the API "
            "server stops a selector at a cost of 1,000,000 per device: "
            "CELSelectorExpressionMaxCost)",
        )
    try:
        code = worker.wait(timeout=5)
    except subprocess.TimeoutExpired:
        code = None
    return Refused(
        index,
        f"evaluation on {devices} devices ran out of its {MEMORY_BYTES >> 20} MiB memory bound "
        f"(the worker's exit status {code}; the API server bounds a selector's cost)",
    )


# ------------------------------------------------------------------ the DRA environment


def amount(raw: Any) -> int:
    """A quantity's value (``40Gi``) as Kubernetes parses it."""
    return Quantity.parse(str(raw)).value


def semver_key(text: str) -> tuple[Any, ...]:
    """A semantic version's sort key (a release sorts after its pre-releases)."""
    match = _SEMVER_RE.fullmatch(text)
    if match is None:
        raise ValueError(f"{text!r} is not a semantic version")
    pre = match[4]
    # Pre-release identifiers compare numerically, then as text.
    tail: tuple[Any, ...] = (
        (1,)
        if pre is None
        else (0, *((0, int(p)) if p.isdigit() else (1, p) for p in pre.split(".")))
    )
    return (int(match[1]), int(match[2]), int(match[3]), tail)


def _compare(a: Any, b: Any) -> int:
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        if QUANTITY in a and QUANTITY in b:
            x, y = int(a[QUANTITY]), int(b[QUANTITY])
            return (x > y) - (x < y)
        if SEMVER in a and SEMVER in b:
            p, q = semver_key(a[SEMVER]), semver_key(b[SEMVER])
            return (p > q) - (p < q)
    raise TypeError("compareTo needs two quantities or two semantic versions")


def functions() -> dict[str, Callable[..., Any]]:
    """Kubernetes' quantity and semver libraries, on values tagged ``QUANTITY``/``SEMVER``."""

    def quantity(text: str) -> dict[str, int]:
        return {QUANTITY: amount(text)}

    def semver(text: str) -> dict[str, str]:
        semver_key(text)
        return {SEMVER: text}

    def is_quantity(text: str) -> bool:
        try:
            amount(text)
        except ValueError:
            return False
        return True

    def part(index: int) -> Callable[[Mapping[str, str]], int]:
        return lambda v: int(semver_key(v[SEMVER])[index])

    return {
        "quantity": quantity,
        "semver": semver,
        "isSemver": lambda text: _SEMVER_RE.fullmatch(text) is not None,
        "isQuantity": is_quantity,
        "compareTo": _compare,
        "isGreaterThan": lambda a, b: _compare(a, b) > 0,
        "isLessThan": lambda a, b: _compare(a, b) < 0,
        "asInteger": lambda q: q[QUANTITY],
        "asApproximateFloat": lambda q: float(q[QUANTITY]),
        "sign": lambda q: (q[QUANTITY] > 0) - (q[QUANTITY] < 0),
        "isInteger": lambda q: True,
        "major": part(0),
        "minor": part(1),
        "patch": part(2),
    }


# ------------------------------------------------------------------ the worker


def _outcomes(cel: Any, program: Any, devices: Sequence[Mapping[str, Any]]) -> Iterator[Outcome]:
    table = functions()
    for device in devices:
        context = cel.Context({"device": device})
        for name, function in table.items():
            context.add_function(name, function)
        try:
            yield program.execute(context) is True
        except Exception as exc:  # the library raises several kinds; the text is the answer
            yield " ".join(str(exc).split())[:200] or type(exc).__name__


def _worker(memory: int) -> None:
    """Read the expressions and devices (JSON on stdin), answer one JSON line per expression."""
    import resource  # noqa: PLC0415 - the worker only

    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    import cel  # noqa: PLC0415 - the optional extra, checked by the caller

    payload = json.load(sys.stdin)
    for expression in payload["expressions"]:
        try:
            program = cel.compile(expression)
        except BaseException as exc:  # a pyo3 panic is a BaseException
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            error = f"CEL selector {quoted(expression)} does not compile: {first[:200]}"
            print(json.dumps({"error": error}), flush=True)
            return
        outcomes = list(_outcomes(cel, program, payload["devices"]))
        print(json.dumps({"outcomes": outcomes}), flush=True)


if __name__ == "__main__":
    _worker(int(sys.argv[1]))
