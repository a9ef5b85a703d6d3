"""Log setup for the ``devplugin`` command: text or JSON lines, with resource/device fields; and
``printable``, which every engine module applies to peer input before it enters a log message.

The level applies to the SDK and to the plugin's own loggers; the libraries under them (gRPC's
Cython layer, asyncio) stay at warning unless a level is asked for by name
(``debug,grpc=debug``), since their debug output drowns the plugin's.
"""

from __future__ import annotations

import json
import logging
import sys
import time

__all__ = ["QUIET_LIBRARIES", "configure_logging", "fatal", "parse_levels", "printable"]

#: Loggers of libraries kept at warning (unless named in the level) whatever the level.
QUIET_LIBRARIES = (
    "asyncio",
    "grpc",
    "anyio",
    "hpack",
    "h2",
    "urllib3",
    "prometheus_client",
    "httpx2",  # lightkube's client logs every request at info
)
_LEVELS = ("debug", "info", "warning", "error")
_named: set[str] = set()  # loggers the last configure_logging call set by name

# Fields the SDK attaches with ``extra=`` and that both formats show.
_FIELDS = ("resource", "device", "health")


def _one_line(exc: BaseException) -> str:
    """``RuntimeError: sensor gone``: what went wrong, without where."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message and the SDK's fields.

    Args:
        tracebacks: Put an exception's traceback in the ``exception`` field; without, only its
            type and message (``--log-level debug`` asks for them).
    """

    def __init__(self, tracebacks: bool = True) -> None:
        super().__init__()
        self.tracebacks = tracebacks

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
        if record.exc_info and record.exc_info[1] is not None:
            exc = record.exc_info[1]
            entry["exception"] = (
                self.formatException(record.exc_info) if self.tracebacks else _one_line(exc)
            )
        return json.dumps(entry)


class TextFormatter(logging.Formatter):
    """``time level logger: message`` plus ``key=value`` for the SDK's fields.

    Args:
        tracebacks: Follow a record's exception with its traceback; without, the exception's
            type and message end the line (``--log-level debug`` asks for tracebacks).
    """

    def __init__(self, tracebacks: bool = True) -> None:
        super().__init__("%(asctime)s %(levelname)-7s %(name)s: %(message)s")
        self.tracebacks = tracebacks

    def format(self, record: logging.LogRecord) -> str:
        if not self.tracebacks and record.exc_info and record.exc_info[1] is not None:
            # One line: a copy of the record, its exception said after the message.
            exc = record.exc_info[1]
            record = logging.makeLogRecord(record.__dict__)
            record.msg = f"{record.getMessage()}: {_one_line(exc)}"
            record.args = None
            record.exc_info = record.exc_text = None
        line = super().format(record)
        fields = [f"{n}={getattr(record, n)}" for n in _FIELDS[1:] if getattr(record, n, None)]
        return f"{line} [{' '.join(fields)}]" if fields else line


def parse_levels(spec: str) -> tuple[str, dict[str, str]]:
    """Split a level spec: ``LEVEL`` then optional ``,LOGGER=LEVEL`` items.

    ``"debug,grpc=info"`` is ``("debug", {"grpc": "info"})``.

    Raises:
        ValueError: a level other than debug, info, warning, error, or an item without ``=``.
    """
    first, *rest = (part.strip() for part in spec.split(","))
    named: dict[str, str] = {}
    for item in rest:
        name, sep, level = item.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"unknown log level item {item[:60]!r}; use LOGGER=LEVEL")
        named[name.strip()] = _level(level.strip())
    return _level(first), named


def _level(name: str) -> str:
    if name.lower() not in _LEVELS:
        shown = name if len(name) <= 40 else name[:37] + "..."
        raise ValueError(f"unknown log level {shown!r}; use {', '.join(_LEVELS)}")
    return name.lower()


def configure_logging(level: str = "info", fmt: str = "text") -> None:
    """Send logs to stderr in ``fmt`` ("text" or "json") at ``level``.

    Args:
        level: A level for the SDK and the plugin (debug, info, warning, error), then optional
            ``,LOGGER=LEVEL`` items; the loggers of ``QUIET_LIBRARIES`` stay at warning unless
            named (or unless ``level`` is error, which applies to them too).
        fmt: ``text`` or ``json``.

    A record's exception is its type and message at the end of the line, its traceback only at
    ``debug``.

    Raises:
        ValueError: unknown level or format.
    """
    main, named = parse_levels(level)
    if fmt not in ("text", "json"):
        raise ValueError(f"unknown log format {fmt[:40]!r}; use text or json")
    handler = logging.StreamHandler(sys.stderr)
    # A traceback is for the one who debugs; the operator's log gets one line per error.
    tracebacks = main == "debug"
    handler.setFormatter(JsonFormatter(tracebacks) if fmt == "json" else TextFormatter(tracebacks))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(main.upper())
    for name in _named - named.keys():  # named by an earlier call (a reloaded file): reset
        logging.getLogger(name).setLevel(logging.NOTSET)
    _named.clear()
    _named.update(named)
    quiet = "error" if main == "error" else "warning"
    for name in QUIET_LIBRARIES:
        logging.getLogger(name).setLevel(named.get(name, quiet).upper())
    for name, value in named.items():
        logging.getLogger(name).setLevel(value.upper())


def fatal(line: str, exc: BaseException | None = None) -> None:
    """Write the line that ends a command to stderr: as it is, or as a JSON record when the
    log is JSON (a log collector parses every line). With ``exc``, its traceback comes first
    (in the record's ``exception`` field under JSON)."""
    handlers = logging.getLogger().handlers
    json_log = any(isinstance(h.formatter, JsonFormatter) for h in handlers)
    if json_log:
        prog, _, message = line.partition(": error: ")
        record = logging.LogRecord(
            prog,
            logging.ERROR,
            "",
            0,
            message or line,
            None,
            None if exc is None else (type(exc), exc, exc.__traceback__),
        )
        text = JsonFormatter(tracebacks=exc is not None).format(record)
    else:
        text = line
        if exc is not None:
            import traceback  # noqa: PLC0415 - only at debug, on the way out

            text = "".join(traceback.format_exception(exc)).rstrip() + "\n" + line
    try:
        sys.stderr.write(text + "\n")
        sys.stderr.flush()
    except (OSError, ValueError):  # stderr closed too: nowhere left to say it
        pass


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
