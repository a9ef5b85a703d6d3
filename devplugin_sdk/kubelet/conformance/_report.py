"""What a conformance run reports: a check's verdicts (raised by the check), its result, the
report of a run, and ``Check``, a named check with its levels and the kubelet code behind them;
``run_check`` turns one check's outcome into its result."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, Protocol, TypeVar

import anyio

from devplugin_sdk._limits import Limits
from devplugin_sdk.kubelet.probe import ProbeError

__all__ = [
    "BOTH",
    "FAIL",
    "WARN",
    "Check",
    "CheckFailed",
    "CheckResult",
    "CheckWarning",
    "ConformanceError",
    "ConformanceReport",
    "Level",
    "OnResult",
    "Skip",
    "Status",
    "emitter",
    "ms",
    "plural",
    "run_check",
]

Status = Literal["pass", "warn", "fail", "skip"]
Level = Literal["warn", "fail"]
OnResult = Callable[["CheckResult"], None]


class CheckFailed(Exception):
    """Raised by a check: the kubelet breaks or misbehaves with it; the message says how."""


class CheckWarning(Exception):
    """Raised by a check: the kubelet copes, but the plugin's intent is lost; the message says
    how."""


class Skip(Exception):
    """Raised by a check that does not apply (an option not advertised, no devices)."""


class ConformanceError(Exception):
    """The suite cannot run (e.g. a live kubelet already serves the register directory)."""


@dataclass(frozen=True, slots=True)
class CheckResult:
    """The outcome of one check.

    Attributes:
        name: The check's name, e.g. ``"unknown-ids-rejected"``.
        status: ``"pass"``, ``"warn"``, ``"fail"`` or ``"skip"``.
        detail: What was seen (with any note), or why it warned, failed or was skipped.
        resource: The resource tested, in ``--register-dir`` mode.
    """

    name: str
    status: Status
    detail: str
    resource: str | None = None

    def line(self) -> str:
        """``PASS  options-fast  answered in 0.4 ms``."""
        return f"{self.status.upper():<4}  {self.name}  {self.detail}"

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "status": self.status,
            "detail": self.detail,
            "resource": self.resource,
        }


@dataclass
class ConformanceReport:
    """Every result of a run, in order.

    Attributes:
        mode: ``"socket"``, ``"register-dir"`` or ``"dra"``.
        target: The socket or directory tested.
        results: The check results.
    """

    mode: str
    target: str
    results: list[CheckResult] = field(default_factory=list)

    def count(self, status: Status) -> int:
        return sum(1 for r in self.results if r.status == status)

    def succeeded(self, *, strict: bool = False) -> bool:
        """No check failed (nor, with ``strict``, warned), and at least one ran to a verdict."""
        bad = self.count("fail") + (self.count("warn") if strict else 0)
        return bad == 0 and self.count("pass") + self.count("warn") > 0

    @property
    def ok(self) -> bool:
        """The verdict without ``strict``: no check failed (warnings allowed)."""
        return self.succeeded()

    def summary(self) -> str:
        """``N passed, M failed`` (with the warned and skipped checks, when any)."""
        warned = self.count("warn")
        text = f"{self.count('pass')} passed, " + (f"{warned} warned, " if warned else "")
        text += f"{self.count('fail')} failed"
        skipped = self.count("skip")
        return f"{text}, {skipped} skipped" if skipped else text

    def to_json(self, *, strict: bool = False) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "target": self.target,
            "results": [r.to_json() for r in self.results],
            "passed": self.count("pass"),
            "warned": self.count("warn"),
            "failed": self.count("fail"),
            "skipped": self.count("skip"),
            "strict": strict,
            "ok": self.succeeded(strict=strict),
        }


class _Limited(Protocol):
    limits: Limits


SubjectT = TypeVar("SubjectT", bound=_Limited)


@dataclass(frozen=True, slots=True)
class Check(Generic[SubjectT]):
    """A named check (of a device plugin, or of a DRA plugin for ``DRA_CHECKS``).

    Attributes:
        name: The name printed on its line.
        rule: The rule it checks, one sentence.
        run: The check: returns a detail line, or raises ``CheckFailed``, ``CheckWarning`` or
            ``Skip``.
        levels: The levels it can give besides pass and skip.
        kubelet: What the kubelet does that the levels come from, naming its functions
            (``dm/`` is ``pkg/kubelet/cm/devicemanager/``, as in the protocol reference).
        register_only: Runs only in ``--register-dir`` mode.
    """

    name: str
    rule: str
    run: Callable[[SubjectT], Awaitable[str]]
    levels: tuple[Level, ...]
    kubelet: str
    register_only: bool = False


FAIL: tuple[Level, ...] = ("fail",)
WARN: tuple[Level, ...] = ("warn",)
BOTH: tuple[Level, ...] = ("fail", "warn")


async def run_check(check: Check[SubjectT], subject: SubjectT, resource: str | None) -> CheckResult:
    # Bounds a check that makes many calls; each call has its own deadline too.
    bound = max(subject.limits.timeout, 1.0) * 3
    scope = anyio.CancelScope(deadline=anyio.current_time() + bound)
    try:
        with scope:
            detail = await check.run(subject)
        if scope.cancelled_caught:
            return CheckResult(check.name, "fail", f"did not finish within {bound:g} s", resource)
    except CheckFailed as exc:
        return CheckResult(check.name, "fail", str(exc), resource)
    except CheckWarning as exc:
        return CheckResult(check.name, "warn", str(exc), resource)
    except Skip as exc:
        return CheckResult(check.name, "skip", str(exc), resource)
    except ProbeError as exc:
        return CheckResult(check.name, "fail", str(exc), resource)
    except TimeoutError:
        detail = f"the plugin did not answer within {subject.limits.timeout:g} s"
        return CheckResult(check.name, "fail", detail, resource)
    except Exception as exc:
        return CheckResult(
            check.name, "fail", f"unexpected error: {type(exc).__name__}: {exc}", resource
        )
    return CheckResult(check.name, "pass", detail, resource)


def emitter(report: ConformanceReport, on_result: OnResult | None) -> OnResult:
    def emit(result: CheckResult) -> None:
        report.results.append(result)
        if on_result is not None:
            on_result(result)

    return emit


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def ms(seconds: float) -> str:
    if seconds >= 1.0:
        return f"{seconds:.2f} s"
    return f"{seconds * 1000:.1f} ms"
