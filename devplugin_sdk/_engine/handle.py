"""What a registration strategy gets of one served plugin, and the strategy type itself.

``ServedPlugin`` builds one ``PluginHandle`` per plugin and runs the ``Strategy`` the runner chose
once for the process (``kubelet_sock``, ``plugin_watcher``, the DRA driver's) with it. The
handle is the whole seam: a strategy serves through ``serving()``/``stop()``, records
registrations on ``link`` and the kubelet's stream on ``streams``, and never sees the servicer,
which only serves RPCs.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc

from devplugin_sdk._engine.kubelet_watch import DirectoryWatcher
from devplugin_sdk._engine.link import Link
from devplugin_sdk._engine.servicer import DevicePluginServicer, Serving
from devplugin_sdk._engine.state import DeviceState
from devplugin_sdk._engine.streams import Streams
from devplugin_sdk.plugin import DevicePlugin
from devplugin_sdk.settings import Settings

__all__ = ["PluginHandle", "Strategy"]


@dataclass(frozen=True, eq=False)
class PluginHandle:
    """One served plugin, as its registration strategy sees it.

    Attributes:
        plugin: The plugin (its hooks; a DRA driver prepares claims with them).
        state: Its device state.
        streams: Its ListAndWatch bookkeeping (which stream is the kubelet's).
        link: Its registration state.
    """

    plugin: DevicePlugin
    state: DeviceState
    streams: Streams
    link: Link
    _servicer: DevicePluginServicer

    @property
    def resource(self) -> str:
        """The resource name."""
        return self.plugin.resource_name

    @property
    def socket_name(self) -> str:
        """The plugin's socket file name."""
        return self.plugin.effective_socket_name

    @property
    def pre_start_required(self) -> bool:
        """Whether Register asks the kubelet for PreStartContainer calls."""
        return self._servicer.pre_start_required

    @property
    def preferred_allocation(self) -> bool:
        """Whether Register asks the kubelet for GetPreferredAllocation calls."""
        return self._servicer.preferred_allocation

    def serving(self) -> Serving:
        """A new server's share of the DevicePlugin service (its handler and its streams)."""
        return self._servicer.serving()

    async def stop(self, server: grpc.aio.Server, serving: Serving, grace: float) -> None:
        """Stop ``server``: in-flight calls get ``grace``, ``serving``'s streams end cleanly."""
        await self._servicer.stop(server, serving, grace)


#: How a plugin gets registered, until cancelled: ``kubelet_sock.keep_registered``,
#: ``plugin_watcher.keep_registered`` or the DRA driver's (``dra._driver``).
Strategy = Callable[[PluginHandle, Settings, DirectoryWatcher], Awaitable[None]]
