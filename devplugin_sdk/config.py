"""Reading configuration: ``ConfigReader`` for a backend's options, with the record of the keys
read that turns a key nobody asked for into an error with a did-you-mean.

A backend's ``from_config`` reads its options through ``ConfigReader``, whose errors name the
dotted key and the reason. (The ``devplugin run`` file itself, the SDK keys beside the backend's,
is parsed by ``devplugin_sdk.cli.runfile``.) The SDK's one YAML reader (``load_yaml``,
``parse_yaml`` and their limits) lives in ``_yaml`` and the bounded file reader in ``_files``;
both are public here.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from devplugin_sdk import _names
from devplugin_sdk._files import MAX_FILE_BYTES, read_file
from devplugin_sdk._intervals import LOOP_FLOOR
from devplugin_sdk._yaml import MAX_DEPTH, MAX_NODES, load_yaml, parse_yaml, shown
from devplugin_sdk.errors import ConfigError

__all__ = [
    "MAX_DEPTH",
    "MAX_FILE_BYTES",
    "MAX_NODES",
    "ConfigReader",
    "FileOptions",
    "load_yaml",
    "parse_yaml",
    "read_file",
    "shown",
]

_UNSET: Any = object()


class _Level:
    """One mapping of a document and the keys its readers asked for."""

    __slots__ = ("asked", "everything", "raw")

    def __init__(self, raw: Mapping[Any, Any]) -> None:
        self.raw = raw
        self.asked: dict[Any, None] = {}  # in the order asked, for messages
        self.everything = False  # iterated: every key was read

    def ask(self, key: object) -> None:
        with contextlib.suppress(TypeError):  # an unhashable key is no key of the mapping
            self.asked[key] = None

    def unread(self) -> list[Any]:
        if self.everything:
            return []
        return [key for key in self.raw if key not in self.asked]


class _Ledger:
    """Which keys of one document its readers looked up, per mapping (by dotted key).

    A key that no reader asked for is a typo, or a setting that does nothing: either way the
    operator must hear of it, and the backend need not list its keys for that (``known``).
    """

    __slots__ = ("levels", "sdk_keys")

    def __init__(self, sdk_keys: Sequence[str] = ()) -> None:
        self.levels: dict[str, _Level] = {}
        self.sdk_keys = tuple(sdk_keys)  # the other keys of a run file's top level

    def level(self, prefix: str, raw: Mapping[Any, Any]) -> _Level:
        level = self.levels.get(prefix)
        if level is None or level.raw is not raw:
            level = self.levels[prefix] = _Level(raw)
        return level

    def unread_error(self, under: str = "", *, typo_only: bool = False) -> ConfigError | None:
        """The error for the first key no reader asked for, at ``under`` or below; with
        ``typo_only``, only one whose level has a close asked-for key (when reading failed
        half-way, the other keys may just not have been reached)."""
        for prefix, level in self.levels.items():
            if under and prefix != under and not prefix.startswith((f"{under}.", f"{under}[")):
                continue
            sdk = self.sdk_keys if not prefix else ()
            names = [str(name) for name in level.asked if name not in sdk]
            for key in level.unread():
                if not typo_only:
                    return _unknown_key(prefix, key, names, sdk)
                # Close to a key that was asked for (not merely to one of the SDK's, which
                # were never asked here): the likely cause of the failure.
                if isinstance(key, str) and _closest(key[:60], names):
                    return _unknown_key(prefix, key, names, sdk)
        return None


def _unknown_key(prefix: str, key: object, names: Sequence[str], sdk: Sequence[str]) -> ConfigError:
    """``<dotted key>: unknown key; did you mean ...? expected one of ...``."""
    text = key[:60] if isinstance(key, str) else shown(key, 60)
    close = _closest(text, [*names, *sdk]) if isinstance(key, str) else None
    guess = f"did you mean {close!r}? " if close else ""
    expected = f"expected one of {', '.join(names)}" if names else "this mapping takes no keys"
    if sdk:
        expected = (
            f"expected one of the backend's keys ({', '.join(names)}) "
            f"or the SDK's ({', '.join(sdk)})"
        )
    return ConfigError(f"{prefix}.{text}" if prefix else text, f"unknown key; {guess}{expected}")


def _closest(name: str, candidates: Sequence[str]) -> str | None:
    import difflib  # noqa: PLC0415 - only for a bad key (cold start)

    close = difflib.get_close_matches(name, candidates, n=1)
    return close[0] if close else None


class _Watched(Mapping[str, Any]):
    """A reader's view of its mapping that records every key looked up (iterating reads all)."""

    __slots__ = ("_level",)

    def __init__(self, level: _Level) -> None:
        self._level = level

    def __getitem__(self, key: str) -> Any:
        self._level.ask(key)
        return self._level.raw[key]

    def get(self, key: str, default: Any = None) -> Any:
        self._level.ask(key)
        return self._level.raw.get(key, default)

    def __contains__(self, key: object) -> bool:
        self._level.ask(key)
        return key in self._level.raw

    def __iter__(self) -> Iterator[str]:
        self._level.everything = True
        return iter(self._level.raw)

    def __len__(self) -> int:
        return len(self._level.raw)

    def __repr__(self) -> str:
        return repr(self._level.raw)


class FileOptions(dict[str, Any]):
    """The backend's part of a ``devplugin run`` file (``RunConfig.backend_options``).

    A plain dict to the backend. Every ``ConfigReader`` made over it (and the backend's own
    lookups in it) records the keys it asks for: after ``from_config``, ``devplugin run`` calls
    ``check_read``, which refuses a key nobody asked for (a typo) and suggests the closest key
    read, or one of the file's other keys (``sdk_keys``, the SDK's), which share its top level.
    """

    __slots__ = ("_ledger", "_successor", "sdk_keys")

    def __init__(self, items: Iterable[tuple[str, Any]] = (), sdk_keys: Sequence[str] = ()) -> None:
        super().__init__(items)
        self.sdk_keys = tuple(sdk_keys)
        self._ledger: _Ledger | None = None
        self._successor: FileOptions | None = None

    def replaced_by(self, successor: FileOptions) -> None:
        """The backend reads ``successor`` instead (a translation of these options, such as the
        nvidia backend's of NVIDIA's own file): ``check_read`` and ``likely_typo`` judge it."""
        self._successor = successor

    def ledger(self) -> _Ledger:
        """The record of the keys read, shared by every reader of these options."""
        if self._ledger is None:
            self._ledger = _Ledger(self.sdk_keys)
            # A plain copy: iterating self would count as reading every key.
            self._ledger.level("", dict(dict.items(self)))
        return self._ledger

    def _level(self) -> _Level:
        return self.ledger().levels[""]

    def __getitem__(self, key: str) -> Any:
        self._level().ask(key)
        return super().__getitem__(key)

    def get(self, key: str, default: Any = None) -> Any:
        self._level().ask(key)
        return super().get(key, default)

    def __contains__(self, key: object) -> bool:
        self._level().ask(key)
        return super().__contains__(key)

    def __iter__(self) -> Iterator[str]:
        self._level().everything = True
        return super().__iter__()

    def __setitem__(self, key: str, value: Any) -> None:
        super().__setitem__(key, value)
        if self._ledger is not None:  # readers made from now on see the change
            level = self._ledger.levels[""]
            level.raw = {**level.raw, key: value}

    def __delitem__(self, key: str) -> None:
        super().__delitem__(key)
        if self._ledger is not None:
            level = self._ledger.levels[""]
            level.raw = {k: v for k, v in level.raw.items() if k != key}

    def keys(self) -> Any:
        self._level().everything = True
        return super().keys()

    def items(self) -> Any:
        self._level().everything = True
        return super().items()

    def values(self) -> Any:
        self._level().everything = True
        return super().values()

    def check_read(self) -> None:
        """Refuse a key that no reader (and no lookup of the backend's own) asked for.

        Nothing is checked when nothing was asked at all: a backend that reads its mapping in
        ways that cannot be seen (a C extension, a copy) is not blamed for it.

        Raises:
            ConfigError: ``<key>: unknown key; did you mean ...? expected one of ...``.
        """
        if self._successor is not None:
            self._successor.check_read()
            return
        ledger = self.ledger()
        if not any(level.asked or level.everything for level in ledger.levels.values()):
            return
        error = ledger.unread_error()
        if error is not None:
            raise error

    def likely_typo(self) -> ConfigError | None:
        """After reading failed half-way: the error for an unread key close to one that was
        asked for (``resourcess`` when ``resources`` is missing), the likelier first mistake."""
        if self._successor is not None:
            return self._successor.likely_typo()
        return self.ledger().unread_error(typo_only=True)


class ConfigReader:
    """Typed reads from one level of a YAML mapping; every error names the dotted key.

    The one reader every backend's ``from_config`` uses, so that keys, types and ranges are
    checked the same way everywhere: ``reader.section("health").number("probeInterval", 5)``
    fails with ``ConfigError("health.probeInterval", "must be a number of seconds, got 'x'")``.

    Args:
        data: The mapping (None reads as empty).
        prefix: Its dotted key (``""`` at the top level, ``resources[2]`` in a list).

    Raises:
        ConfigError: ``data`` is not a mapping.
    """

    def __init__(self, data: object, prefix: str = "") -> None:
        if data is None:
            data = {}
        if not isinstance(data, Mapping):
            raise ConfigError(prefix or "<root>", f"must be a mapping, got {type(data).__name__}")
        if isinstance(data, FileOptions) and not prefix:
            self._ledger = data.ledger()
            self._level = self._ledger.levels[""]
        else:
            if isinstance(data, _Watched):  # another reader's view: the same mapping
                data = data._level.raw
            self._ledger = _Ledger()
            self._level = self._ledger.level(prefix, data)
        #: The mapping; each key looked up in it counts as read (iterating it reads them all).
        self.data: Mapping[str, Any] = _Watched(self._level)
        self.prefix = prefix

    def _child(self, data: object, prefix: str) -> ConfigReader:
        """The reader of a nested mapping, sharing this reader's record of keys read."""
        if data is None:
            data = {}
        if not isinstance(data, Mapping):
            raise ConfigError(prefix, f"must be a mapping, got {type(data).__name__}")
        child = ConfigReader.__new__(ConfigReader)
        child._ledger = self._ledger
        child._level = self._ledger.level(prefix, data)
        child.data = _Watched(child._level)
        child.prefix = prefix
        return child

    def __enter__(self) -> ConfigReader:
        return self

    def __exit__(self, kind: object, exc: BaseException | None, tb: object) -> None:
        """Leaving the block: ``check_unread``; on a ``ConfigError``, a typo that probably
        caused it is reported instead (``resourcess`` when ``resources`` is required)."""
        if exc is None:
            self.check_unread()
        elif isinstance(exc, ConfigError):
            typo = self._ledger.unread_error(self.prefix, typo_only=True)
            if typo is not None:
                raise typo from None

    def check_unread(self) -> None:
        """Refuse a key of this mapping, or of a mapping read through it, that nothing asked for.

        Every lookup counts: a typed read, ``has``, ``section``, ``known``, ``data[...]``;
        iterating ``data`` counts as reading every key (a free-form mapping).

        Raises:
            ConfigError: ``<dotted key>: unknown key; did you mean ...? expected one of ...``.
        """
        error = self._ledger.unread_error(self.prefix)
        if error is not None:
            raise error

    def key(self, name: str) -> str:
        """The dotted key of ``name`` at this level."""
        return f"{self.prefix}.{name}" if self.prefix else name

    def has(self, name: str) -> bool:
        """Whether ``name`` is set (to anything but null)."""
        return self.data.get(name) is not None

    def known(self, *names: str, hint: Mapping[str, str] | None = None) -> None:
        """Reject keys other than ``names`` (``hint`` gives a reason for specific keys).

        The error names the unknown key, the closest known one and every known one.
        """
        hints = hint or {}
        for name in names:
            self._level.ask(name)
        # The top level of a `devplugin run` file also holds the SDK's keys: a misspelt one
        # (`loging`) is suggested and listed too.
        sdk = self._ledger.sdk_keys if not self.prefix else ()
        for name in self._level.raw:
            if name in hints:
                raise ConfigError(self.key(str(name)), hints[name])
            if name not in names:
                raise _unknown_key(self.prefix, name, names, sdk)

    def section(self, name: str) -> ConfigReader:
        """The reader of a nested mapping (empty when the key is absent or null)."""
        return self._child(self.data.get(name), self.key(name))

    def sections(self, name: str, *, required: bool = False) -> list[ConfigReader]:
        """Readers of a list of mappings, keyed ``name[0]``, ``name[1]``...

        Raises:
            ConfigError: not a list, an item not a mapping, or (``required``) missing or empty.
        """
        value = self.data.get(name)
        if value is None and not required:
            return []
        if not isinstance(value, list) or (required and not value):
            raise ConfigError(self.key(name), f"must be a non-empty list, got {shown(value)}")
        return [self._child(item, f"{self.key(name)}[{i}]") for i, item in enumerate(value)]

    def boolean(self, name: str, default: bool) -> bool:
        value = self.data.get(name, default)
        if not isinstance(value, bool):
            raise ConfigError(self.key(name), f"must be true or false, got {shown(value)}")
        return value

    def integer(self, name: str, default: int, *, minimum: int, maximum: int | None = None) -> int:
        value = self.data.get(name, default)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(self.key(name), f"must be an integer, got {shown(value)}")
        if value < minimum:
            raise ConfigError(self.key(name), f"must be >= {minimum}, got {value}")
        if maximum is not None and value > maximum:
            raise ConfigError(self.key(name), f"must be <= {maximum}, got {value}")
        return value

    def number(
        self, name: str, default: float | None, *, positive: bool = False, nullable: bool = False
    ) -> float | None:
        """A number of seconds (``>= 0``, or ``> 0`` when ``positive``); None if ``nullable``."""
        value = self.data.get(name, default)
        if value is None and nullable:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
            raise ConfigError(self.key(name), f"must be a number of seconds, got {shown(value)}")
        if value < 0 or (positive and value == 0):
            raise ConfigError(self.key(name), f"must be {'> 0' if positive else '>= 0'}")
        return float(value)

    def interval(self, name: str, default: float) -> float:
        """A positive number of seconds, at least ``LOOP_FLOOR`` (10 ms): the period of a loop
        (health polling), which under it would be a busy loop."""
        value = self.number(name, default, positive=True)
        assert value is not None  # not nullable
        if value < LOOP_FLOOR:
            raise ConfigError(
                self.key(name),
                f"must be at least {LOOP_FLOOR} s (the period of a loop; under it, a busy "
                f"loop), got {value:g}",
            )
        return value

    def string(self, name: str, default: str = _UNSET) -> str:
        """A non-empty string; required when no default is given."""
        value = self.data.get(name, default)
        if value is _UNSET:
            raise ConfigError(self.key(name), "is required")
        if not isinstance(value, str) or not value:
            raise ConfigError(self.key(name), f"must be a non-empty string, got {shown(value)}")
        return value

    def optional_string(self, name: str) -> str | None:
        """A non-empty string, or None when absent or null."""
        return self.string(name) if self.has(name) else None

    def choice(self, name: str, allowed: Sequence[str], default: str = _UNSET) -> str:
        value = self.data.get(name, default)
        if value is _UNSET:
            raise ConfigError(self.key(name), f"is required: one of {', '.join(allowed)}")
        if not isinstance(value, str) or value not in allowed:
            raise ConfigError(
                self.key(name), f"must be one of {', '.join(allowed)}, got {shown(value)}"
            )
        return value

    def choices(
        self, name: str, allowed: Sequence[str], default: tuple[str, ...]
    ) -> tuple[str, ...]:
        """One of ``allowed`` or a non-empty list of them (duplicates dropped, order kept)."""
        value = self.data.get(name, list(default))
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list) or not items:
            raise ConfigError(
                self.key(name), f"must be one of {', '.join(allowed)} or a non-empty list of them"
            )
        for i, item in enumerate(items):
            if not isinstance(item, str) or item not in allowed:
                raise ConfigError(
                    f"{self.key(name)}[{i}]",
                    f"must be one of {', '.join(allowed)}, got {shown(item)}",
                )
        return tuple(dict.fromkeys(items))

    def strings(
        self, name: str, default: Sequence[str] = (), *, required: bool = False
    ) -> tuple[str, ...]:
        """A list of non-empty strings (a single string is not a list)."""
        value = self.data.get(name)
        if value is None:
            if required:
                raise ConfigError(self.key(name), "is required: a non-empty list of strings")
            return tuple(default)
        if not isinstance(value, list) or (required and not value):
            what = "a non-empty list" if required else "a list"
            raise ConfigError(self.key(name), f"must be {what} of strings, got {shown(value)}")
        for i, item in enumerate(value):
            if not isinstance(item, str) or not item:
                raise ConfigError(
                    f"{self.key(name)}[{i}]", f"must be a non-empty string, got {shown(item)}"
                )
        return tuple(value)

    def integers(self, name: str, default: frozenset[int], *, minimum: int) -> frozenset[int]:
        """A list of integers ``>= minimum``; ``default`` when absent."""
        value = self.data.get(name)
        if value is None:
            return default
        if not isinstance(value, list):
            raise ConfigError(self.key(name), f"must be a list of integers, got {shown(value)}")
        for i, item in enumerate(value):
            if isinstance(item, bool) or not isinstance(item, int) or item < minimum:
                raise ConfigError(
                    f"{self.key(name)}[{i}]", f"must be an integer >= {minimum}, got {shown(item)}"
                )
        return frozenset(value)

    def string_map(self, name: str) -> dict[str, str]:
        """A mapping of strings to strings (environment variables, labels...)."""
        section = self.section(name)
        for key, value in section.data.items():
            if not isinstance(key, str) or not key:
                raise ConfigError(
                    self.key(name), f"keys must be non-empty strings, got {shown(key)}"
                )
            if not isinstance(value, str):
                raise ConfigError(section.key(key), f"must be a string, got {shown(value)}")
        return dict(section.data)

    def path(self, name: str, default: str | Path) -> Path:
        """An absolute path."""
        value = self.string(name, str(default))
        if not value.startswith("/"):
            raise ConfigError(self.key(name), f"must be an absolute path, got {shown(value)}")
        if "\0" in value:
            raise ConfigError(self.key(name), "must not contain NUL")
        return Path(value)

    def resource_name(self, name: str, default: str = _UNSET, *, domain: str | None = None) -> str:
        """An extended resource name the kubelet accepts (``vendor.com/thing``).

        With ``domain``, a bare name (no ``/``) stands for ``<domain>/<name>``, which is returned.
        """
        value = self.string(name, default)
        if domain is not None and "/" not in value:
            value = f"{domain}/{value}"
        problem = _names.resource_name_problem(value)
        if problem is not None:
            raise ConfigError(self.key(name), f"invalid resource name {shown(value)}: {problem}")
        try:
            # The plugin's default socket is named after the resource: it must be valid too.
            _names.validate_socket_name(_names.default_socket_name(value))
        except ValueError as exc:
            raise ConfigError(self.key(name), f"{shown(value)}: {exc}") from None
        return value

    def domain(self, name: str, default: str = _UNSET) -> str:
        """The domain part of extended resource names (``vendor.com``), as the kubelet takes it."""
        value = self.string(name, default)
        problem = _names.resource_name_problem(f"{value}/x")
        if problem is not None:
            raise ConfigError(
                self.key(name), f"invalid resource-name domain {shown(value)}: {problem}"
            )
        return value
