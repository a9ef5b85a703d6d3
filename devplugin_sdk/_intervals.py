"""The bounds of every interval and duration an operator sets, in one table, each with its reason.

``devplugin run``'s file (``rescanInterval``, ``metrics.stuckAfter``, ``dra.cleanupInterval``,
``dra.healthTimeout``) and the environment (``DEVPLUGIN_STUCK_AFTER``) read their seconds through
``seconds`` and ``seconds_text``: a value under its bound would turn a periodic task into a busy
loop (``rescanInterval: 1e-9`` ran ``discover()`` 34,846 times a second), so it is refused with
the key, the bound and the reason. 0 keeps meaning "off" where it did.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from devplugin_sdk.errors import ConfigError

__all__ = ["INTERVALS", "LOOP_FLOOR", "Interval", "port_text", "seconds", "seconds_text"]

#: The shortest period the Python API takes for a loop (``Settings.rescan_interval``, a plugin's
#: ``rescan_interval``): tests run them at 50 ms, but a period of nanoseconds is a busy loop that
#: starves the event loop serving the kubelet.
LOOP_FLOOR = 0.01


@dataclass(frozen=True, slots=True)
class Interval:
    """The bounds of one option, in seconds.

    Attributes:
        minimum: The smallest value taken (other than 0 where ``off``).
        maximum: The largest, or None.
        off: Whether 0 is taken, meaning "never".
        reason: Why the minimum is what it is.
    """

    minimum: float
    maximum: float | None
    off: bool
    reason: str


#: By the run file's dotted key.
INTERVALS: dict[str, Interval] = {
    "rescanInterval": Interval(
        1.0,
        86_400.0,
        off=True,
        reason="each rescan runs every plugin's discover() (sysfs, NVML); a device that "
        "appears is seen within a second, and faster only burns a core",
    ),
    "dra.cleanupInterval": Interval(
        10.0,
        86_400.0,
        off=True,
        reason="each sweep reads every prepared claim from the API server, from every node",
    ),
    "dra.healthTimeout": Interval(
        3.0,
        3_600.0,
        off=False,
        reason="every device's health is sent at least three times within it, once a second "
        "at most",
    ),
    "metrics.stuckAfter": Interval(
        1.0,
        86_400.0,
        off=False,
        reason="an ordinary send of a device list takes milliseconds; under a second /healthz "
        "would fail a working plugin",
    ),
}

# A decimal number in ASCII: Python's float() also takes "1_0", fullwidth digits, "inf" and
# surrounding blanks, none of which an operator means as seconds.
_DECIMAL = re.compile(r"[-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][-+]?[0-9]+)?")


def seconds(value: object, key: str, *, name: str | None = None) -> float:
    """``value`` checked against the bounds of the option ``key`` (``INTERVALS``).

    Args:
        value: From the file: a number.
        key: The option's dotted key in the run file.
        name: What the error names instead of ``key`` (an environment variable).

    Raises:
        ConfigError: not a number, or outside the bounds (naming the bound and its reason).
    """
    bound = INTERVALS[key]
    where = name or key
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        kind = ">= 0 (0: off)" if bound.off else "> 0"
        raise ConfigError(where, f"must be a number of seconds {kind}, got {_shown(value)}")
    if bound.off and value == 0:
        return 0.0
    if value < bound.minimum:
        least = "0 (off) or at least" if bound.off else "> 0: at least"
        raise ConfigError(
            where, f"must be {least} {bound.minimum:g} s ({bound.reason}), got {value:g}"
        )
    if bound.maximum is not None and value > bound.maximum:
        raise ConfigError(where, f"must be at most {bound.maximum:g} s, got {value:g}")
    return float(value)


def seconds_text(text: str, key: str, name: str) -> float:
    """Seconds written as text (an environment variable ``name``), in ASCII decimal notation,
    within the bounds of ``key``.

    Raises:
        ConfigError: naming ``name``.
    """
    bound = INTERVALS[key]
    value = float(text) if _DECIMAL.fullmatch(text) else math.nan
    if not math.isfinite(value) or value < 0 or (value == 0 and not bound.off):
        kind = ">= 0 (0: off)" if bound.off else "> 0"
        raise ConfigError(name, f"must be a number of seconds {kind}, got {text[:40]!r}")
    return seconds(value, key, name=name)


def port_text(text: str, name: str) -> int:
    """A TCP port written as ASCII digits only (``int()`` also takes ``1_0``, blanks and
    fullwidth or other Unicode digits).

    Raises:
        ConfigError: naming ``name``.
    """
    if not (text.isascii() and text.isdigit() and len(text) <= 5 and int(text) <= 65535):
        raise ConfigError(name, f"must be a TCP port number (0-65535), got {text[:40]!r}")
    return int(text)


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
