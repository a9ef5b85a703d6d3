"""Test tools for plugin authors: ``FakeKubelet``, ``serving`` and ``StaticPlugin``.

``FakeKubelet`` plays the kubelet over real gRPC on real unix sockets; ``serving`` runs plugins
against it in the background of a test::

    async with FakeKubelet() as kubelet, serving(MyPlugin(), settings=kubelet.settings()):
        await kubelet.wait_for_allocatable("acme.com/widget", 4)
        got = await kubelet.allocate("acme.com/widget", 1)
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio

from devplugin_sdk import _lifecycle
from devplugin_sdk._fake_kubelet import (
    AdmissionError,
    ContainerAllocation,
    ContainerStartError,
    FakeKubelet,
    FakeKubeletError,
    KubeletDevice,
    Registration,
)
from devplugin_sdk.observe import Observer
from devplugin_sdk.plugin import DevicePlugin
from devplugin_sdk.settings import Settings
from devplugin_sdk.testing._static import StaticPlugin

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup  # type: ignore[import-not-found,unused-ignore]

__all__ = [
    "AdmissionError",
    "ContainerAllocation",
    "ContainerStartError",
    "FakeKubelet",
    "FakeKubeletError",
    "KubeletDevice",
    "Registration",
    "StaticPlugin",
    "serving",
]


@asynccontextmanager
async def serving(
    *plugins: DevicePlugin, settings: Settings, observer: Observer | None = None
) -> AsyncIterator[None]:
    """Serve ``plugins`` in the background for the body of the ``async with``.

    On exit the plugins shut down as on SIGTERM (streams end, servers stop, sockets removed).
    An error that stops serving (a rejected registration) is raised from the ``async with``.
    """
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(_lifecycle.serve, plugins, settings, observer)
            try:
                yield
            finally:
                tg.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        _lifecycle._reraise_single(group)
