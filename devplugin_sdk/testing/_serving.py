"""``serving``: the one runner (``devplugin_sdk.serve``) in the background of a test.

Every other tool of the kit that runs plugins (``DaemonSetPod``, ``DraNode``, the pytest fixtures)
goes through it, so a test serves plugins exactly as a node does.
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import anyio

from devplugin_sdk.plugin import DevicePlugin
from devplugin_sdk.runner import Running, raise_errors, serve

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup  # type: ignore[import-not-found,unused-ignore]

__all__ = ["serving"]


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
