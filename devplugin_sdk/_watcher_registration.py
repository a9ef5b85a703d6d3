"""The plugin-watcher registration service (pluginregistration v1), served by the plugin.

The kubelet finds our socket in plugins_registry, calls GetInfo (1 s deadline), validates it,
connects to the DevicePlugin service (an empty endpoint means this same socket) and reports the
outcome through NotifyRegistrationStatus.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

from devplugin_sdk.api import constants
from devplugin_sdk.api.pluginregistration.v1 import pluginregistration_pb2 as preg

__all__ = ["handler"]


def handler(resource_name: str, on_status: Callable[[bool, str], None]) -> grpc.GenericRpcHandler:
    """The ``pluginregistration.Registration`` handler for one device plugin."""
    info = preg.PluginInfo(
        type=constants.PLUGIN_TYPE_DEVICE_PLUGIN,
        name=resource_name,
        # Empty: the kubelet dials this same socket for v1beta1.DevicePlugin.
        endpoint="",
        supported_versions=list(constants.SUPPORTED_VERSIONS),
    )

    async def get_info(
        request: preg.InfoRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> preg.PluginInfo:
        return info

    async def notify(
        request: preg.RegistrationStatus, context: grpc.aio.ServicerContext[Any, Any]
    ) -> preg.RegistrationStatusResponse:
        on_status(request.plugin_registered, request.error)
        return preg.RegistrationStatusResponse()

    return grpc.method_handlers_generic_handler(
        "pluginregistration.Registration",
        {
            "GetInfo": grpc.unary_unary_rpc_method_handler(
                get_info,
                request_deserializer=preg.InfoRequest.FromString,
                response_serializer=preg.PluginInfo.SerializeToString,
            ),
            "NotifyRegistrationStatus": grpc.unary_unary_rpc_method_handler(
                notify,
                request_deserializer=preg.RegistrationStatus.FromString,
                response_serializer=preg.RegistrationStatusResponse.SerializeToString,
            ),
        },
    )
