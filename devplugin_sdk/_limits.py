"""Defaults that commands need before the code they configure is loaded.

The thresholds of a conformance run (``conformance.Limits``): the CLI builds its
``conformance`` options from these defaults on every command, ``run`` included; the checks
themselves (with the fake kubelet and the DRA client) load only when a conformance run starts.
The HTTP endpoints' defaults (``runner.Http``): ``healthz`` loads only when a port is served.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DEFAULT_MAX_CONNECTIONS", "DEFAULT_STUCK_AFTER", "Limits"]

#: Seconds a newest device list may stay unsent on an open ListAndWatch stream before /healthz
#: calls the loop stuck.
DEFAULT_STUCK_AFTER = 30.0

#: Connections served at once. At the cap a new connection closes the oldest one, so idle
#: connections can neither exhaust file descriptors nor lock the kubelet's probes out.
DEFAULT_MAX_CONNECTIONS = 64


@dataclass(frozen=True, slots=True)
class Limits:
    """Thresholds and timeouts of a run.

    Args:
        fast_within: "Quickly" for options-fast and list-prompt, seconds.
        timeout: Dial timeout and deadline of each RPC or stream wait, seconds.
        max_devices: At most this many single-device Allocate calls.
        register_wait: ``--register-dir``: how long to wait for a plugin to register.
        expect: ``--register-dir``: wait until this many resources registered.
        settle: ``--register-dir``: then wait this long for more resources to register.
        restart_timeout: ``--register-dir``: how long a plugin may take to re-register.
    """

    fast_within: float = 1.0
    timeout: float = 10.0
    max_devices: int = 64
    register_wait: float = 60.0
    expect: int = 1
    settle: float = 0.5
    restart_timeout: float = 10.0
