"""Log setup for the ``devplugin`` command: text or JSON lines, with resource/device fields."""

from __future__ import annotations

import json
import logging
import sys
import time

__all__ = ["configure_logging"]

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
