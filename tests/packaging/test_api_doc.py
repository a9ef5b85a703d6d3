"""docs/api.md against the code: every entry names a public object with the documented signature,
and every public name has an entry.

docs/api.md stays hand-written (its prose and examples are the point) and this test keeps it true.
Its convention, which the parser below reads:

- ``## `devplugin_sdk.x``` opens the section of one public module;
- ``### `Name``` (or ``#### ``) is an entry; one heading may name several, as
  ``### `A`, `B` and `C```. Every name must be in the section module's ``__all__``;
- an entry's signature is the ``python`` block under it (``class``/``def`` statements for the
  names of the heading; a ``def`` may leave out its ``:`` and body), or else the first code span of
  its text that calls the name (``Name(a, b=1)`` or ``module.Name(a, b=1) -> R``). An entry with
  neither (a constant, an enum, a protocol described in prose) is checked for existence only.

What is compared is what ``inspect.signature`` shows: parameter names, their kinds and order and
their defaults (by value; ``...`` for a dataclass default made anew for each instance, a UUID);
annotations are prose. A block's ``async def`` and ``@dataclass(frozen=True, slots=True)`` are
compared too. For a class block, annotated names are the dataclass fields in order (for a
dataclass) or class attributes, and each ``def`` is the method's signature. Inside a module's
section every sub-heading is an entry. A public name counts as documented when an entry names
the same object under the same name in any section (``devplugin_sdk.Device`` documents
``devplugin_sdk.types.Device``).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sdk_helpers import ROOT, is_private, sdk_modules

API_MD = ROOT / "docs" / "api.md"

_SECTION = re.compile(r"^## `(devplugin_sdk(?:\.\w+)*)`$")
_ENTRY = re.compile(r"^#{3,4} (`\w+`(?:(?:, | and )`\w+`)*)$")
_HEADING = re.compile(r"^#{1,6} ")
_SPAN = re.compile(r"`([^`]+)`")


@dataclasses.dataclass
class Entry:
    """One documented name: where, and the signature the page gives it (None: none given)."""

    module: str
    name: str
    line: int
    signature: ast.stmt | None = None

    @property
    def where(self) -> str:
        return f"docs/api.md:{self.line}: `{self.name}` (## `{self.module}`)"


# ----------------------------------------------------------------------------- the page


def entries(text: str) -> list[Entry]:
    """The page's entries, each with its signature when the page gives one."""
    found: list[Entry] = []
    for module, line, names, body in _blocks(text):
        block = _python_block(body)
        defined = {
            node.name: node
            for node in (ast.parse(_completed(block)).body if block is not None else [])
            if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        }
        for name in names:
            signature = defined.get(name)
            if signature is None:
                signature = _inline_signature(name, body)
            found.append(Entry(module, name, line, signature))
    return found


def _blocks(text: str) -> Iterator[tuple[str, int, list[str], str]]:
    """(section module, line, names, body text) for every entry heading."""
    lines = text.splitlines()
    module = ""
    fenced = False
    current: tuple[str, int, list[str]] | None = None
    body: list[str] = []
    for number, line in enumerate(lines, 1):
        if line.startswith("```"):
            fenced = not fenced
        if fenced or not _HEADING.match(line) or line.startswith("```"):
            body.append(line)
            continue
        if current is not None:
            yield (*current, "\n".join(body))
        current, body = None, []
        if line.startswith("## "):
            section = _SECTION.match(line)
            module = section.group(1) if section else ""
        entry = _ENTRY.match(line)
        if entry:
            assert module, f"docs/api.md:{number}: an entry before any `## `module`` section"
            current = (module, number, re.findall(r"`(\w+)`", entry.group(1)))
    if current is not None:
        yield (*current, "\n".join(body))


def _python_block(body: str) -> str | None:
    match = re.search(r"^```python\n(.*?)^```", body, re.M | re.S)
    return match.group(1) if match else None


def _completed(code: str) -> str:
    """A signature listing as Python: each ``def`` without a body gets ``: ...``."""
    out: list[str] = []
    pending: list[str] = []
    for line in code.splitlines():
        if not pending and not re.match(r"\s*(async )?def ", line):
            out.append(line)
            continue
        pending.append(line)
        joined = "\n".join(pending)
        if joined.count("(") > joined.count(")"):
            continue  # the parameters go on
        stripped = re.sub(r"\s*#.*$", "", joined.rstrip())
        out.append(stripped if re.search(r":( \.\.\.)?$", stripped) else stripped + ": ...")
        pending = []
    return "\n".join(out)


def _inline_signature(name: str, body: str) -> ast.stmt | None:
    """``Name(a, b=1) -> R`` from the first code span of the text that calls the name."""
    prose = re.sub(r"^```.*?^```", "", body, flags=re.M | re.S)
    for span in _SPAN.findall(prose.replace("\n", " ")):
        match = re.match(rf"(?:\w+\.)*{name}(\(.*)$", span)
        if not match:
            continue
        try:
            node = ast.parse(f"def {name}{match.group(1)}: ...").body[0]
        except SyntaxError:
            raise AssertionError(f"`{name}`: the code span `{span}` is not a signature") from None
        node.inline = True  # type: ignore[attr-defined]  # a code span says nothing of async
        return node
    return None


# ----------------------------------------------------------------------------- comparing


def _documented_params(args: ast.arguments) -> list[tuple[str, str, str | None]]:
    """(name, kind, default source) for each parameter of a documented ``def``."""
    kinds = inspect.Parameter
    positional = [*args.posonlyargs, *args.args]
    defaults: list[ast.expr | None] = [None] * (len(positional) - len(args.defaults))
    defaults += args.defaults
    out = [
        (
            a.arg,
            str(kinds.POSITIONAL_ONLY if a in args.posonlyargs else kinds.POSITIONAL_OR_KEYWORD),
            None if d is None else ast.unparse(d),
        )
        for a, d in zip(positional, defaults, strict=True)
    ]
    if args.vararg:
        out.append((args.vararg.arg, str(kinds.VAR_POSITIONAL), None))
    for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True):
        out.append((a.arg, str(kinds.KEYWORD_ONLY), None if d is None else ast.unparse(d)))
    if args.kwarg:
        out.append((args.kwarg.arg, str(kinds.VAR_KEYWORD), None))
    return out


_MISSING = object()


class _Made:
    """A default a dataclass makes per instance with a factory that gives a new value each time
    (a UUID): the page writes it ``...``."""

    def __repr__(self) -> str:
        return "<made per instance>"


def _same_default(documented: str | None, actual: object, scope: dict[str, Any]) -> bool:
    if isinstance(actual, _Made) or documented == "...":
        return isinstance(actual, _Made) and documented == "..."
    if documented is None or actual is _MISSING:
        return documented is None and actual is _MISSING
    try:
        # The module's own names, and Path for a module that only annotates with it.
        value = eval(documented, {"Path": Path, **scope})
    except Exception:
        return False
    try:
        return bool(value == actual)
    except Exception:
        return False


def _shown(params: list[tuple[str, str, Any]], *, code: bool) -> str:
    """A parameter list as the messages show it: ``(a, b=1, *, c)``; a documented default as
    written, the code's as its repr."""
    parts: list[str] = []
    star = False
    for name, kind, default in params:
        if kind == str(inspect.Parameter.KEYWORD_ONLY) and not star:
            parts.append("*")
            star = True
        prefix = {"VAR_POSITIONAL": "*", "VAR_KEYWORD": "**"}.get(kind, "")
        star = star or prefix == "*"
        absent = default is _MISSING if code else default is None
        shown = repr(default) if code else default
        parts.append(prefix + name + ("" if absent else f"={shown}"))
    return f"({', '.join(parts)})"


def _compare_params(
    what: str,
    node: ast.FunctionDef | ast.AsyncFunctionDef,
    actual: Any,
    scope: dict[str, Any],
    *,
    drop_first: bool = False,
) -> list[str]:
    try:
        signature = inspect.signature(actual)
    except (TypeError, ValueError):
        return [f"{what}: documented as callable, but inspect.signature cannot read the code's"]
    problems = _compare_async(what, node, actual)
    documented = _documented_params(node.args)[1 if drop_first else 0 :]
    # A dataclass's signature shows a default factory as "<factory>": compare what it makes.
    factories = (
        {f.name: _field_default(f) for f in dataclasses.fields(actual)}
        if inspect.isclass(actual) and dataclasses.is_dataclass(actual)
        else {}
    )
    code: list[tuple[str, str, object]] = [
        (
            p.name,
            str(p.kind),
            _MISSING if p.default is p.empty else factories.get(p.name, p.default),
        )
        for p in signature.parameters.values()
    ]
    same = len(documented) == len(code) and all(
        d[0] == c[0] and d[1] == c[1] and _same_default(d[2], c[2], scope)
        for d, c in zip(documented, code, strict=True)
    )
    if same:
        return problems
    return [
        *problems,
        f"{what}: documented {_shown(documented, code=False)}, the code has {_shown(code, code=True)}",
    ]


def _compare_async(
    what: str, node: ast.FunctionDef | ast.AsyncFunctionDef, actual: Any
) -> list[str]:
    """``async def`` where the code's is a coroutine or async generator function, and only there
    (a decorated context manager or a class is called plainly whatever the page shows)."""
    if (
        getattr(node, "inline", False)
        or inspect.isclass(actual)
        or any("contextmanager" in ast.unparse(d) for d in node.decorator_list)
    ):
        return []
    function = getattr(actual, "_get_wrapped_function", lambda: actual)()  # a pytest fixture
    code = inspect.iscoroutinefunction(function) or inspect.isasyncgenfunction(function)
    documented = isinstance(node, ast.AsyncFunctionDef)
    if code == documented:
        return []
    return [
        f"{what}: documented {'async ' if documented else ''}def, the code's is {'async ' if code else ''}def"
    ]


def _field_default(field: dataclasses.Field[Any]) -> object:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        made = field.default_factory()
        return made if made == field.default_factory() else _Made()
    return _MISSING


def _compare_class(entry: Entry, node: ast.ClassDef, cls: type, scope: dict[str, Any]) -> list[str]:
    decorator = next(
        (ast.unparse(d) for d in node.decorator_list if "dataclass" in ast.unparse(d)), None
    )
    documented_dataclass = decorator is not None
    problems: list[str] = []
    if documented_dataclass != dataclasses.is_dataclass(cls):
        shown = "a dataclass" if documented_dataclass else "a plain class"
        problems.append(f"{entry.where}: documented as {shown}, the code says otherwise")
    elif decorator is not None:
        params = cls.__dataclass_params__  # type: ignore[attr-defined]
        code = {"frozen": params.frozen, "slots": "__slots__" in vars(cls)}
        shown = {key: f"{key}=True" in decorator for key in code}
        if shown != code:
            problems.append(f"{entry.where}: documented {decorator}, the code's is {code}")
    fields = [
        (s.target.id, None if s.value is None else ast.unparse(s.value))
        for s in node.body
        if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
    ]
    if dataclasses.is_dataclass(cls) and documented_dataclass:
        problems += _compare_fields(entry.where, fields, cls, scope)
    else:
        problems += _compare_attributes(entry.where, fields, cls, scope)
    for method in node.body:
        if isinstance(method, ast.FunctionDef | ast.AsyncFunctionDef):
            problems += _compare_method(f"{entry.where}: `{method.name}`", method, cls, scope)
    return problems


def _compare_fields(
    what: str, fields: list[tuple[str, str | None]], cls: type, scope: dict[str, Any]
) -> list[str]:
    code = [(f.name, _field_default(f)) for f in dataclasses.fields(cls)]
    same = len(fields) == len(code) and all(
        d[0] == c[0] and _same_default(d[1], c[1], scope) for d, c in zip(fields, code, strict=True)
    )
    if same:
        return []
    return [
        f"{what}: documented fields {_fields(fields, code=False)}, "
        f"the code has {_fields(code, code=True)}"
    ]


def _compare_attributes(
    what: str, fields: list[tuple[str, str | None]], cls: type, scope: dict[str, Any]
) -> list[str]:
    """A plain class's documented attributes: on the class, annotated, or set in ``__init__``."""
    problems: list[str] = []
    annotated = {n for k in cls.__mro__ for n in getattr(k, "__annotations__", {})}
    source = inspect.getsource(cls)
    for name, default in fields:
        assigned = re.search(rf"self\.{name}\b(: [^=]+)? =", source)
        value = getattr(cls, name, _MISSING)
        if name not in annotated and value is _MISSING and not assigned:
            problems.append(f"{what}: documented attribute `{name}`, the class has none")
        elif default is not None and not _same_default(default, value, scope):
            shown = "no class-level value" if value is _MISSING else repr(value)
            problems.append(
                f"{what}: attribute `{name}` documented as {default}, the class has {shown}"
            )
    return problems


def _compare_method(
    what: str, method: ast.FunctionDef | ast.AsyncFunctionDef, cls: type, scope: dict[str, Any]
) -> list[str]:
    static = inspect.getattr_static(cls, method.name, _MISSING)
    if static is _MISSING:
        return [f"{what} is documented, the class has no such member"]
    if any(ast.unparse(d) == "property" for d in method.decorator_list):
        if isinstance(static, property):
            return []
        return [f"{what} is documented as a property, the class's is not one"]
    # A classmethod read from the class is bound: its documented ``cls`` is not shown.
    bound = isinstance(static, classmethod)
    return _compare_params(what, method, getattr(cls, method.name), scope, drop_first=bound)


def _fields(fields: list[tuple[str, Any]], *, code: bool) -> str:
    return _shown([(name, "POSITIONAL_OR_KEYWORD", default) for name, default in fields], code=code)


def check_entry(entry: Entry) -> list[str]:
    """What the entry misstates about the code (nothing: it is true)."""
    module = importlib.import_module(entry.module)
    if entry.name not in getattr(module, "__all__", ()):
        return [f"{entry.where}: not in {entry.module}.__all__ (a name that moved or was renamed?)"]
    obj = getattr(module, entry.name)
    node = entry.signature
    if node is None:
        return []
    scope = vars(inspect.getmodule(obj) or module)
    if isinstance(node, ast.ClassDef):
        if not inspect.isclass(obj):
            return [f"{entry.where}: documented as a class, the code's is {type(obj).__name__}"]
        return _compare_class(entry, node, obj, scope)
    assert isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
    return _compare_params(entry.where, node, obj, scope)


# ----------------------------------------------------------------------------- the tests

ENTRIES = entries(API_MD.read_text())


def public_modules() -> list[str]:
    return [
        name
        for name in sdk_modules()
        if not is_private(name) and not name.startswith("devplugin_sdk.api")
    ]


def test_every_entry_names_a_public_object_with_its_documented_signature() -> None:
    problems = [problem for entry in ENTRIES for problem in check_entry(entry)]
    assert not problems, "docs/api.md misstates the code:\n" + "\n".join(problems)


def test_every_public_name_has_an_entry() -> None:
    documented: dict[str, list[tuple[str, object]]] = {}
    for entry in ENTRIES:
        module = importlib.import_module(entry.module)
        documented.setdefault(entry.name, []).append(
            (entry.module, getattr(module, entry.name, _MISSING))
        )
    missing: list[str] = []
    for name in public_modules():
        module = importlib.import_module(name)
        for item in module.__all__:
            value = getattr(module, item)
            if not any(obj is value for _, obj in documented.get(item, [])):
                missing.append(
                    f"`{item}` ({name}.__all__): add a `### `{item}`` entry under `## `{name}``"
                    " (or under the section of a public module that re-exports it)"
                )
    assert not missing, "docs/api.md does not document:\n" + "\n".join(missing)


def test_every_section_is_a_public_module_and_holds_only_entries() -> None:
    text = API_MD.read_text()
    sections = re.findall(r"^## `([\w.]+)`$", text, re.M)
    public = set(public_modules())
    assert [s for s in sections if s not in public] == []
    assert len(sections) == len(set(sections)), "a module has two sections"
    # Inside a module's section every sub-heading is an entry: prose goes in the entries.
    module = ""
    loose = []
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("## "):
            module = line
        elif module.startswith("## `") and re.match(r"#{3,6} ", line) and not _ENTRY.match(line):
            loose.append(f"docs/api.md:{number}: {line!r} is not an entry heading")
    assert loose == []


# ----------------------------------------------------------------------------- the checker itself


@pytest.mark.parametrize(
    ("page", "problem"),
    [
        (
            "### `run`\n\n```python\ndef run(*plugins, settings=None)\n```\n",
            "the code has (*plugins, settings=None, observer=None",
        ),
        (
            "### `replicate`\n\n`replicate(devices, replicas=2)`: ...\n",
            "documented (devices, replicas=2), the code has (devices, replicas)",
        ),
        (
            "### `Mount`\n\n```python\n@dataclass\nclass Mount:\n    host_path: str\n    read_only: bool = False\n```\n",
            "documented fields (host_path, read_only=False), the code has (host_path, container_path='', read_only=False)",
        ),
        ("### `Nothing`\n", "`Nothing` (## `devplugin_sdk`): not in devplugin_sdk.__all__"),
        (
            "### `Allocation`\n\n```python\nclass Allocation:\n    @classmethod\n    def merge(cls, devices, strict=False) -> Allocation\n```\n",
            "`merge`: documented (devices, strict=False), the code has (devices)",
        ),
    ],
    ids=["missing-parameters", "wrong-default", "missing-field", "unknown-name", "method"],
)
def test_the_checker_names_what_an_entry_misstates(page: str, problem: str) -> None:
    (entry,) = entries("## `devplugin_sdk`\n\n" + page)
    assert any(problem in p for p in check_entry(entry)), check_entry(entry)


def test_the_checker_accepts_a_true_entry() -> None:
    page = (
        "## `devplugin_sdk`\n\n### `DeviceNode` and `replicate`\n\n```python\n"
        "@dataclass(frozen=True, slots=True)\nclass DeviceNode:\n    host_path: str\n"
        '    container_path: str = ""\n    permissions: str = "rw"\n\n'
        "def replicate(devices: Iterable[Device], replicas: int) -> list[Device]\n```\n"
    )
    found = entries(page)
    assert [(e.name, type(e.signature).__name__) for e in found] == [
        ("DeviceNode", "ClassDef"),
        ("replicate", "FunctionDef"),
    ]
    assert [p for e in found for p in check_entry(e)] == []
