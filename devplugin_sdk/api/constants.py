"""Kubelet constants the device-plugin protocol relies on (k8s.io/kubelet deviceplugin/v1beta1
constants.go and the device manager's internal values), in one place."""

from __future__ import annotations

from typing import Final

HEALTHY: Final = "Healthy"
UNHEALTHY: Final = "Unhealthy"
VERSION: Final = "v1beta1"
SUPPORTED_VERSIONS: Final = ("v1beta1",)

# Fixed path: it does not follow the kubelet's --root-dir.
DEVICE_PLUGIN_PATH: Final = "/var/lib/kubelet/device-plugins"
KUBELET_SOCKET_NAME: Final = "kubelet.sock"
CHECKPOINT_NAME: Final = "kubelet_internal_checkpoint"
# Legacy name the kubelet never creates any more; plugins must not use it.
DEPRECATION_NAME: Final = "DEPRECATION"
# Follows --root-dir; used by the plugin-watcher registration path.
PLUGINS_REGISTRY_PATH: Final = "/var/lib/kubelet/plugins_registry"
PLUGIN_TYPE_DEVICE_PLUGIN: Final = "DevicePlugin"

PRE_START_CONTAINER_TIMEOUT_S: Final = 30.0
ENDPOINT_STOP_GRACE_PERIOD_S: Final = 300.0
KUBELET_DIAL_TIMEOUT_S: Final = 10.0
# grpc-go's default receive limit, which the kubelet never raises: every ListAndWatch message
# above it ends the stream with RESOURCE_EXHAUSTED.
MAX_MESSAGE_BYTES: Final = 4 * 1024 * 1024
# Linux sun_path holds 108 bytes including the terminating NUL.
MAX_SOCKET_PATH_BYTES: Final = 107
