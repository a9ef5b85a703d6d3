"""HTTP endpoints for probes and scrapers: ``/healthz``, ``/metrics`` and ``/status``.

The runner serves them when asked (``serve(..., http=Http(port=9450))``, ``devplugin run
--metrics-port``), reading the status of the plugins it runs. h11 parses each request and frames
each answer on anyio TCP streams (GET/HEAD, one request per connection, ``Connection: close``);
``/metrics`` speaks OpenMetrics and gzip when the scraper asks (prometheus_client's own
negotiation). Enough for the kubelet's probes and Prometheus, no framework. Nothing a client
does stops it:
``accept()`` errors (out of file descriptors, aborted connections) are logged, rate-limited, and
retried; connections are capped (a new one replaces the oldest) and each gets a few seconds to
send its request and to take the answer.
"""

from __future__ import annotations

import errno
import gzip
import importlib.util
import itertools
import json
import logging
import math
import resource
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import anyio
import h11
from anyio.abc import SocketAttribute, SocketListener, SocketStream, TaskGroup, TaskStatus

from devplugin_sdk._backoff import Backoff
from devplugin_sdk._limits import DEFAULT_MAX_CONNECTIONS, DEFAULT_STUCK_AFTER
from devplugin_sdk.observe import PluginStatus

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

log = logging.getLogger("devplugin_sdk.healthz")

__all__ = ["DEFAULT_MAX_CONNECTIONS", "DEFAULT_STUCK_AFTER", "problems", "serve_http"]

_MAX_HEAD = 8192  # bytes of request line + headers; probes and scrapers send a few hundred
_RECEIVE = 4096  # bytes read at a time
_HEAD_TIMEOUT = 5.0  # seconds a client gets to send its request; the kubelet's probe default is 1 s
_SEND_TIMEOUT = 5.0  # seconds a client gets to take the answer
_ACCEPT_RETRY_MIN = 0.05  # seconds before accepting again after running out of descriptors
_ACCEPT_RETRY_MAX = 0.5
_LOG_EVERY = 10.0  # seconds between two log lines about the same trouble

# accept() failed for one connection only (it went away before we took it): accept again at once.
_CONNECTION_ERRORS = frozenset({errno.ECONNABORTED, errno.ECONNRESET, errno.EPROTO, errno.EPERM})
# Out of file descriptors or memory: closing our oldest connection frees one; then wait a little.
_RESOURCE_ERRORS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    431: "Request Header Fields Too Large",
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
    absent kubelet, and while the kubelet's own ListAndWatch stream is not open, whatever other
    clients' streams are) or when its newest device list has waited more than ``stuck_after``
    seconds to go out on the kubelet's stream. Other clients' streams never fail it: one that
    does not read is its own problem, not the plugin's. Unhealthy devices never fail it either:
    restarting the plugin cannot repair hardware, and the kubelet already stops allocating them.

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
                else f"no ListAndWatch stream from the kubelet; {status.streams} from other clients"
            )
            found.append(f"{status.resource}: not registered with the kubelet ({why})")
        elif status.pending_seconds > stuck_after:
            found.append(
                f"{status.resource}: ListAndWatch loop stuck: the newest device list has waited "
                f"{status.pending_seconds:.1f}s to be sent to the kubelet (limit {stuck_after:g}s)"
            )
    return found


@dataclass(frozen=True)
class _Reply:
    """One answer: its status, body and headers beyond the ones every answer has."""

    status: int
    body: bytes
    content_type: str = _TEXT
    headers: tuple[tuple[str, str], ...] = ()


class _Endpoints:
    """Builds the answer to one request."""

    def __init__(
        self, stuck_after: float, registry: CollectorRegistry | None, statuses: StatusSource
    ) -> None:
        self.stuck_after = stuck_after
        self.registry = registry
        self.statuses = statuses

    def respond(self, request: h11.Request) -> _Reply:
        if request.method not in (b"GET", b"HEAD"):
            return _Reply(405, b"GET or HEAD only\n", headers=(("Allow", "GET, HEAD"),))
        # h11 checked the target's characters (RFC 9112): ASCII.
        path = request.target.split(b"?", 1)[0].decode("ascii")
        if path == "/healthz":
            return self._healthz()
        if path == "/status":
            return self._status()
        if path == "/metrics":
            headers = {name: value.decode("latin-1") for name, value in request.headers}
            return self._metrics(headers.get(b"accept", ""), headers.get(b"accept-encoding", ""))
        return _Reply(404, b"try /healthz, /metrics or /status\n")

    def _healthz(self) -> _Reply:
        found = problems(self.statuses(), self.stuck_after)
        if not found:
            return _Reply(200, b"ok\n")
        return _Reply(503, "".join(f"{line}\n" for line in found).encode())

    def _status(self) -> _Reply:
        statuses = self.statuses()
        found = problems(statuses, self.stuck_after)
        document = {
            "live": not found,
            "problems": found,
            "plugins": [asdict(s) for s in statuses],
        }
        return _Reply(200, (json.dumps(document, indent=2) + "\n").encode(), "application/json")

    def _metrics(self, accept: str, accept_encoding: str) -> _Reply:
        try:
            from prometheus_client import REGISTRY  # noqa: PLC0415 - the metrics extra is optional
            from prometheus_client.exposition import (  # noqa: PLC0415
                choose_encoder,
                gzip_accepted,
            )
        except ImportError:
            return _Reply(404, _NO_METRICS)
        registry = REGISTRY if self.registry is None else self.registry
        # The scraper's Accept picks the text format or OpenMetrics, as prometheus_client's own
        # HTTP handler does; gzip when Accept-Encoding allows it (Prometheus always sends it).
        encoder, content_type = choose_encoder(accept)
        body = encoder(registry)
        vary = ("Vary", "Accept, Accept-Encoding")
        if gzip_accepted(accept_encoding):
            return _Reply(
                200, gzip.compress(body), content_type, (vary, ("Content-Encoding", "gzip"))
            )
        return _Reply(200, body, content_type, (vary,))


def _serialized(conn: h11.Connection, reply: _Reply, *, head_only: bool) -> bytes:
    """The bytes of ``reply``, framed by h11 (without the body for HEAD)."""
    headers = [
        ("Content-Type", reply.content_type),
        ("Content-Length", str(len(reply.body))),
        ("Cache-Control", "no-store"),
        ("Connection", "close"),
        *reply.headers,
    ]
    reason = _REASONS.get(reply.status, "")
    out = conn.send(h11.Response(status_code=reply.status, headers=headers, reason=reason)) or b""
    if not head_only:
        out += conn.send(h11.Data(data=reply.body)) or b""
    return out + (conn.send(h11.EndOfMessage()) or b"")


async def serve_http(
    host: str | None,
    port: int,
    *,
    statuses: StatusSource,
    stuck_after: float = DEFAULT_STUCK_AFTER,
    registry: CollectorRegistry | None = None,
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
    task_status: TaskStatus[int] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``/healthz``, ``/metrics`` and ``/status`` over HTTP until cancelled.

    - ``/healthz``: 200 ``ok`` when every served plugin is registered and none has a device
      list pending longer than ``stuck_after``; else 503 with one line per failing resource
      (see ``problems``). A plugin waiting for an absent kubelet is not registered: 503.
    - ``/metrics``: the Prometheus text format of ``registry`` (404 without the metrics extra).
    - ``/status``: JSON ``{"live", "problems", "plugins": [PluginStatus...]}``, always 200.

    At most ``max_connections`` connections (and never more than a quarter of the process's
    file-descriptor limit) are served at once: at the cap, a new connection closes the oldest.
    A client gets 5 s to send its request and 5 s to take the answer. An error accepting a
    connection (out of file descriptors, say) is logged at most every 10 s and accepting goes
    on; it never stops the server or the plugins beside it.

    The runner starts it (``runner.Http``); start it yourself with ``await
    task_group.start(partial(serve_http, host, port, statuses=...))`` to get the bound port.

    Args:
        host: Address to bind; ``None`` or ``""`` for every interface.
        port: TCP port; 0 picks a free one.
        statuses: Where the plugin statuses come from (``runner.Running.statuses``).
        stuck_after: Seconds after which a pending device list fails ``/healthz``.
        registry: The prometheus_client registry for ``/metrics`` (its default when None).
        max_connections: Connections served at once.
        task_status: Reports the bound port to ``TaskGroup.start``.

    Raises:
        OSError: the address cannot be bound.
        ValueError: ``stuck_after`` or ``max_connections`` is not positive.
    """
    if stuck_after <= 0:
        raise ValueError(f"stuck_after must be > 0, got {stuck_after}")
    if max_connections < 1:
        raise ValueError(f"max_connections must be >= 1, got {max_connections}")
    server = _Server(_Endpoints(stuck_after, registry, statuses), _cap(max_connections))
    listener = await anyio.create_tcp_listener(local_host=host or None, local_port=port)
    async with listener:
        bound: int = listener.extra(SocketAttribute.local_port)
        metrics = importlib.util.find_spec("prometheus_client") is not None
        served = "/healthz, /metrics and /status" if metrics else "/healthz and /status"
        log.info("serving %s on port %d", served, bound)
        task_status.started(bound)
        async with anyio.create_task_group() as tg:
            # One accept loop per address family (every address: IPv4 and IPv6).
            for one in listener.listeners:
                assert isinstance(one, SocketListener)  # what create_tcp_listener makes
                tg.start_soon(server.accept_loop, one, tg)


class _Trouble:
    """One kind of recurring trouble, logged at most every ``_LOG_EVERY`` seconds.

    Args:
        message: The log message, with ``{}`` where the detail of each occurrence goes.
    """

    def __init__(self, message: str) -> None:
        self.message = message
        self.last_logged = -math.inf
        self.unlogged = 0

    def happened(self, detail: str) -> None:
        now = time.monotonic()
        if now - self.last_logged < _LOG_EVERY:
            self.unlogged += 1
            return
        more = f" ({self.unlogged} more since the last report)" if self.unlogged else ""
        log.warning("HTTP endpoints: %s%s", self.message.format(detail), more)
        self.last_logged = now
        self.unlogged = 0


def _cap(max_connections: int) -> int:
    """``max_connections``, but never more than a quarter of the process's file descriptors:
    the plugins' sockets, Register calls, inotify and CDI need the rest."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return max_connections
    return max(1, min(max_connections, soft // 4))


class _Server:
    """Accepts connections and serves each in its own task, at most ``limit`` at once."""

    def __init__(self, endpoints: _Endpoints, limit: int) -> None:
        self.endpoints = endpoints
        self.limit = limit
        self._ids = itertools.count()
        self._open: dict[int, anyio.CancelScope] = {}  # oldest first
        self._accept_failed = _Trouble("accepting a connection failed ({}); accepting again")
        self._crowded = _Trouble(f"{limit} connections open, the limit: {{}} closed the oldest")

    async def accept_loop(self, listener: SocketListener, tg: TaskGroup) -> None:
        backoff = Backoff(_ACCEPT_RETRY_MIN, _ACCEPT_RETRY_MAX)
        while True:
            try:
                stream = await listener.accept()
            except OSError as exc:
                self._accept_failed.happened(str(exc))
                if exc.errno in _CONNECTION_ERRORS:
                    continue
                if exc.errno in _RESOURCE_ERRORS and self._close_oldest():
                    # One of ours is closing: its descriptor is free in a moment.
                    await anyio.sleep(_ACCEPT_RETRY_MIN / 5)
                    continue
                # Descriptors held elsewhere (gRPC clients, backends): wait for them, longer
                # each time, but never stop accepting.
                await backoff.sleep()
                continue
            backoff.reset()
            while len(self._open) >= self.limit:
                self._crowded.happened("a new one")
                self._close_oldest()
            scope = anyio.CancelScope()
            key = next(self._ids)
            self._open[key] = scope
            tg.start_soon(self._serve, stream, key, scope)

    def _close_oldest(self) -> bool:
        """Close the connection open the longest; False when none is open."""
        if not self._open:
            return False
        key = next(iter(self._open))
        self._open.pop(key).cancel()
        return True

    async def _serve(self, stream: SocketStream, key: int, scope: anyio.CancelScope) -> None:
        try:
            with scope:
                await _handle(stream, self.endpoints)
        finally:
            self._open.pop(key, None)


async def _handle(stream: SocketStream, endpoints: _Endpoints) -> None:
    # Runs in the server's task group: an exception escaping here would stop the server and
    # the plugins beside it, so everything is caught.
    try:
        async with stream:
            conn = h11.Connection(h11.SERVER, max_incomplete_event_size=_MAX_HEAD)
            try:
                with anyio.fail_after(_HEAD_TIMEOUT):
                    request = await _request(stream, conn)
            except h11.RemoteProtocolError as exc:
                # A bad request line or header, a head over _MAX_HEAD (431), HTTP/1.1 without
                # Host: h11 says which status fits.
                why = (
                    f"request head over {_MAX_HEAD} bytes" if exc.error_status_hint == 431 else exc
                )
                reply = _Reply(exc.error_status_hint, f"bad request: {why}\n".encode())
                request = None
                if conn.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
                    return
            except (TimeoutError, anyio.EndOfStream):
                return
            else:
                if request is None:
                    return  # the client closed without asking anything
                reply = endpoints.respond(request)
            head_only = request is not None and request.method == b"HEAD"
            with anyio.move_on_after(_SEND_TIMEOUT):
                await stream.send(_serialized(conn, reply, head_only=head_only))
    except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
        pass  # the client went away
    except Exception:
        log.exception("HTTP request handling failed")


async def _request(stream: SocketStream, conn: h11.Connection) -> h11.Request | None:
    """The request h11 reads from ``stream``; None when the client closed before sending one.

    Raises:
        h11.RemoteProtocolError: not a valid HTTP/1.x request, or a head over ``_MAX_HEAD``.
        anyio.EndOfStream: the client closed half-way through its request.
    """
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(await stream.receive(_RECEIVE))
            continue
        return event if isinstance(event, h11.Request) else None
