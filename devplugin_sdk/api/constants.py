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

# The kubelet's DRA plugins (k8s.io/kubelet pkg/apis/pluginregistration/v1 constants.go,
# pkg/apis/dra/*/types.go, k8s.io/dynamic-resource-allocation kubeletplugin).
PLUGIN_TYPE_DRA_PLUGIN: Final = "DRAPlugin"
# A DRA plugin lists the gRPC services it serves as its "supported versions"; the kubelet takes
# the first one in the plugin's order that it speaks (v1 from Kubernetes 1.34, v1beta1 in 1.32).
DRA_SERVICE_V1: Final = "v1.DRAPlugin"
DRA_SERVICE_V1BETA1: Final = "v1beta1.DRAPlugin"
# The health stream a DRA plugin may serve beside DRAPlugin, listed the same way
# (k8s.io/kubelet pkg/apis/dra-health/*/types.go): v1alpha1 from Kubernetes 1.34, v1 from 1.37;
# a kubelet that speaks both prefers v1. It retries a failed stream every 5 s.
DRA_HEALTH_SERVICE_V1: Final = "v1.DRAResourceHealth"
DRA_HEALTH_SERVICE_V1ALPHA1: Final = "v1alpha1.DRAResourceHealth"
# How long the kubelet trusts a device's health without a newer report, when the plugin gives
# no health_check_timeout_seconds (pkg/kubelet/cm/dra/healthinfo.go, healthTimeout); past it
# the device is Unknown in the pod's status.
DRA_HEALTH_TIMEOUT_S: Final = 30
# The kubelet truncates a longer health message to 1021 characters and "...".
DRA_HEALTH_MESSAGE_MAX: Final = 1024
# Where kubeletplugin puts a driver's dra.sock (in a directory of its own, <dir>/<driver>).
DRA_PLUGINS_PATH: Final = "/var/lib/kubelet/plugins"
# The kubelet's deadline on NodePrepareResources/NodeUnprepareResources (pkg/kubelet/cm/dra/
# plugin, defaultClientCallTimeout: half its retry period).
DRA_CALL_TIMEOUT_S: Final = 45.0
# The kubelet deletes a driver's ResourceSlices this long after its last plugin went away
# (pkg/kubelet/cm/dra, defaultWipingDelay), and every slice of the node when it starts.
DRA_WIPING_DELAY_S: Final = 30.0
