"""Test tools for plugin authors: ``FakeKubelet``, ``serving``, ``StaticPlugin`` and, for DRA,
``MemoryApi`` (ResourceClaims and ResourceSlices in memory) with ``FakeKubelet.dra``.

``FakeKubelet`` plays the kubelet over real gRPC on real unix sockets; ``serving`` runs plugins
against it in the background of a test, through the one runner (``devplugin_sdk.serve``)::

    async with FakeKubelet() as kubelet, serving(MyPlugin(), settings=kubelet.settings()):
        await kubelet.wait_for_allocatable("acme.com/widget", 4)
        got = await kubelet.allocate("acme.com/widget", 1)

``watching`` runs a plugin's ``watch()`` alone, as the SDK runs it, for tests of pushed health::

    async with watching(plugin) as events:
        assert await events.next_event() == HealthEvent("dev0", Health.UNHEALTHY, "gone")
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import anyio

from devplugin_sdk.kubelet.fake import (
    AdmissionError,
    ContainerAllocation,
    ContainerStartError,
    FakeKubelet,
    FakeKubeletError,
    KubeletDevice,
    Registration,
)
from devplugin_sdk.kubelet.fake_dra import DraPod, PodPreparationError, PreparedPod
from devplugin_sdk.kubelet.memory_api import MemoryApi
from devplugin_sdk.plugin import DevicePlugin
from devplugin_sdk.runner import Running, raise_errors, serve
from devplugin_sdk.testing._static import StaticPlugin
from devplugin_sdk.testing._watching import WatchedEvents, watching

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup  # type: ignore[import-not-found,unused-ignore]

__all__ = [
    "AdmissionError",
    "ContainerAllocation",
    "ContainerStartError",
    "DraPod",
    "FakeKubelet",
    "FakeKubeletError",
    "KubeletDevice",
    "MemoryApi",
    "PodPreparationError",
    "PreparedPod",
    "Registration",
    "StaticPlugin",
    "WatchedEvents",
    "serving",
    "watching",
]


@asynccontextmanager
async def serving(*plugins: DevicePlugin, **options: Any) -> AsyncIterator[Running]:
    """Run ``devplugin_sdk.serve`` in the background for the body of an ``async with``.

    Takes ``serve``'s arguments (``settings=``, ``observer=``, ``http=``, ``reload=``) and
    yields its ``runner.Running`` once every plugin has discovered its devices (and the HTTP
    port, if any, is bound). On exit the plugins shut down as on SIGTERM (streams end, servers
    stop, sockets removed). An error that stops serving (a rejected registration) is raised from
    the ``async with``.
    """
    try:
        async with anyio.create_task_group() as tg:
            running: Running = await tg.start(partial(serve, *plugins, **options))
            try:
                yield running
            finally:
                tg.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        raise_errors(group)
