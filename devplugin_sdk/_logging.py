"""Log setup for the ``devplugin`` command (text or JSON lines, with resource/device fields), and
``printable``, which every engine module applies to peer input before it enters a log message."""

from __future__ import annotations

import json
import logging
import sys
import time

__all__ = ["configure_logging", "printable"]

# Fields the SDK attaches with ``extra=`` and that both formats show.
_FIELDS = ("resource", "device", "health")


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message and the SDK's fields."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name in _FIELDS:
            value = getattr(record, name, None)
            if value is not None:
                entry[name] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


class TextFormatter(logging.Formatter):
    """``time level logger: message`` plus ``key=value`` for the SDK's fields."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)-7s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = [f"{n}={getattr(record, n)}" for n in _FIELDS[1:] if getattr(record, n, None)]
        return f"{line} [{' '.join(fields)}]" if fields else line


def configure_logging(level: str = "info", fmt: str = "text") -> None:
    """Send logs to stderr in ``fmt`` ("text" or "json") at ``level``.

    Raises:
        ValueError: unknown level or format.
    """
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"unknown log level {level!r}")  # noqa: TRY004 - a bad value, not a bad type
    if fmt not in ("text", "json"):
        raise ValueError(f"unknown log format {fmt!r}; use text or json")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(numeric)


_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def printable(text: str) -> str:
    """``text`` with every non-printable character escaped (``\\n``, ``\\x1b``, ``\\u2028``).

    Device IDs and other text a peer sends reach the logs through this, so a request can never
    forge a log line or send terminal escapes; the rule is ``str.isprintable``, the one
    ``Device.id`` must already pass.
    """
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else _escape(ch) for ch in text)


def _escape(ch: str) -> str:
    code = ord(ch)
    if ch in _ESCAPES:
        return _ESCAPES[ch]
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"
