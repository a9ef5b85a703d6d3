"""/healthz, /status and /metrics over real HTTP, against plugins served to a FakeKubelet."""

from __future__ import annotations

import errno
import http.client
import json
import socket
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import anyio
import anyio.to_thread
import pytest
from prometheus_client import CollectorRegistry
from sdk_helpers import RESOURCE, widgets

from devplugin_sdk import Health, healthz
from devplugin_sdk.observe import PluginStatus
from devplugin_sdk.runner import Http, serve
from devplugin_sdk.testing import FakeKubelet, StaticPlugin, serving

OTHER = "acme.com/gadget"


@dataclass(frozen=True)
class Reply:
    status: int
    body: str
    headers: dict[str, str]


async def request(port: int, path: str, method: str = "GET") -> Reply:
    """One real HTTP request with the standard library's client (in a worker thread)."""

    def call() -> Reply:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        try:
            conn.request(method, path)
            response = conn.getresponse()
            body = response.read().decode()
            return Reply(response.status, body, {k.lower(): v for k, v in response.getheaders()})
        finally:
            conn.close()

    return await anyio.to_thread.run_sync(call)


@asynccontextmanager
async def http_server(
    *,
    statuses: healthz.StatusSource,
    registry: CollectorRegistry | None = None,
    stuck_after: float = healthz.DEFAULT_STUCK_AFTER,
    max_connections: int = healthz.DEFAULT_MAX_CONNECTIONS,
) -> AsyncIterator[int]:
    async with anyio.create_task_group() as tg:
        port = await tg.start(
            partial(
                healthz.serve_http,
                "127.0.0.1",
                0,
                statuses=statuses,
                registry=registry,
                stuck_after=stuck_after,
                max_connections=max_connections,
            )
        )
        yield port
        tg.cancel_scope.cancel()


def status(resource: str = RESOURCE, **fields: Any) -> PluginStatus:
    """A registered, up-to-date plugin's status, with ``fields`` changed."""
    base = PluginStatus(resource, registered=True, streams=1, pending_seconds=0.0, devices={})
    return replace(base, **fields)


def statuses_of(*items: PluginStatus) -> healthz.StatusSource:
    return lambda: list(items)


# ----------------------------------------------------------------------------- against FakeKubelet


def local_http(**fields: Any) -> Http:
    """The runner's HTTP endpoints on a free loopback port, with their own metrics registry."""
    return Http(port=0, host="127.0.0.1", registry=CollectorRegistry(), **fields)


async def test_healthz_is_ok_when_every_plugin_is_registered(kubelet: FakeKubelet) -> None:
    plugins = StaticPlugin(RESOURCE, widgets(2)), StaticPlugin(OTHER, widgets(1))
    async with serving(*plugins, settings=kubelet.settings(), http=local_http()) as running:
        port = running.http_port
        assert port is not None
        await kubelet.wait_for_allocatable(RESOURCE, 2)
        await kubelet.wait_for_allocatable(OTHER, 1)
        reply = await request(port, "/healthz")
    assert (reply.status, reply.body) == (200, "ok\n")
    assert reply.headers["content-type"].startswith("text/plain")


async def test_healthz_fails_naming_the_resource_while_the_kubelet_is_away(
    kubelet: FakeKubelet,
) -> None:
    plugins = StaticPlugin(RESOURCE, widgets(2)), StaticPlugin(OTHER, widgets(1))
    async with serving(*plugins, settings=kubelet.settings(), http=local_http()) as running:
        port = running.http_port
        assert port is not None
        await kubelet.wait_for_allocatable(RESOURCE, 2)
        await kubelet.wait_for_allocatable(OTHER, 1)
        await kubelet.stop()
        await kubelet.wait_for(
            lambda: not any(s.registered for s in running.statuses()),
            what="both plugins unregistered",
        )
        away = await request(port, "/healthz")
        await kubelet.start()
        await kubelet.wait_for(
            lambda: all(s.registered for s in running.statuses()),
            what="both plugins registered again",
        )
        back = await request(port, "/healthz")
    assert away.status == 503
    assert f"{RESOURCE}: not registered with the kubelet" in away.body
    assert f"{OTHER}: not registered with the kubelet" in away.body
    assert back.status == 200


async def test_an_unhealthy_device_does_not_fail_healthz(kubelet: FakeKubelet) -> None:
    plugin = StaticPlugin(RESOURCE, widgets(2))
    async with serving(plugin, settings=kubelet.settings(), http=local_http()) as running:
        port = running.http_port
        assert port is not None
        await kubelet.wait_for_allocatable(RESOURCE, 2)
        plugin.set_health("w1", Health.UNHEALTHY)
        await kubelet.wait_for_allocatable(RESOURCE, 1)
        reply = await request(port, "/healthz")
        document = json.loads((await request(port, "/status")).body)
    assert (reply.status, reply.body) == (200, "ok\n")
    assert document["live"] is True
    (entry,) = document["plugins"]
    assert entry["resource"] == RESOURCE
    assert entry["registered"] is True
    assert entry["devices"] == {"Healthy": 1, "Unhealthy": 1}


async def test_the_runner_serves_plugins_metrics_and_health_together(
    kubelet: FakeKubelet,
) -> None:
    plugin = StaticPlugin(RESOURCE, widgets(3))
    async with anyio.create_task_group() as tg:
        running = await tg.start(
            partial(serve, plugin, settings=kubelet.settings(), http=local_http())
        )
        port = running.http_port
        await kubelet.wait_for_allocatable(RESOURCE, 3)
        await kubelet.allocate(RESOURCE, 1)
        health = await request(port, "/healthz")
        metrics = await request(port, "/metrics")
        tg.cancel_scope.cancel()
    assert health.status == 200
    # The state series read this runner's plugins (Observer.serving), not a global.
    assert f'devplugin_registered{{resource="{RESOURCE}"}} 1.0' in metrics.body
    assert metrics.status == 200
    assert f'devplugin_registrations_total{{resource="{RESOURCE}"}} 1.0' in metrics.body
    assert f'devplugin_allocations_total{{resource="{RESOURCE}"}} 1.0' in metrics.body
    assert f'devplugin_devices{{health="Healthy",resource="{RESOURCE}"}} 3.0' in metrics.body


# ----------------------------------------------------------------------------- decisions


async def test_healthz_fails_when_nothing_is_served() -> None:
    async with http_server(statuses=statuses_of()) as port:
        reply = await request(port, "/healthz")
    assert (reply.status, reply.body) == (503, "no plugin is being served\n")


async def test_healthz_fails_when_a_device_list_is_stuck_unsent() -> None:
    stuck = status(OTHER, pending_seconds=45.0)
    async with http_server(statuses=statuses_of(status(), stuck), stuck_after=30) as port:
        reply = await request(port, "/healthz")
        document = json.loads((await request(port, "/status")).body)
    assert reply.status == 503
    assert reply.body.startswith(f"{OTHER}: ListAndWatch loop stuck")
    assert RESOURCE not in reply.body
    assert document["live"] is False
    assert document["problems"] == [reply.body.strip()]


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({}, []),
        ({"devices": {"Unhealthy": 4}}, []),
        ({"pending_seconds": 29.9}, []),
        ({"pending_seconds": 30.1}, ["stuck"]),
        ({"registered": False, "streams": 0}, ["not registered", "no ListAndWatch stream"]),
        (
            {"registered": False, "streams": 2},
            ["not registered", "no ListAndWatch stream from the kubelet; 2 from other"],
        ),
    ],
)
def test_problems_name_only_registration_and_stuck_lists(
    fields: dict[str, Any], expected: Sequence[str]
) -> None:
    found = healthz.problems([status(**fields)], stuck_after=30.0)
    if not expected:
        assert found == []
    else:
        (line,) = found
        assert line.startswith(f"{RESOURCE}: ")
        for text in expected:
            assert text in line


async def test_stuck_after_must_be_positive() -> None:
    with pytest.raises(ValueError, match="stuck_after"):
        await healthz.serve_http("127.0.0.1", 0, statuses=list, stuck_after=0)


# ----------------------------------------------------------------------------- HTTP details


async def test_head_answers_headers_without_a_body() -> None:
    async with http_server(statuses=statuses_of(status())) as port:
        reply = await request(port, "/healthz", method="HEAD")
    assert reply.status == 200
    assert reply.body == ""
    assert reply.headers["content-length"] == "3"


async def test_unknown_paths_and_methods_are_refused() -> None:
    async with http_server(statuses=statuses_of(status())) as port:
        missing = await request(port, "/nope")
        posted = await request(port, "/healthz", method="POST")
        with_query = await request(port, "/healthz?verbose=1")
    assert missing.status == 404
    assert posted.status == 405
    assert posted.headers["allow"] == "GET, HEAD"
    assert with_query.status == 200


async def test_garbage_gets_400_and_the_server_keeps_serving() -> None:
    async with http_server(statuses=statuses_of(status())) as port:
        async with await anyio.connect_tcp("127.0.0.1", port) as stream:
            await stream.send(b"\x00\xff garbage\r\n\r\n")
            answer = await stream.receive()
        async with await anyio.connect_tcp("127.0.0.1", port) as stream:
            await stream.send(b"GET /healthz HTTP/1.1\r\nX: " + b"a" * 20000)  # never ends
            too_big = await stream.receive()
        async with await anyio.connect_tcp("127.0.0.1", port) as stream:
            await stream.send(b"GET /heal")  # the client gives up half-way
        reply = await request(port, "/healthz")
    assert answer.startswith(b"HTTP/1.1 400 ")
    assert too_big.startswith(b"HTTP/1.1 431 ")  # Request Header Fields Too Large
    assert reply.status == 200


async def test_metrics_serves_the_given_registry() -> None:
    from prometheus_client import Counter

    registry = CollectorRegistry()
    Counter("probe_marker", "test counter", registry=registry).inc()
    async with http_server(statuses=statuses_of(status()), registry=registry) as port:
        reply = await request(port, "/metrics")
    assert reply.status == 200
    assert reply.headers["content-type"].startswith("text/plain; version=")
    assert "probe_marker_total 1.0" in reply.body


async def test_metrics_without_prometheus_client_names_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(__import__("sys").modules, "prometheus_client", None)
    async with http_server(statuses=statuses_of(status())) as port:
        reply = await request(port, "/metrics")
        health = await request(port, "/healthz")
    assert reply.status == 404
    assert "devplugin-sdk[metrics]" in reply.body
    assert health.status == 200


async def test_a_taken_port_fails_at_start() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError) as refused:  # noqa: PT011 - its errno, not its words
            await healthz.serve_http("127.0.0.1", port, statuses=list)
    assert refused.value.errno == errno.EADDRINUSE


async def test_idle_connections_past_the_cap_close_the_oldest_and_probes_still_get_answers() -> (
    None
):
    async with http_server(statuses=statuses_of(status()), max_connections=4) as port:
        idle = [await anyio.connect_tcp("127.0.0.1", port) for _ in range(10)]
        try:
            reply = await request(port, "/healthz")
            # The six oldest were closed by the server to make room (EOF, nothing sent).
            with anyio.fail_after(5):
                for stream in idle[:6]:
                    with pytest.raises((anyio.EndOfStream, anyio.BrokenResourceError)):
                        await stream.receive()
            # The newest ones are still being served: a request on one gets its answer.
            await idle[-1].send(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            with anyio.fail_after(5):
                late = await idle[-1].receive()
        finally:
            for stream in idle:
                await stream.aclose()
    assert (reply.status, reply.body) == (200, "ok\n")
    assert late.startswith(b"HTTP/1.1 200 ")


@pytest.mark.parametrize("value", [0, -1])
async def test_max_connections_must_be_positive(value: int) -> None:
    with pytest.raises(ValueError, match="max_connections"):
        await healthz.serve_http("127.0.0.1", 0, statuses=list, max_connections=value)
    with pytest.raises(ValueError, match="max_connections"):
        Http(port=0, max_connections=value)
