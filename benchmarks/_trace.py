"""Timestamps of the registration path, for ``bench_restart.py --trace`` (benchmarks only).

``install(path)`` wraps, in the plugin process, the points a restart passes through, per
resource: the directory watcher's wake-up, the rename of the staged socket into place, the
Register call (start and end), the kubelet's dial-back (GetDevicePluginOptions), the kubelet's
stream opening and its first list sent. Each stamp is ``time.monotonic()`` (CLOCK_MONOTONIC,
one clock for every process of the machine), written as ``<time> <resource> <event>`` lines
when the process exits. The measuring process stamps the fake kubelet's side the same way.
"""

from __future__ import annotations

import atexit
import functools
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from devplugin_sdk._engine import kubelet_sock, streams
from devplugin_sdk._engine.kubelet_watch import DirectoryWatcher
from devplugin_sdk._wire import registration

STAMPS: list[tuple[float, str, str]] = []


def stamp(resource: str, event: str) -> None:
    """Record ``event`` for ``resource`` now."""
    STAMPS.append((time.monotonic(), resource, event))


def install(path: Path) -> None:
    """Wrap the registration path's points; write the stamps to ``path`` at exit."""
    register_once = registration.register_once

    async def traced_register(*args: Any, **kwargs: Any) -> Any:
        resource = kwargs["resource_name"]
        stamp(resource, "register call")
        try:
            return await register_once(*args, **kwargs)
        finally:
            stamp(resource, "register returned")

    registration.register_once = traced_register

    serving = kubelet_sock._KubeletSockRegistration._serving

    async def traced_serving(self: Any) -> bool:
        stamp(self.resource, "serving check")
        served: bool = await serving(self)
        stamp(self.resource, "serving ready")
        return served

    kubelet_sock._KubeletSockRegistration._serving = traced_serving  # type: ignore[method-assign]

    def wrap(cls: type, name: str, event: str) -> None:
        method: Callable[..., Any] = getattr(cls, name)

        @functools.wraps(method)
        def traced(self: Any, *args: Any) -> Any:
            stamp(self._resource, event)
            return method(self, *args)

        setattr(cls, name, traced)

    wrap(streams.Streams, "options_requested", "dial-back: options")
    wrap(streams.Streams, "opened", "stream opened")
    sent = streams.Streams.sent

    def traced_sent(self: Any, stream_id: int, version: int) -> None:
        if stream_id == self.kubelet and self._sent.get(stream_id) == -1:
            stamp(self._resource, "first list sent")
        sent(self, stream_id, version)

    streams.Streams.sent = traced_sent  # type: ignore[method-assign]
    notify = DirectoryWatcher.notify

    def traced_notify(self: DirectoryWatcher) -> None:
        stamp("-", "watcher wakes")
        notify(self)

    DirectoryWatcher.notify = traced_notify  # type: ignore[method-assign]

    def dump() -> None:
        with path.open("w") as out:
            for at, resource, event in STAMPS:
                out.write(f"{at:.9f} {resource} {event}\n")

    atexit.register(dump)
