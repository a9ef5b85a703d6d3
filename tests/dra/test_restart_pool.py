"""A driver restarted over its pool writes nothing short of the devices until its plugins have
reported them: the watch starts with the slices that exist (as the API server's does), and
discovery may be slow (issue 26)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import pytest
from dra_helpers import DRIVER
from kube_apiserver import FakeApiServer
from sdk_helpers import RESOURCE, widgets

from devplugin_sdk import Device
from devplugin_sdk.dra._pool import plugins as _plugins
from devplugin_sdk.testing import DraNode, MemoryApi, StaticPlugin, serving


class SlowPlugin(StaticPlugin):
    """Discovers its devices only once ``released`` is set (a slow driver library)."""

    def __init__(self, resource: str, devices: list[Device], released: anyio.Event) -> None:
        super().__init__(resource, devices)
        self.released = released

    async def discover(self) -> list[Device]:
        await self.released.wait()
        return list(await super().discover())


def _writes(api: MemoryApi, since: int) -> list[tuple[str, int]]:
    """Every slice write (and delete) the API saw after ``since``, with its device count."""
    changes = api.changes_since(since)
    assert changes is not None
    return [(kind, len(s.devices)) for kind, s in changes[1] if s.driver == DRIVER]


async def _serve_until(stop: anyio.Event, *plugins: Any, **options: Any) -> None:
    async with serving(*plugins, **options):
        await stop.wait()


async def _restart_over_pool(node: DraNode, watches: Callable[[], int]) -> int:
    """Serve 4 devices until published, stop; a restarted driver with a slow discovery runs
    until the pool is published again. The generation of the API before the restart."""
    kubelet, api = node.kubelet, node.api
    options = {"api": "dra", "dra": node.options}
    async with serving(StaticPlugin(RESOURCE, widgets(4)), settings=kubelet.settings(), **options):
        await node.ready()
    (pool,) = api.pool(DRIVER, "node-1")
    assert len(pool.devices) == 4
    before = api.generation
    released, stop = anyio.Event(), anyio.Event()
    plugin = SlowPlugin(RESOURCE, widgets(4), released)
    async with anyio.create_task_group() as tg:
        tg.start_soon(partial(_serve_until, stop, plugin, settings=kubelet.settings(), **options))
        await kubelet.wait_for(lambda: watches() >= 2, what="the restarted driver's watch")
        # Whatever the restarted driver does before its plugin has discovered, it has done.
        await anyio.wait_all_tasks_blocked()
        released.set()
        await node.ready()
        stop.set()
    return before


async def test_a_restart_over_the_pool_never_writes_it_short() -> None:
    api = MemoryApi(nodes=["node-1"])
    async with DraNode(driver=DRIVER, memory=api) as node:
        before = await _restart_over_pool(node, lambda: api.calls.get("watch_slices", 0))
    # The pool was already right: nothing to write at all.
    assert _writes(api, before) == []


async def test_a_restart_through_the_real_client_never_writes_the_pool_short(
    tmp_path: Path,
) -> None:
    memory = MemoryApi(nodes=["node-1"])
    async with (
        FakeApiServer(memory).serving() as server,
        DraNode(
            driver=DRIVER, memory=memory, api=None, kubeconfig=server.kubeconfig(tmp_path / "k")
        ) as node,
    ):
        before = await _restart_over_pool(node, lambda: len(server.watch_queries))
    assert _writes(memory, before) == []


async def test_a_plugin_that_never_reports_is_waited_for_a_bounded_time(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bound passed, the pool is published with what the other plugins report, and one
    warning names the plugin waited for."""
    monkeypatch.setattr(_plugins, "FIRST_LIST_WAIT", 0.2)
    caplog.set_level(logging.WARNING, "devplugin_sdk")
    api = MemoryApi(nodes=["node-1"])
    hung = SlowPlugin("acme.com/gadget", [Device("g0")], anyio.Event())
    async with DraNode(driver=DRIVER, memory=api) as node, anyio.create_task_group() as tg:
        plugins = (StaticPlugin(RESOURCE, widgets(2)), hung)
        options = {"api": "dra", "dra": node.options}
        serve = partial(
            _serve_until, anyio.Event(), *plugins, settings=node.kubelet.settings(), **options
        )
        tg.start_soon(serve)
        await node.ready()
        (pool,) = api.pool(DRIVER, "node-1")
        assert [d.name for d in pool.devices] == ["w0", "w1"]
        tg.cancel_scope.cancel()
    waited = [r.getMessage() for r in caplog.records if "acme.com/gadget" in r.getMessage()]
    assert len(waited) == 1, waited
    assert "publishing without" in waited[0]
