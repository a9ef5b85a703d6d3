"""Which devices the scheduler would pick for a claim, offline (``devplugin dra simulate``).

``simulate`` evaluates a ResourceClaim's requests against ResourceSlices (v1 objects) as
k8s.io/dynamic-resource-allocation ``structured`` does, in its order: requests in order, devices
in slice order, backtracking when a later request or a constraint fails. It covers the DeviceClass
and request CEL selectors, ``exactly`` (``ExactCount`` and ``All``) and ``firstAvailable``
(prioritized list), ``capacity.requests`` (with ``allowMultipleAllocations`` and ``requestPolicy``
rounding), ``matchAttribute`` constraints and shared counters. Not covered: tolerations (a tainted
device with ``NoSchedule``/``NoExecute`` is left out), ``distinctAttribute``, admin access, node
selection (every slice counts).

CEL runs on the ``cel`` extra (common-expression-language) with Kubernetes' DRA environment
(k8s.io/dynamic-resource-allocation ``cel/compile.go``): ``device.driver``,
``device.attributes[domain][name]`` and ``device.capacity[domain][name]`` (an unqualified name is in
the driver's domain; an unknown domain is an empty map, an unknown name an error), and
``device.allowMultipleAllocations``; ``quantity()`` and ``semver()`` values with ``compareTo``,
``isGreaterThan``, ``isLessThan``. A selector that fails at run time fails the whole claim, as in
the scheduler.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from devplugin_sdk.dra import _cel, _shapes
from devplugin_sdk.errors import MissingDependencyError

__all__ = ["Pick", "SelectorError", "Simulation", "simulate"]

_DOMAIN_USE = re.compile(r'device\.(?:attributes|capacity)\[\s*"([^"]+)"\s*\]')
_amount = _cel.amount
#: Bound on the search (the scheduler bounds its own by time).
MAX_STEPS = 100_000


@dataclass(frozen=True, slots=True)
class Pick:
    """A device picked for a request."""

    request: str
    driver: str
    pool: str
    device: str


@dataclass
class Simulation:
    """The outcome: the picks, or why there are none.

    Attributes:
        picks: The devices, in request order; empty when the claim cannot be allocated.
        reasons: Why not, one line each (empty when allocated).
    """

    picks: list[Pick] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)

    @property
    def allocated(self) -> bool:
        """Whether every request got its devices."""
        return not self.reasons


@dataclass
class _Device:
    driver: str
    pool: str
    name: str
    cel: dict[str, Any]
    attributes: dict[str, Any]  # fully qualified name -> plain value (constraints)
    capacity: dict[str, int]  # fully qualified name -> amount
    policies: dict[str, Mapping[str, Any]]
    multiple: bool
    consumes: list[tuple[str, dict[str, int]]]
    excluded: str | None = None


@dataclass(frozen=True, slots=True)
class _Selector:
    origin: str  # "class gpu selector #0", "request gpu selector #1"
    document: str  # "claim" or the DeviceClass's name
    key: str  # the dotted key of the expression in that document
    expression: str


@dataclass
class _Request:
    name: str  # "gpus" or "gpus/large"
    main: str
    selectors: list[_Selector]
    mode: str
    count: int
    capacity: dict[str, int]


def _load_cel() -> Any:
    try:
        import cel  # noqa: PLC0415 - the optional extra
    except ImportError:
        raise MissingDependencyError(
            "dra simulate needs a CEL implementation: pip install 'devplugin-sdk[cel]' "
            "(common-expression-language, Python 3.11 or newer)"
        ) from None
    return cel


def _qualified(name: str, driver: str) -> tuple[str, str]:
    domain, sep, rest = name.partition("/")
    return (domain, rest) if sep else (driver, name)


def _devices(slices: Sequence[Mapping[str, Any]], domains: set[str]) -> list[_Device]:
    """The devices of the highest generation of each pool, in slice order."""
    latest: dict[tuple[str, str], int] = {}
    for obj in slices:
        spec = obj.get("spec") or {}
        key = (str(spec.get("driver")), str((spec.get("pool") or {}).get("name")))
        latest[key] = max(latest.get(key, 0), int((spec.get("pool") or {}).get("generation", 0)))
    out: list[_Device] = []
    for obj in slices:
        spec = obj.get("spec") or {}
        driver = str(spec.get("driver"))
        pool = (spec.get("pool") or {}).get("name")
        if int((spec.get("pool") or {}).get("generation", 0)) != latest[(driver, str(pool))]:
            continue
        for raw in spec.get("devices") or []:
            out.append(_device(raw, driver, str(pool), domains))
    return out


def _device(raw: Mapping[str, Any], driver: str, pool: str, domains: set[str]) -> _Device:
    attributes: dict[str, Any] = {}
    cel_attributes: dict[str, dict[str, Any]] = {d: {} for d in domains | {driver}}
    for name, value in (raw.get("attributes") or {}).items():
        ((kind, plain),) = value.items()
        domain, short = _qualified(str(name), driver)
        attributes[f"{domain}/{short}"] = (kind, plain)
        cel_attributes.setdefault(domain, {})[short] = (
            {_cel.SEMVER: str(plain)} if kind == "version" else plain
        )
    capacity: dict[str, int] = {}
    policies: dict[str, Mapping[str, Any]] = {}
    cel_capacity: dict[str, dict[str, Any]] = {d: {} for d in domains | {driver}}
    for name, value in (raw.get("capacity") or {}).items():
        domain, short = _qualified(str(name), driver)
        amount = _amount(value.get("value"))
        capacity[f"{domain}/{short}"] = amount
        if value.get("requestPolicy"):
            policies[f"{domain}/{short}"] = value["requestPolicy"]
        cel_capacity.setdefault(domain, {})[short] = {_cel.QUANTITY: amount}
    multiple = bool(raw.get("allowMultipleAllocations"))
    consumes = [
        (
            str(c.get("counterSet")),
            {k: _amount(v.get("value")) for k, v in (c.get("counters") or {}).items()},
        )
        for c in raw.get("consumesCounters") or []
    ]
    excluded = next(
        (
            f"tainted {t.get('key')}={t.get('value', '')}:{t.get('effect')}"
            for t in raw.get("taints") or []
            if t.get("effect") in ("NoSchedule", "NoExecute")
        ),
        None,
    )
    cel = {
        "driver": driver,
        "attributes": cel_attributes,
        "capacity": cel_capacity,
        "allowMultipleAllocations": multiple,
    }
    return _Device(
        driver,
        pool,
        str(raw.get("name")),
        cel,
        attributes,
        capacity,
        policies,
        multiple,
        consumes,
        excluded,
    )


def _counters(slices: Sequence[Mapping[str, Any]]) -> dict[tuple[str, str, str], dict[str, int]]:
    out: dict[tuple[str, str, str], dict[str, int]] = {}
    for obj in slices:
        spec = obj.get("spec") or {}
        driver, pool = str(spec.get("driver")), str((spec.get("pool") or {}).get("name"))
        for counter_set in spec.get("sharedCounters") or []:
            out[(driver, pool, str(counter_set.get("name")))] = {
                k: _amount(v.get("value")) for k, v in (counter_set.get("counters") or {}).items()
            }
    return out


def _requests(
    claim: Mapping[str, Any], classes: Mapping[str, Mapping[str, Any]]
) -> list[list[_Request]]:
    """Each request's alternatives (one, or a prioritized list's subrequests)."""
    out: list[list[_Request]] = []
    for i, raw in enumerate((claim.get("devices") or {}).get("requests") or []):
        main = str(raw.get("name"))
        key = f"spec.devices.requests[{i}]"
        if raw.get("firstAvailable"):
            out.append(
                [
                    _request(
                        f"{main}/{s.get('name')}", main, s, classes, f"{key}.firstAvailable[{j}]"
                    )
                    for j, s in enumerate(raw["firstAvailable"])
                ]
            )
        else:
            out.append([_request(main, main, raw.get("exactly") or {}, classes, f"{key}.exactly")])
    return out


def _request(
    name: str,
    main: str,
    raw: Mapping[str, Any],
    classes: Mapping[str, Mapping[str, Any]],
    key: str,
) -> _Request:
    class_name = str(raw.get("deviceClassName", ""))
    if class_name not in classes:
        raise ValueError(f"request {name}: DeviceClass {class_name!r} is not in the input")
    selectors = [
        _Selector(
            f"class {class_name} selector #{i}",
            class_name,
            f"spec.selectors[{i}].cel.expression",
            str(s["cel"]["expression"]),
        )
        for i, s in enumerate((classes[class_name].get("spec") or {}).get("selectors") or [])
    ]
    selectors += [
        _Selector(
            f"request {name} selector #{i}",
            "claim",
            f"{key}.selectors[{i}].cel.expression",
            str(s["cel"]["expression"]),
        )
        for i, s in enumerate(raw.get("selectors") or [])
    ]
    wanted = ((raw.get("capacity") or {}).get("requests")) or {}
    return _Request(
        name,
        main,
        selectors,
        str(raw.get("allocationMode", "ExactCount")),
        int(raw.get("count", 1)),
        {k: _amount(v) for k, v in wanted.items()},
    )


class SelectorError(ValueError):
    """CEL selectors refused as the API server refuses them (too long, too deep, too costly,
    not compiling): one ``(document, key, message)`` each, ``document`` being ``"claim"`` or
    the DeviceClass's name and ``key`` the dotted key of the expression in it."""

    def __init__(self, refused: list[tuple[str, str, str]]) -> None:
        super().__init__("; ".join(f"{d}: {k}: {m}" for d, k, m in refused))
        self.refused = refused


def _check_shapes(
    slices: Sequence[Mapping[str, Any]],
    claim: Mapping[str, Any],
    classes: Mapping[str, Mapping[str, Any]],
) -> None:
    """Refuse objects of the wrong shape (``dra._shapes``), naming the first five."""
    wrong = [f"claim: {k}: {m}" for k, m in _shapes.claim_problems({"spec": claim})]
    for name, device_class in classes.items():
        wrong += [f"DeviceClass {name}: {k}: {m}" for k, m in _shapes.class_problems(device_class)]
    for i, obj in enumerate(slices):
        wrong += [f"slice #{i}: {k}: {m}" for k, m in _shapes.slice_problems(obj)]
    if wrong:
        raise ValueError("; ".join(wrong[:5]))


def _selectors(alternatives: list[list[_Request]]) -> dict[str, _Selector]:
    """Each expression where it first appears; those the API server refuses before compiling
    (length, nesting) raise ``SelectorError``."""
    first: dict[str, _Selector] = {}
    for alts in alternatives:
        for request in alts:
            for selector in request.selectors:
                first.setdefault(selector.expression, selector)
    refused = [
        (s.document, s.key, problem)
        for s in first.values()
        if (problem := _cel.expression_problem(s.expression)) is not None
    ]
    if refused:
        raise SelectorError(refused)
    return first


def simulate(
    slices: Sequence[Mapping[str, Any]],
    claim: Mapping[str, Any],
    classes: Mapping[str, Mapping[str, Any]],
) -> Simulation:
    """The devices the scheduler would allocate to ``claim`` (its ``spec``) from ``slices``.

    Args:
        slices: ResourceSlices as v1 objects.
        claim: The claim's ``spec`` (``devices.requests``, ``devices.constraints``).
        classes: DeviceClasses (v1 objects) by name.

    Raises:
        MissingDependencyError: no CEL implementation (the ``cel`` extra).
        SelectorError: a selector the API server would refuse: longer or deeper than its
            bounds, not compiling, or running past the evaluation's time or memory bound
            (``dra._cel``: the selectors run in a worker process).
        ValueError: an object of the wrong shape (``dra._shapes``, the first five named), an
            unknown DeviceClass.
    """
    _load_cel()
    _check_shapes(slices, claim, classes)
    alternatives = _requests(claim, classes)
    first = _selectors(alternatives)
    domains = {m for e in first for m in _DOMAIN_USE.findall(e)}
    devices = _devices(slices, domains)
    expressions = list(first)
    table, failures = _cel.evaluate(expressions, [d.cel for d in devices])
    if failures:
        raise SelectorError(
            [
                (first[expressions[f.index]].document, first[expressions[f.index]].key, f.message)
                for f in failures
            ]
        )
    outcomes = dict(zip(expressions, table, strict=True))
    verdicts: dict[tuple[str, int], str | None] = {}

    def rejection(request: _Request, k: int) -> str | None:
        """Why device ``k`` cannot serve ``request`` alone (None: it can)."""
        key = (request.name, k)
        if key not in verdicts:
            verdicts[key] = _rejection(outcomes, request, devices[k], k)
        return verdicts[key]

    search = _Search(devices, _counters(slices), claim, rejection)
    return search.run(alternatives)


def _rejection(
    outcomes: Mapping[str, list[_cel.Outcome]], request: _Request, device: _Device, k: int
) -> str | None:
    if device.excluded is not None:
        return device.excluded
    for selector in request.selectors:
        outcome = outcomes[selector.expression][k]
        if isinstance(outcome, str):
            raise _CelRuntimeError(
                f"{selector.origin}: CEL runtime error on device {device.name}: {outcome}"
            )
        if outcome is not True:
            return f"{selector.origin} is false"
    for name, amount in request.capacity.items():
        qualified = "/".join(_qualified(name, device.driver))
        have = device.capacity.get(qualified)
        if have is None or have < _rounded(amount, device.policies.get(qualified)):
            return f"capacity {name} is less than {amount}"
    return None


class _CelRuntimeError(Exception):
    pass


def _rounded(amount: int, policy: Mapping[str, Any] | None) -> int:
    """What a capacity request consumes under the device's ``requestPolicy``: the smallest valid
    value at least ``amount`` (KEP-5075)."""
    if policy is None:
        return amount
    if policy.get("validValues"):
        values = sorted(_amount(v) for v in policy["validValues"])
        return next((v for v in values if v >= amount), amount)
    valid = policy.get("validRange")
    if valid:
        low = _amount(valid.get("min", 0))
        step = _amount(valid["step"]) if valid.get("step") else 0
        if amount <= low:
            return low
        if step:
            return low + -(-(amount - low) // step) * step
    return amount


class _Search:
    def __init__(
        self,
        devices: list[_Device],
        counters: dict[tuple[str, str, str], dict[str, int]],
        claim: Mapping[str, Any],
        rejection: Callable[[_Request, int], str | None],
    ) -> None:
        self.devices = devices
        self.counters = counters
        self.constraints = [
            (tuple(c.get("requests") or ()), str(c["matchAttribute"]))
            for c in (claim.get("devices") or {}).get("constraints") or []
            if c.get("matchAttribute")
        ]
        self.rejection = rejection
        self.steps = 0
        self.blocked: dict[str, dict[str, int]] = {}

    def run(self, alternatives: list[list[_Request]]) -> Simulation:
        try:
            picks = self._solve(alternatives, 0, [])
        except _CelRuntimeError as exc:
            return Simulation(reasons=[f"the scheduler would fail the claim: {exc}"])
        if picks is not None:
            return Simulation([Pick(r.name, d.driver, d.pool, d.name) for r, d in picks])
        return Simulation(reasons=self._reasons(alternatives))

    def _solve(
        self, alternatives: list[list[_Request]], i: int, picked: list[tuple[_Request, _Device]]
    ) -> list[tuple[_Request, _Device]] | None:
        if i == len(alternatives):
            return picked
        for request in alternatives[i]:
            found = self._fill(alternatives, i, request, picked, have=0, after=-1)
            if found is not None:
                return found
        return None

    def _fill(
        self,
        alternatives: list[list[_Request]],
        i: int,
        request: _Request,
        picked: list[tuple[_Request, _Device]],
        *,
        have: int,
        after: int,
    ) -> list[tuple[_Request, _Device]] | None:
        fitting = [k for k in range(len(self.devices)) if self.rejection(request, k) is None]
        wanted = len(fitting) if request.mode == "All" else request.count
        if request.mode == "All" and not fitting:
            self._block(request, "no device matches")
            return None
        if have == wanted:
            return self._solve(alternatives, i + 1, picked)
        for k in fitting:
            if k <= after:
                continue
            self.steps += 1
            if self.steps > MAX_STEPS:
                return None
            device = self.devices[k]
            why = self._conflict(request, device, picked)
            if why is not None:
                self._block(request, why)
                if request.mode == "All":
                    return None
                continue
            found = self._fill(
                alternatives, i, request, [*picked, (request, device)], have=have + 1, after=k
            )
            if found is not None:
                return found
        return None

    def _block(self, request: _Request, why: str) -> None:
        reasons = self.blocked.setdefault(request.name, {})
        reasons[why] = reasons.get(why, 0) + 1

    def _conflict(
        self, request: _Request, device: _Device, picked: list[tuple[_Request, _Device]]
    ) -> str | None:
        same = [(r, d) for r, d in picked if d is device]
        if same and not device.multiple:
            return f"device {device.name} is already picked for request {same[0][0].name}"
        for name, amount in request.capacity.items():
            qualified = "/".join(_qualified(name, device.driver))
            used = sum(
                _rounded(r.capacity.get(name, 0), device.policies.get(qualified)) for r, _ in same
            )
            if used + _rounded(amount, device.policies.get(qualified)) > device.capacity[qualified]:
                return f"device {device.name} has no {name} left"
        for requests, attribute in self.constraints:
            if requests and request.main not in requests and request.name not in requests:
                continue
            value = device.attributes.get(attribute)
            if value is None:
                return f"device {device.name} has no attribute {attribute} (matchAttribute)"
            for other, d in picked:
                if requests and other.main not in requests and other.name not in requests:
                    continue
                if d.attributes.get(attribute) != value:
                    return f"matchAttribute {attribute} differs from {d.name}'s"
        return self._counter_conflict(device, picked)

    def _counter_conflict(
        self, device: _Device, picked: list[tuple[_Request, _Device]]
    ) -> str | None:
        for counter_set, amounts in device.consumes:
            key = (device.driver, device.pool, counter_set)
            total = self.counters.get(key)
            if total is None:
                return (
                    f"device {device.name} consumes counter set {counter_set}, which no slice has"
                )
            for counter, amount in amounts.items():
                used = sum(
                    a.get(counter, 0)
                    for _, d in picked
                    if (d.driver, d.pool) == (device.driver, device.pool)
                    for s, a in d.consumes
                    if s == counter_set
                )
                if used + amount > total.get(counter, 0):
                    return f"counter {counter_set}/{counter} is exhausted"
        return None

    def _reasons(self, alternatives: list[list[_Request]]) -> list[str]:
        lines: list[str] = []
        for alts in alternatives:
            for request in alts:
                rejected: dict[str, int] = {}
                fitting = 0
                for k in range(len(self.devices)):
                    why = self.rejection(request, k)
                    if why is None:
                        fitting += 1
                    else:
                        rejected[why] = rejected.get(why, 0) + 1
                need = "all matching devices" if request.mode == "All" else str(request.count)
                parts = [f"{n} devices: {why}" for why, n in sorted(rejected.items())]
                parts += [
                    f"{n} tries: {why}"
                    for why, n in sorted(self.blocked.get(request.name, {}).items())
                ]
                lines.append(
                    f"request {request.name} needs {need}; {fitting} of {len(self.devices)} "
                    f"devices match" + (f" ({'; '.join(parts)})" if parts else "")
                )
        return lines


def plain(simulation: Simulation) -> Iterator[str]:
    """The outcome as lines of text."""
    if simulation.allocated:
        for pick in simulation.picks:
            yield f"request {pick.request}: {pick.device} (driver {pick.driver}, pool {pick.pool})"
    else:
        yield "no allocation:"
        yield from (f"  {line}" for line in simulation.reasons)
