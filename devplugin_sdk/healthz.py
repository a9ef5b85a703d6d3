"""HTTP endpoints for probes and scrapers: ``/healthz``, ``/metrics`` and ``/status``.

The runner serves them when asked (``serve(..., http=Http(port=9450))``, ``devplugin run
--metrics-port``), reading the status of the plugins it runs. The server is a few lines of
HTTP/1.1 on anyio TCP streams (GET/HEAD, one request per connection, ``Connection: close``):
enough for the kubelet's probes and Prometheus, no framework.
"""

from __future__ import annotations

import importlib.util
import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import TYPE_CHECKING

import anyio
from anyio.abc import SocketAttribute, SocketStream, TaskStatus
from anyio.streams.buffered import BufferedByteReceiveStream

from devplugin_sdk.observe import PluginStatus

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

log = logging.getLogger("devplugin_sdk.healthz")

__all__ = ["DEFAULT_STUCK_AFTER", "problems", "serve_http"]

#: Seconds a newest device list may stay unsent on an open ListAndWatch stream before /healthz
#: calls the loop stuck.
DEFAULT_STUCK_AFTER = 30.0

_MAX_HEAD = 8192  # bytes of request line + headers; probes and scrapers send a few hundred
_READ_TIMEOUT = 5.0  # seconds a client gets to send its request; the kubelet's probe default is 1 s
_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    503: "Service Unavailable",
}
_TEXT = "text/plain; charset=utf-8"
_NO_METRICS = b"metrics need prometheus-client: pip install 'devplugin-sdk[metrics]'\n"

StatusSource = Callable[[], Sequence[PluginStatus]]


def problems(
    statuses: Sequence[PluginStatus], stuck_after: float = DEFAULT_STUCK_AFTER
) -> list[str]:
    """Why the served plugins are not live, one line per failing resource (empty: live).

    A plugin fails when it is not registered with the kubelet (including while it waits for an
    absent kubelet) or when its newest device list has waited more than ``stuck_after`` seconds
    to go out on an open ListAndWatch stream. Unhealthy devices never fail it: restarting the
    plugin cannot repair hardware, and the kubelet already stops allocating them.

    Args:
        statuses: Every served plugin's status.
        stuck_after: Seconds of pending device list that count as a stuck loop.

    Returns:
        ``"<resource>: <why>"`` lines, or ``["no plugin is being served"]`` for no statuses.
    """
    if not statuses:
        return ["no plugin is being served"]
    found: list[str] = []
    for status in statuses:
        if not status.registered:
            why = (
                "no ListAndWatch stream open"
                if status.streams == 0
                else f"{status.streams} ListAndWatch streams open"
            )
            found.append(f"{status.resource}: not registered with the kubelet ({why})")
        elif status.pending_seconds > stuck_after:
            found.append(
                f"{status.resource}: ListAndWatch loop stuck: the newest device list has waited "
                f"{status.pending_seconds:.1f}s to be sent (limit {stuck_after:g}s)"
            )
    return found


class _Endpoints:
    """Builds the response to one request."""

    def __init__(
        self, stuck_after: float, registry: CollectorRegistry | None, statuses: StatusSource
    ) -> None:
        self.stuck_after = stuck_after
        self.registry = registry
        self.statuses = statuses

    def respond(self, head: bytes) -> bytes:
        try:
            method, target, version = head.split(b"\r\n", 1)[0].decode("ascii").split(" ")
        except (UnicodeDecodeError, ValueError):
            return _response(400, "malformed request line\n")
        if not version.startswith("HTTP/1."):
            return _response(400, "HTTP/1.x only\n")
        if method not in ("GET", "HEAD"):
            return _response(405, "GET or HEAD only\n", extra={"Allow": "GET, HEAD"})
        path = target.split("?", 1)[0]
        if path == "/healthz":
            status, body, ctype = self._healthz()
        elif path == "/status":
            status, body, ctype = self._status()
        elif path == "/metrics":
            status, body, ctype = self._metrics()
        else:
            status, body, ctype = 404, b"try /healthz, /metrics or /status\n", _TEXT
        return _response(status, body, content_type=ctype, head_only=method == "HEAD")

    def _healthz(self) -> tuple[int, bytes, str]:
        found = problems(self.statuses(), self.stuck_after)
        if not found:
            return 200, b"ok\n", _TEXT
        return 503, "".join(f"{line}\n" for line in found).encode(), _TEXT

    def _status(self) -> tuple[int, bytes, str]:
        statuses = self.statuses()
        found = problems(statuses, self.stuck_after)
        document = {
            "live": not found,
            "problems": found,
            "plugins": [asdict(s) for s in statuses],
        }
        return 200, (json.dumps(document, indent=2) + "\n").encode(), "application/json"

    def _metrics(self) -> tuple[int, bytes, str]:
        try:
            from prometheus_client import (  # noqa: PLC0415 - the metrics extra is optional
                CONTENT_TYPE_LATEST,
                REGISTRY,
                generate_latest,
            )
        except ImportError:
            return 404, _NO_METRICS, _TEXT
        registry = REGISTRY if self.registry is None else self.registry
        return 200, generate_latest(registry), CONTENT_TYPE_LATEST


def _response(
    status: int,
    body: bytes | str,
    *,
    content_type: str = _TEXT,
    head_only: bool = False,
    extra: dict[str, str] | None = None,
) -> bytes:
    payload = body.encode() if isinstance(body, str) else body
    headers = {
        "Content-Type": content_type,
        "Content-Length": str(len(payload)),
        "Cache-Control": "no-store",
        "Connection": "close",
        **(extra or {}),
    }
    lines = [f"HTTP/1.1 {status} {_REASONS.get(status, '')}"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    head = ("\r\n".join(lines) + "\r\n\r\n").encode("ascii")
    return head if head_only else head + payload


async def serve_http(
    host: str | None,
    port: int,
    *,
    statuses: StatusSource,
    stuck_after: float = DEFAULT_STUCK_AFTER,
    registry: CollectorRegistry | None = None,
    task_status: TaskStatus[int] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``/healthz``, ``/metrics`` and ``/status`` over HTTP until cancelled.

    - ``/healthz``: 200 ``ok`` when every served plugin is registered and none has a device
      list pending longer than ``stuck_after``; else 503 with one line per failing resource
      (see ``problems``). A plugin waiting for an absent kubelet is not registered: 503.
    - ``/metrics``: the Prometheus text format of ``registry`` (404 without the metrics extra).
    - ``/status``: JSON ``{"live", "problems", "plugins": [PluginStatus...]}``, always 200.

    The runner starts it (``runner.Http``); start it yourself with ``await
    task_group.start(partial(serve_http, host, port, statuses=...))`` to get the bound port.

    Args:
        host: Address to bind; ``None`` or ``""`` for every interface.
        port: TCP port; 0 picks a free one.
        statuses: Where the plugin statuses come from (``runner.Running.statuses``).
        stuck_after: Seconds after which a pending device list fails ``/healthz``.
        registry: The prometheus_client registry for ``/metrics`` (its default when None).
        task_status: Reports the bound port to ``TaskGroup.start``.

    Raises:
        OSError: the address cannot be bound.
        ValueError: ``stuck_after`` is not positive.
    """
    if stuck_after <= 0:
        raise ValueError(f"stuck_after must be > 0, got {stuck_after}")
    endpoints = _Endpoints(stuck_after, registry, statuses)
    listener = await anyio.create_tcp_listener(local_host=host or None, local_port=port)
    async with listener:
        bound: int = listener.extra(SocketAttribute.local_port)
        metrics = importlib.util.find_spec("prometheus_client") is not None
        served = "/healthz, /metrics and /status" if metrics else "/healthz and /status"
        log.info("serving %s on port %d", served, bound)
        task_status.started(bound)
        await listener.serve(lambda stream: _handle(stream, endpoints))


async def _handle(stream: SocketStream, endpoints: _Endpoints) -> None:
    # Runs in the listener's task group: an exception escaping here would stop the server and
    # the plugins beside it, so everything is caught.
    try:
        async with stream:
            try:
                with anyio.fail_after(_READ_TIMEOUT):
                    head = await BufferedByteReceiveStream(stream).receive_until(
                        b"\r\n\r\n", _MAX_HEAD
                    )
            except anyio.DelimiterNotFound:
                await stream.send(_response(400, "request head too large\n"))
                return
            except (TimeoutError, anyio.IncompleteRead, anyio.EndOfStream):
                return
            await stream.send(endpoints.respond(head))
    except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
        pass  # the client went away
    except Exception:
        log.exception("HTTP request handling failed")
