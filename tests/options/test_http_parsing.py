"""The HTTP endpoints parse requests with h11 and negotiate /metrics' format (issue 27, item 9).

Raw requests as curl, netcat, the kubelet's probe and Prometheus send them, over real sockets.
"""

from __future__ import annotations

import gzip
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial

import anyio
from prometheus_client import CollectorRegistry, Counter

from devplugin_sdk import healthz
from devplugin_sdk.observe import PluginStatus

_LIVE = PluginStatus("acme.com/widget", registered=True, streams=1, pending_seconds=0.0, devices={})


@asynccontextmanager
async def _server() -> AsyncIterator[int]:
    registry = CollectorRegistry()
    Counter("probe_marker", "test counter", registry=registry).inc()
    async with anyio.create_task_group() as tg:
        port = await tg.start(
            partial(healthz.serve_http, "127.0.0.1", 0, statuses=lambda: [_LIVE], registry=registry)
        )
        yield port
        tg.cancel_scope.cancel()


async def _exchange(port: int, request: bytes) -> tuple[bytes, dict[bytes, bytes], bytes]:
    """Send ``request`` raw, read the answer to the end: status line, headers, body."""
    async with await anyio.connect_tcp("127.0.0.1", port) as stream:
        await stream.send(request)
        answer = b""
        with anyio.fail_after(10):
            try:
                while True:
                    answer += await stream.receive()
            except (anyio.EndOfStream, anyio.BrokenResourceError):
                pass
    head, _, body = answer.partition(b"\r\n\r\n")
    status, *lines = head.split(b"\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(b":") for line in lines)}
    return status, headers, body


async def test_a_request_with_bare_newlines_is_answered() -> None:
    # printf 'GET /healthz HTTP/1.0\n\n' | nc: RFC 9112 lets a server accept bare LF.
    async with _server() as port:
        status, _, body = await _exchange(port, b"GET /healthz HTTP/1.0\n\n")
    assert status.startswith(b"HTTP/1.1 200 "), status
    assert body == b"ok\n"


async def test_a_head_over_the_limit_gets_431_in_our_words() -> None:
    async with _server() as port:
        status, _, body = await _exchange(port, b"GET /healthz HTTP/1.1\r\nX: " + b"a" * 20000)
    assert status.startswith(b"HTTP/1.1 431 "), status
    assert body == b"bad request: request head over 8192 bytes\n"


async def test_metrics_speak_openmetrics_when_asked() -> None:
    accept = b"application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"
    async with _server() as port:
        status, headers, body = await _exchange(
            port, b"GET /metrics HTTP/1.1\r\nHost: x\r\nAccept: " + accept + b"\r\n\r\n"
        )
    assert status.startswith(b"HTTP/1.1 200 ")
    assert headers[b"content-type"].startswith(b"application/openmetrics-text")
    assert body.endswith(b"# EOF\n")
    assert b"probe_marker_total 1.0" in body


async def test_metrics_are_gzipped_when_the_scraper_accepts_it() -> None:
    async with _server() as port:
        status, headers, body = await _exchange(
            port, b"GET /metrics HTTP/1.1\r\nHost: x\r\nAccept-Encoding: gzip\r\n\r\n"
        )
    assert status.startswith(b"HTTP/1.1 200 ")
    assert headers[b"content-encoding"] == b"gzip"
    assert int(headers[b"content-length"]) == len(body)
    assert b"probe_marker_total 1.0" in gzip.decompress(body)


async def test_an_http11_request_without_host_is_refused_as_rfc_9112_says() -> None:
    async with _server() as port:
        status, _, _ = await _exchange(port, b"GET /healthz HTTP/1.1\r\n\r\n")
        fine, _, _ = await _exchange(port, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    assert status.startswith(b"HTTP/1.1 400 "), status
    assert fine.startswith(b"HTTP/1.1 200 ")
