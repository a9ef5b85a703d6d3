"""Reading a configuration file safely: regular files only, bounded size, depth and aliases,
duplicate keys refused, every error one bounded line naming the key or the file."""

from __future__ import annotations

import errno
import gc
import os
import re
import threading
from pathlib import Path

import pytest
import yaml

from devplugin_sdk import _yaml
from devplugin_sdk.backends import generic
from devplugin_sdk.cli.runfile import SDK_KEYS, parse_run_config
from devplugin_sdk.config import (
    MAX_DEPTH,
    MAX_FILE_BYTES,
    MAX_NODES,
    load_yaml,
    parse_yaml,
    read_file,
)
from devplugin_sdk.errors import ConfigError

# 389 bytes that expand to 9**9 strings (issue 12, row 1), here under a key a backend reads.
ALIAS_BOMB = """\
a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]
b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]
c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]
d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]
e: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]
f: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]
g: &g [*f,*f,*f,*f,*f,*f,*f,*f,*f]
h: &h [*g,*g,*g,*g,*g,*g,*g,*g,*g]
metrics: {port: *h}
"""


def _error(call: object, *args: object) -> ConfigError:
    with pytest.raises(ConfigError) as caught:
        call(*args)  # type: ignore[operator]
    message = str(caught.value)
    assert "\n" not in message
    assert len(message) < 400, message
    return caught.value


# ----------------------------------------------------------------------------- the file


def test_a_regular_file_is_read(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("resources: []\n")
    assert load_yaml(path) == {"resources": []}
    assert load_yaml(str(path)) == {"resources": []}


def test_a_symlinked_file_is_followed_as_a_configmap_needs(tmp_path: Path) -> None:
    # A ConfigMap volume: config.yaml -> ..data/config.yaml, ..data -> ..2024_01_01.
    (tmp_path / "..2024_01_01").mkdir()
    (tmp_path / "..2024_01_01" / "config.yaml").write_text("backend: generic\n")
    (tmp_path / "..data").symlink_to("..2024_01_01")
    (tmp_path / "config.yaml").symlink_to("..data/config.yaml")
    assert load_yaml(tmp_path / "config.yaml") == {"backend": "generic"}


def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path: Path) -> None:
    fifo = tmp_path / "config.yaml"
    os.mkfifo(fifo)
    # Opening a FIFO for reading blocks until a writer comes: run it where a hang cannot
    # hang the test, and let the test fail on the join timeout instead.
    found: list[BaseException] = []
    thread = threading.Thread(target=lambda: found.append(_error(load_yaml, fifo)), daemon=True)
    thread.start()
    thread.join(timeout=10)
    assert not thread.is_alive(), "load_yaml blocked on a FIFO"
    assert "not a regular file but a FIFO" in str(found[0])


def test_a_symlink_to_dev_zero_is_refused_without_reading(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.symlink_to("/dev/zero")
    error = _error(load_yaml, path)
    assert error.key == str(path)
    assert error.reason == "not a regular file but a character device"


def test_a_directory_is_refused(tmp_path: Path) -> None:
    assert "not a regular file but a directory" in str(_error(load_yaml, tmp_path))


def test_a_missing_file_says_so(tmp_path: Path) -> None:
    error = _error(load_yaml, tmp_path / "x")
    assert error.key == str(tmp_path / "x")
    assert error.reason == f"cannot read: {os.strerror(errno.ENOENT)}"  # the errno, in libc words


def test_a_file_over_the_size_cap_is_refused_unread(tmp_path: Path) -> None:
    path = tmp_path / "big.yaml"
    path.write_bytes(b"#" * (MAX_FILE_BYTES + 1))
    error = _error(load_yaml, path)
    assert f"{MAX_FILE_BYTES + 1} bytes is larger than the {MAX_FILE_BYTES} bytes" in str(error)
    path.write_bytes(b"#" * MAX_FILE_BYTES)  # exactly at the cap: fine (a comment)
    assert load_yaml(path) == {}


def test_read_file_never_reads_past_its_limit(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_bytes(b"x" * 100)
    assert read_file(path, limit=100) == b"x" * 100
    assert "larger than the 99 bytes" in str(_error(read_file, path, 99))


def test_text_that_is_not_utf8_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_bytes(b"a: \xff\n")
    assert "not UTF-8 text (byte 3)" in str(_error(load_yaml, path))


# ----------------------------------------------------------------------------- the YAML


def test_libyaml_is_used_when_installed() -> None:
    if not yaml.__with_libyaml__:  # pragma: no cover - CI images have it
        pytest.skip("PyYAML built without libyaml")
    assert _yaml._Loader is yaml.CSafeLoader


def test_a_duplicate_top_level_key_names_both_lines() -> None:
    text = "resources: []\nbackend: generic\nresources:\n  - resourceName: a.com/b\n"
    error = _error(parse_yaml, text, "/etc/x.yaml")
    assert error.key == "resources"
    assert error.reason.startswith("given twice, at lines 1 and 3 of /etc/x.yaml")


def test_a_duplicate_nested_key_names_its_dotted_key() -> None:
    text = "resources:\n  - resourceName: a.com/b\n    paths: []\n    resourceName: a.com/c\n"
    assert _error(parse_yaml, text).key == "resources[0].resourceName"
    assert _error(parse_yaml, "x: {a: 1, b: 2, a: 3}\n").key == "x.a"


def test_keys_are_compared_as_values() -> None:
    assert _error(parse_yaml, "1: a\n0x1: b\n").key == "1"  # both the integer 1
    assert parse_yaml("1: a\n'1': b\n") == {1: "a", "1": "b"}


def test_merge_keys_may_be_overridden() -> None:
    text = "base: &b {share: 1, paths: [x]}\nr: {<<: *b, share: 2}\n"
    assert parse_yaml(text)["r"] == {"share": 2, "paths": ["x"]}


def test_small_aliases_are_fine() -> None:
    text = "a: &p ['/dev/x', '/dev/y']\nb: *p\n"
    assert parse_yaml(text) == {"a": ["/dev/x", "/dev/y"], "b": ["/dev/x", "/dev/y"]}


def test_an_alias_bomb_is_refused_before_it_expands() -> None:
    error = _error(parse_yaml, ALIAS_BOMB, "bomb.yaml")
    assert error.key == "bomb.yaml"
    assert f"aliases expand to more than {MAX_NODES} nodes (at line 5)" in error.reason


def test_a_document_with_too_many_nodes_is_refused_before_it_is_built() -> None:
    text = "x: [" + ",".join(["1"] * (MAX_NODES + 1)) + "]\n"  # 100 KB, 300 MB once composed
    error = _error(parse_yaml, text, "big.yaml")
    assert f"more than {MAX_NODES} nodes (lists, mappings and values) by line 1" in error.reason
    ok = "x: [" + ",".join(["1"] * (MAX_NODES - 3)) + "]\n"
    assert len(parse_yaml(ok)["x"]) == MAX_NODES - 3  # and the mapping, its key, the list


def test_a_recursive_alias_is_refused() -> None:
    assert "recursive alias *x at line 1" in str(_error(parse_yaml, "a: &x [1, *x]\n"))


DEEP = "a: " + "[" * 100_000 + "]" * 100_000 + "\n"


def test_deep_nesting_is_refused_before_libyaml_composes_it() -> None:
    # 100,000 levels crash libyaml's recursive composer (a segfault, not an exception). The
    # libyaml of some PyYAML wheels refuses 1,000 levels itself, ahead of the events we read:
    # the message is ours either way.
    error = _error(parse_yaml, DEEP, "deep.yaml")
    assert (error.key, error.reason) == (
        "deep.yaml",
        f"nesting deeper than {MAX_DEPTH} levels at line 1",
    )
    spread = "a:\n" + "  [\n" * 100_000 + "  ]\n" * 100_000  # a level a line
    error = _error(parse_yaml, spread, "deep.yaml")
    assert error.reason == f"nesting deeper than {MAX_DEPTH} levels at line {MAX_DEPTH + 1}"
    # A syntax error the scanner meets while it reads ahead does not hide the limit before it.
    bad = "a: " + "[" * (MAX_DEPTH + 50) + "@" + "]" * (MAX_DEPTH + 50) + "\n"
    assert _error(parse_yaml, bad).reason == f"nesting deeper than {MAX_DEPTH} levels at line 1"
    ok = "a: " + "[" * MAX_DEPTH + "]" * MAX_DEPTH + "\n"  # the top mapping is one level
    with pytest.raises(ConfigError):
        parse_yaml(ok)
    ok = "a: " + "[" * (MAX_DEPTH - 1) + "]" * (MAX_DEPTH - 1) + "\n"
    assert isinstance(parse_yaml(ok)["a"], list)


def _libyaml_refusing(levels: int) -> type:
    """The SDK's loader, made to refuse ``levels`` levels of nesting on a line in its own
    words before it hands over their events, as the libyaml of PyYAML 6.0.4's wheels does
    at 1,000 levels while it scans ahead: the same test whichever PyYAML is installed."""

    class Loader(_yaml._Loader):  # type: ignore[misc]
        def __init__(self, stream: str) -> None:
            super().__init__(stream)
            run = stream.find("[" * levels)
            self.refuse_at = None if run < 0 else run + levels - 1

        def check_event(self, *choices: type[yaml.Event]) -> bool:
            if self.refuse_at is not None:
                at = yaml.Mark("<unicode string>", self.refuse_at, 0, self.refuse_at, None, 0)
                raise yaml.scanner.ScannerError("while nesting", at, "libyaml's own words", at)
            return bool(super().check_event(*choices))

    return Loader


def test_our_limit_is_reported_where_libyaml_refuses_deeper_nesting_itself(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_yaml, "_Loader", _libyaml_refusing(1000))
    error = _error(parse_yaml, DEEP, "deep.yaml")
    assert (error.key, error.reason) == (
        "deep.yaml",
        f"nesting deeper than {MAX_DEPTH} levels at line 1",
    )
    # A refusal of libyaml's that comes before our limit stays libyaml's, where it is.
    monkeypatch.setattr(_yaml, "_Loader", _libyaml_refusing(MAX_DEPTH // 2))
    error = _error(parse_yaml, DEEP, "deep.yaml")
    assert error.key == "deep.yaml"
    assert re.fullmatch(rf"invalid YAML at line 1, column {3 + MAX_DEPTH // 2}: .+", error.reason)


def test_nesting_through_aliases_counts() -> None:
    deep = "[" * 60 + "]" * 60
    text = f"a: &a {deep}\nb: [{'[' * 50}*a{']' * 50}]\n"
    assert "(through an alias)" in str(_error(parse_yaml, text))


def test_syntax_errors_name_the_line() -> None:
    error = _error(parse_yaml, "resources:\n  - name: [unclosed\n", "f.yaml")
    assert error.key == "f.yaml"
    # Where the parser stopped, its problem in its words, and where the unclosed list began.
    assert re.fullmatch(r"invalid YAML at line 3, column 1: .+ \(.+ from line 2\)", error.reason)


def test_control_characters_are_a_one_line_error() -> None:
    error = _error(parse_yaml, 'a: "\0"\n', "f.yaml")  # one line: see _error
    assert error.key == "f.yaml"
    assert error.reason.startswith("invalid YAML: ")


def test_only_safe_tags() -> None:
    error = _error(parse_yaml, "a: !!python/object:os.system x\n", "f.yaml")
    assert error.key == "f.yaml"
    assert re.fullmatch(r"invalid YAML at line 1, column 4: .+", error.reason)


def test_the_top_level_must_be_a_mapping() -> None:
    assert "must be a mapping, got list" in str(_error(parse_yaml, "- 1\n"))
    assert parse_yaml("") == {}
    assert parse_yaml("# nothing\n") == {}


# ----------------------------------------------------------------------------- messages


def test_error_messages_never_spell_out_a_big_value() -> None:
    huge = "x" * 100_000
    error = _error(parse_run_config, {"registration": huge})
    assert error.key == "registration"
    many = list(range(10_000))
    assert "<list of 10000 items>" in str(_error(parse_run_config, {"metrics": {"port": many}}))


def test_a_misspelt_sdk_key_is_suggested_with_every_valid_key() -> None:
    options = parse_run_config(
        {"loging": {"level": "debug"}, "resources": [{"resourceName": "a.com/b", "paths": ["/x"]}]}
    ).backend_options
    error = _error(generic.from_config, options)
    assert error.key == "loging"
    assert "did you mean 'logging'?" in error.reason
    backend_keys = re.search(r"the backend's keys \((.*?)\)", error.reason)
    assert backend_keys is not None, error.reason
    assert "resources" in backend_keys.group(1).split(", ")
    assert f"the SDK's ({', '.join(SDK_KEYS)})" in error.reason


def test_a_backend_called_directly_lists_only_its_own_keys() -> None:
    error = _error(generic.from_config, {"loging": {}, "resources": []})
    assert re.search(r"expected one of [\w, ]*\bresources\b", error.reason), error.reason
    assert "SDK" not in error.reason


def test_the_garbage_collector_is_paused_only_while_parsing() -> None:
    """Full collections triggered by the nodes would stall the event loop (GIL); the
    collector comes back on afterwards, even after an error, and stays off if it was off."""
    seen: list[bool] = []
    original = _yaml._check_duplicate_keys

    def spy(*args: object) -> None:
        seen.append(gc.isenabled())
        original(*args)  # type: ignore[arg-type]

    _yaml._check_duplicate_keys = spy  # type: ignore[assignment]
    try:
        assert gc.isenabled()
        parse_yaml("a: 1\n")
        assert seen == [False]
        assert gc.isenabled()
        with pytest.raises(ConfigError):
            parse_yaml("a: 1\na: 2\n")
        assert gc.isenabled()
        gc.disable()
        try:
            parse_yaml("a: 1\n")
            assert not gc.isenabled()
        finally:
            gc.enable()
    finally:
        _yaml._check_duplicate_keys = original  # type: ignore[assignment]
