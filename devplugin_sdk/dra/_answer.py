"""The one decoder of the API server's answers: the object a call expects, or a ``KubeApiError``.

HTML from a proxy, a 503 with an odd body, a list, 100k-deep JSON or garbage each raised another
exception from lightkube, which ended the driver's process; here every answer and watch line is
read once, bounded, and anything unexpected is a retryable error of that call, ``malformed``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import msgspec

from devplugin_sdk._logging import printable
from devplugin_sdk.errors import KubeApiError

__all__ = ["MAX_ANSWER_BYTES", "decode", "refusal", "watch_event"]

#: The longest answer read. A node's ResourceSliceList is a few MB at most (128 devices a
#: slice); anything longer is not an answer to our calls, and would only cost memory.
MAX_ANSWER_BYTES = 64 << 20
# How much of an odd answer its error shows, and how long its reason may be; the API server's
# own message (a 422 lists every invalid field) may be longer.
_SHOWN = 60
_REASON = 300
_MESSAGE = 1024
_NO_EVENT = "the watch sent a line that is not an event"

T = TypeVar("T")


def decode(
    status: int,
    content_type: str,
    body: bytes,
    *,
    model: type[Any],
    kind: str,
    convert: Callable[[Any], T],
) -> T:
    """The answer's object: ``body`` decoded as ``model``, of ``kind``, through ``convert``.

    Raises:
        KubeApiError: a refusal (the API server's ``Status``, or ``malformed`` when the body is
            not one), or a success whose body is not a ``kind`` that ``convert`` can read
            (``malformed``).
    """
    if not 200 <= status < 300:
        raise refusal(status, content_type, body)
    try:
        obj = msgspec.json.decode(body, type=model)
    except (msgspec.DecodeError, RecursionError) as exc:  # deep JSON is a RecursionError
        raise _odd(status, f"the answer is not a {kind}", content_type, body, exc) from None
    if getattr(obj, "kind", None) != kind:
        got = getattr(obj, "kind", None)
        why = f"the answer is not a {kind} (kind {printable(str(got)[:_SHOWN])})"
        raise _odd(status, why, content_type, body)
    try:
        return convert(obj)
    # Whatever the conversion of a well-formed object of the wrong shape raises (a missing
    # metadata, a quantity out of range): the answer cannot be used, and says so.
    except Exception as exc:
        raise _odd(status, f"the {kind} cannot be read", content_type, body, exc) from None


def refusal(status: int, content_type: str, body: bytes) -> KubeApiError:
    """The error of an answer that is not a success: the ``Status`` the API server sends with
    every refusal (its code and message), or a ``malformed`` one with the HTTP status."""
    try:
        raw = msgspec.json.decode(body)
    except (msgspec.DecodeError, RecursionError):
        raw = None
    if isinstance(raw, dict) and raw.get("kind") == "Status":
        code, message = raw.get("code"), raw.get("message")
        if isinstance(code, int) and not isinstance(code, bool) and isinstance(message, str):
            return KubeApiError(code or status, _short(message, _MESSAGE))
    return _odd(status, f"answered {status} without a Status", content_type, body)


def watch_event(line: str) -> tuple[str, dict[str, Any]]:
    """One line of a watch: its ``type`` and ``object``.

    Raises:
        KubeApiError: the line is not a watch event (``malformed``); an ``ERROR`` event's
            ``Status`` (410 Gone: the version is too old).
    """
    try:
        event = msgspec.json.decode(line.encode())
    except (msgspec.DecodeError, RecursionError) as exc:
        raise _odd(
            200, "the watch sent a line that is not an event", "", line.encode(), exc
        ) from None
    kind = event.get("type") if isinstance(event, dict) else None
    obj = event.get("object") if isinstance(event, dict) else None
    if not isinstance(kind, str) or not isinstance(obj, dict):
        raise _odd(200, "the watch sent a line that is not an event", "", line.encode())
    if kind == "ERROR":
        error = refusal(500, "application/json", msgspec.json.encode(obj))
        raise KubeApiError(error.status, error.reason, malformed=error.malformed)
    return kind, obj


def _odd(
    status: int, why: str, content_type: str, body: bytes, exc: BaseException | None = None
) -> KubeApiError:
    """A ``malformed`` error: why, what came (its type, size and first characters)."""
    cause = f": {type(exc).__name__}: {str(exc)[:_SHOWN]}" if exc is not None else ""
    start = body[:_SHOWN].decode("utf-8", "replace")
    what = f"{content_type or 'no content type'}, {len(body)} bytes: {start!r}"
    return KubeApiError(status, _short(f"{why}{cause} ({what})"), malformed=True)


def _short(text: str, most: int = _REASON) -> str:
    shown = printable(text)
    return shown if len(shown) <= most else shown[: most - 3] + "..."
