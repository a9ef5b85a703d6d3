"""The SDK's one YAML reader, hardened: ``load_yaml`` reads a file with ``read_file`` (regular
files of at most ``MAX_FILE_BYTES``, never blocking on a FIFO) and ``parse_yaml`` parses it with
libyaml when installed, bounding nesting (``MAX_DEPTH``) and nodes with aliases expanded
(``MAX_NODES``), refusing duplicate keys and pausing the garbage collector while nodes exist,
because a config file is input that an operator (or an attacker on the node) can get wrong in
every way. ``devplugin_sdk.config`` re-exports its public names.
"""

from __future__ import annotations

import contextlib
import gc
import os
import reprlib
import threading
from collections.abc import Iterator, Mapping
from typing import Any

import yaml

from devplugin_sdk._files import read_file
from devplugin_sdk.errors import ConfigError

__all__ = ["MAX_DEPTH", "MAX_NODES", "load_yaml", "parse_yaml", "shown"]

#: The deepest nesting of lists and mappings: libyaml's composer recurses in C (a deeper file
#: crashes the process) and its scanner slows down with the square of the depth.
MAX_DEPTH = 100
#: The most nodes (lists, mappings and values) a document may have, aliases (``*name``)
#: expanded. A parsed node costs about half a kilobyte until the document is built, so a mebibyte
#: of ``[1,1,1,...]`` would take 300 MB; a 400-byte "billion laughs" file expands to billions,
#: and anything that walks the result (validation, an error message) would take that long.
#: Real configurations have a few hundred.
MAX_NODES = 20_000

# libyaml's parser when PyYAML was built with it (about 3.5 times faster), else pure Python.
_Loader: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_MERGE_TAG = "tag:yaml.org,2002:merge"
_MESSAGE_LIMIT = 200  # characters of a YAML library message quoted in an error


def load_yaml(path: str | os.PathLike[str]) -> Mapping[str, Any]:
    """Read a YAML mapping from the regular file ``path`` (``read_file``, then ``parse_yaml``).

    Blocking: a caller on an event loop runs it in a worker thread
    (``anyio.to_thread.run_sync``), as ``devplugin run``'s reload does.

    Raises:
        ConfigError: unreadable or unsafe file (see ``read_file``), not UTF-8, YAML syntax error
            (with line and column), nesting or aliases over the limits, a duplicate key, or not
            a mapping.
    """
    name = os.fspath(path)
    data = read_file(name)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(name, f"not UTF-8 text (byte {exc.start})") from None
    return parse_yaml(text, name)


def parse_yaml(
    text: str, source: str = "<text>", *, max_nodes: int = MAX_NODES
) -> Mapping[str, Any]:
    """Parse YAML text whose top level is a mapping (an empty document is ``{}``).

    The safe loader (libyaml's when available) with three more checks: nesting at most
    ``MAX_DEPTH`` deep, at most ``MAX_NODES`` nodes with aliases expanded (a recursive alias is
    refused), and no key twice in one mapping (YAML would silently keep the last).

    Args:
        text: The document.
        source: What errors name when the problem is not a key (the file's path).
        max_nodes: The node bound, aliases expanded: ``MAX_NODES`` for a configuration, more
            for a dump of a cluster's objects (``devplugin dra check --slices``).

    Raises:
        ConfigError: as ``load_yaml``.
    """
    try:
        with _collector_paused():
            data = _load(text, source, max_nodes)
    except yaml.MarkedYAMLError as exc:
        raise ConfigError(source, f"invalid YAML{_where(exc)}: {_problem(exc)}") from None
    except yaml.YAMLError as exc:
        # A reader error spans lines ("... in <unicode string>, position 4"): one line here.
        raise ConfigError(source, f"invalid YAML: {_cut(' '.join(str(exc).split()))}") from None
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise ConfigError(source, f"the top level must be a mapping, got {type(data).__name__}")
    return data


def _load(text: str, source: str, max_nodes: int) -> Any:
    """The checked document; its nodes are gone when this returns."""
    _check_structure(text, source, max_nodes)
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_duplicate_keys(loader, node, source)
        return loader.construct_document(node)
    finally:
        loader.dispose()


_collector_lock = threading.Lock()
_collector_users = 0
_collector_was_enabled = False


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Keep Python's cyclic garbage collector off while a document's nodes exist.

    Tens of thousands of short-lived nodes trigger full collections, and a full collection
    holds the GIL for tens of milliseconds: the event loop, serving Allocate in another thread,
    waits that long (measured with a 0.5 MB file: the loop's worst wake-up went from 44 ms to
    10 ms without them). The nodes form no cycles (a recursive alias is refused), so reference
    counting frees them. Nested or concurrent parses share one pause; the collector is turned
    back on only if it was on.
    """
    global _collector_users, _collector_was_enabled  # noqa: PLW0603 - one process-wide switch
    with _collector_lock:
        if _collector_users == 0:
            _collector_was_enabled = gc.isenabled()
            gc.disable()
        _collector_users += 1
    try:
        yield
    finally:
        with _collector_lock:
            _collector_users -= 1
            if _collector_users == 0 and _collector_was_enabled:
                gc.enable()


def _check_structure(text: str, source: str, max_nodes: int) -> None:
    """Refuse deep nesting and alias expansion over the limits before anything composes nodes.

    Reads the parser's events one by one, which costs a tenth of a full load and stops at the
    first excess: composing a 100,000-deep list would crash libyaml's recursive composer.
    A syntax error the parser finds ahead of its events gives way to one of our limits reached
    before it, so that a file's first problem is reported, in our words.
    """
    try:
        _check_events(text, source, max_nodes)
    except yaml.MarkedYAMLError as exc:
        refused = exc
    else:
        return
    # The scanner reads up to 1,024 characters of a line ahead of the events it hands over
    # and stops at the first error there, so a limit of ours reached in that stretch went
    # unseen. The libyaml of PyYAML 6.0.4's wheels also refuses 1,000 levels of nesting there,
    # in its own words: a 100,000-deep line was refused before its 101st level reached us.
    # Read again up to the error (a second read, of a file already refused), the text reaches
    # our limit if that came first; else the parser's error stands.
    if refused.problem_mark is not None:
        with contextlib.suppress(yaml.YAMLError):
            _check_events(text[: refused.problem_mark.index], source, max_nodes)
    raise refused


def _check_events(text: str, source: str, max_nodes: int) -> None:
    shape = _Shape(source, max_nodes)
    for event in yaml.parse(text, Loader=_Loader):
        shape.add(event)


class _Shape:
    """Node count and depth of a document as the parser's events describe it, aliases expanded."""

    def __init__(self, source: str, max_nodes: int = MAX_NODES) -> None:
        self.source = source
        self.max_nodes = max_nodes
        # Per open collection: [anchor, node count when it opened, its depth, the deepest
        # depth reached inside it (aliases expanded)].
        self.frames: list[list[Any]] = []
        self.sizes: dict[str, tuple[int, int]] = {}  # anchor -> (nodes, depth), expanded
        self.count = 0
        self.added = 0  # nodes added by aliases

    def add(self, event: yaml.Event) -> None:
        line = event.start_mark.line + 1 if event.start_mark is not None else 0
        if isinstance(event, yaml.CollectionStartEvent):
            self._count(1, line)
            self._reach(len(self.frames) + 1, line, "")
            depth = len(self.frames) + 1
            self.frames.append([event.anchor, self.count, depth, depth])
        elif isinstance(event, yaml.CollectionEndEvent):
            anchor, start, depth, deepest = self.frames.pop()
            if anchor is not None:
                self.sizes[anchor] = (self.count - start + 1, deepest - depth + 1)
            if self.frames:
                self.frames[-1][3] = max(self.frames[-1][3], deepest)
        elif isinstance(event, yaml.ScalarEvent):
            self._count(1, line)
            if event.anchor is not None:
                self.sizes[event.anchor] = (1, 0)
        elif isinstance(event, yaml.AliasEvent):
            self._alias(str(event.anchor), line)

    def _alias(self, anchor: str, line: int) -> None:
        if any(frame[0] == anchor for frame in self.frames):
            raise ConfigError(self.source, f"recursive alias *{_cut(anchor, 40)} at line {line}")
        nodes, depth = self.sizes.get(anchor, (1, 0))  # undefined: the composer says so
        self.added += nodes
        self._count(nodes, line)
        self._reach(len(self.frames) + depth, line, " (through an alias)")

    def _count(self, nodes: int, line: int) -> None:
        self.count += nodes
        if self.count <= self.max_nodes:
            return
        if self.added > self.max_nodes // 2:
            raise ConfigError(
                self.source,
                f"aliases expand to more than {self.max_nodes} nodes (at line {line}); "
                "write the values out or use fewer aliases",
            )
        what = "a configuration" if self.max_nodes == MAX_NODES else "a document"
        raise ConfigError(
            self.source,
            f"more than {self.max_nodes} nodes (lists, mappings and values) by line {line}; "
            f"{what} this big is refused",
        )

    def _reach(self, depth: int, line: int, how: str) -> None:
        if depth > MAX_DEPTH:
            raise ConfigError(
                self.source, f"nesting deeper than {MAX_DEPTH} levels at line {line}{how}"
            )
        if self.frames:
            self.frames[-1][3] = max(self.frames[-1][3], depth)


def _check_duplicate_keys(loader: Any, root: yaml.Node, source: str) -> None:
    """Refuse a key given twice in one mapping, naming it and both lines."""
    stack: list[tuple[yaml.Node, str]] = [(root, "")]
    seen: set[int] = set()  # an aliased node is checked once
    while stack:
        node, where = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, yaml.SequenceNode):
            stack.extend((item, f"{where}[{i}]") for i, item in enumerate(node.value))
            continue
        if not isinstance(node, yaml.MappingNode):
            continue
        lines: dict[Any, int] = {}
        for key_node, value_node in node.value:
            if key_node.tag == _MERGE_TAG:  # `<<: *base`: merged keys may be overridden
                stack.append((value_node, where))
                continue
            if not isinstance(key_node, yaml.ScalarNode):
                continue  # a complex key; the constructor refuses unhashable ones
            key = loader.construct_object(key_node)
            name = key if isinstance(key, str) else shown(key, 60)
            dotted = f"{where}.{_cut(name, 60)}" if where else _cut(name, 60)
            line = key_node.start_mark.line + 1
            try:
                first = lines.get(key)
            except TypeError:
                continue  # unhashable: the constructor says so
            if first is not None:
                raise ConfigError(
                    dotted,
                    f"given twice, at lines {first} and {line} of {source}; "
                    "YAML would silently keep only the last one",
                )
            lines[key] = line
            stack.append((value_node, dotted))


def _where(exc: yaml.MarkedYAMLError) -> str:
    mark = exc.problem_mark or exc.context_mark
    return f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""


def _problem(exc: yaml.MarkedYAMLError) -> str:
    problem = exc.problem or exc.context or "syntax error"
    if exc.problem and exc.context and exc.context_mark:
        # "while parsing a flow sequence", from where it started: often the real mistake.
        problem += f" ({exc.context} from line {exc.context_mark.line + 1})"
    return _cut(problem)


def _cut(text: str, limit: int = _MESSAGE_LIMIT) -> str:
    """``text`` cut to ``limit`` characters (a library message can quote the input)."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def shown(value: object, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters, for error messages.

    A value from a file can be huge (or a YAML alias bomb): an error message never spells it out.
    """
    if isinstance(value, (Mapping, list, tuple, set)) and len(value) > 16:
        return f"<{type(value).__name__} of {len(value)} items>"
    text = reprlib.repr(value) if isinstance(value, (Mapping, list, tuple, set)) else repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
