"""The plugin-watcher registration service (pluginregistration v1), served by the plugin.

The kubelet finds our socket in plugins_registry, calls GetInfo (1 s deadline), validates it,
connects to the DevicePlugin service (an empty endpoint means this same socket) and reports the
outcome through NotifyRegistrationStatus. The kubelet's side of those two calls (``get_info``,
``notify_status``) is here too, for the simulated kubelet.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from devplugin_sdk._wire import client
from devplugin_sdk._wire.server import unary
from devplugin_sdk.api import constants
from devplugin_sdk.api.pluginregistration.v1 import pluginregistration_pb2 as preg

__all__ = ["PluginInfo", "get_info", "handler", "notify_status"]


def handler(
    resource_name: str,
    on_status: Callable[[bool, str], None],
    on_info: Callable[[], None] | None = None,
    *,
    plugin_type: str = constants.PLUGIN_TYPE_DEVICE_PLUGIN,
    endpoint: str = "",
    versions: Sequence[str] = constants.SUPPORTED_VERSIONS,
) -> grpc.GenericRpcHandler:
    """The ``pluginregistration.Registration`` handler for one device plugin (or, with
    ``plugin_type="DRAPlugin"``, one DRA driver: its name, its DRA socket's absolute path as
    ``endpoint`` and its gRPC services as ``versions``).

    ``on_info`` is called on each GetInfo (the kubelet starting a registration); ``on_status``
    with what NotifyRegistrationStatus reports.
    """
    info = preg.PluginInfo(
        type=plugin_type,
        name=resource_name,
        # Empty: the kubelet dials this same socket for v1beta1.DevicePlugin.
        endpoint=endpoint,
        supported_versions=list(versions),
    )

    async def get_info(
        request: preg.InfoRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> preg.PluginInfo:
        if on_info is not None:
            on_info()
        return info

    async def notify(
        request: preg.RegistrationStatus, context: grpc.aio.ServicerContext[Any, Any]
    ) -> preg.RegistrationStatusResponse:
        on_status(request.plugin_registered, request.error)
        return preg.RegistrationStatusResponse()

    return grpc.method_handlers_generic_handler(
        "pluginregistration.Registration",
        {
            "GetInfo": unary(get_info, preg.InfoRequest, preg.PluginInfo),
            "NotifyRegistrationStatus": unary(
                notify, preg.RegistrationStatus, preg.RegistrationStatusResponse
            ),
        },
    )


# ------------------------------------------------------------------ the kubelet's side


@dataclass(frozen=True, slots=True)
class PluginInfo:
    """What a plugin's GetInfo answered."""

    type: str
    name: str
    endpoint: str
    supported_versions: tuple[str, ...]


async def get_info(path: Path, *, dial_timeout: float, timeout: float = 1.0) -> PluginInfo:
    """Dial the registration socket at ``path`` and call GetInfo, as the plugin watcher does.

    Raises:
        TimeoutError: the socket did not accept within ``dial_timeout`` seconds.
        grpc.aio.AioRpcError: GetInfo failed, took longer than ``timeout`` seconds, or answered
            something that is not a PluginInfo (INTERNAL).
    """
    async with grpc.aio.insecure_channel(f"unix:{path}") as channel:
        if not await client.ready(channel, dial_timeout):
            raise TimeoutError
        get = client.Unary[preg.InfoRequest, preg.PluginInfo](
            channel, "/pluginregistration.Registration/GetInfo", preg.PluginInfo
        )
        info = await get(preg.InfoRequest(), timeout=timeout)
    return PluginInfo(
        type=info.type,
        name=info.name,
        endpoint=info.endpoint,
        supported_versions=tuple(info.supported_versions),
    )


async def notify_status(path: Path, registered: bool, error: str, *, timeout: float = 5.0) -> None:
    """Call NotifyRegistrationStatus on the registration socket at ``path``.

    Raises:
        grpc.aio.AioRpcError: the call failed.
    """
    async with grpc.aio.insecure_channel(f"unix:{path}") as channel:
        notify = client.Unary[preg.RegistrationStatus, preg.RegistrationStatusResponse](
            channel,
            "/pluginregistration.Registration/NotifyRegistrationStatus",
            preg.RegistrationStatusResponse,
        )
        await notify(
            preg.RegistrationStatus(plugin_registered=registered, error=error), timeout=timeout
        )
