"""One pod of a plugin's DaemonSet, served in the background until its SIGTERM.

A rolling upgrade runs two of them side by side, each with its own pod UID (so sockets of its
own names), and stops the old one once the new one is ready; tests and the upgrade benchmark
drive them the same way. ``DraNode`` runs its driver in one too.
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any

import anyio
import anyio.abc

from devplugin_sdk.plugin import DevicePlugin
from devplugin_sdk.runner import Running
from devplugin_sdk.settings import Settings
from devplugin_sdk.testing._serving import serving

__all__ = ["DaemonSetPod"]


class DaemonSetPod:
    """One instance of a DaemonSet's pod: ``serving(*plugins, settings=..., **options)`` run in a
    task group until ``stop()`` (its SIGTERM).

    Args:
        *plugins: The pod's plugins (a new pod has new plugin objects, as a new process would).
        settings: The pod's settings; a ``pod_uid`` of None gets a new UID (every pod of a
            DaemonSet has its own), ``""`` keeps the socket names without one.
        **options: ``serve``'s other arguments (``api=``, ``dra=``, ``observer=``, ...).

    Example::

        async with anyio.create_task_group() as tg:
            old = DaemonSetPod(StaticPlugin(RESOURCE, devices), settings=kubelet.settings())
            await old.start(tg)
            new = DaemonSetPod(StaticPlugin(RESOURCE, devices), settings=kubelet.settings())
            running = await new.start(tg)
            await kubelet.wait_for(lambda: all(s.registered for s in running.statuses()))
            await old.stop()
    """

    def __init__(self, *plugins: DevicePlugin, settings: Settings, **options: Any) -> None:
        if settings.pod_uid is None:
            settings = dataclasses.replace(settings, pod_uid=str(uuid.uuid4()))
        self.plugins = plugins
        self.settings = settings
        self.options = options
        self._scope = anyio.CancelScope()
        self._done = anyio.Event()

    @property
    def uid(self) -> str:
        """The pod's UID (``""``: none, the sockets keep their plain names)."""
        return self.settings.pod_uid or ""

    async def start(self, tg: anyio.abc.TaskGroup) -> Running:
        """Serve the plugins in ``tg``.

        Args:
            tg: The task group the pod runs in; an error that stops serving is raised there.

        Returns:
            ``serve``'s ``Running``, once every plugin has discovered its devices.
        """
        running: Running = await tg.start(self._run)
        return running

    async def _run(self, *, task_status: anyio.abc.TaskStatus[Running]) -> None:
        try:
            with self._scope:
                async with serving(
                    *self.plugins, settings=self.settings, **self.options
                ) as running:
                    task_status.started(running)
                    await anyio.sleep_forever()
        except anyio.get_cancelled_exc_class():
            if not self._scope.cancel_called:
                raise
            # Our own stop, re-raised by grpc.aio without anyio's mark (see Supervisor._start).
        finally:
            self._done.set()

    async def stop(self) -> None:
        """SIGTERM: the plugins shut down (streams end, sockets removed); returns once they have."""
        self._scope.cancel()
        await self._done.wait()
