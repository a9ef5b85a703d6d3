"""devplugin-sdk: write Kubernetes device plugins in Python.

Subclass ``DevicePlugin``, describe your devices, and ``run()`` it: the SDK owns the socket,
registration with the kubelet, recovery after kubelet restarts, ListAndWatch and the allocation
RPCs. ``devplugin_sdk.runner`` holds the runner's options (HTTP endpoints, hot reload);
``devplugin_sdk.testing`` has ``FakeKubelet`` for your tests.
"""

from devplugin_sdk.errors import (
    AllocationError,
    BackendError,
    ConfigError,
    DevicePluginError,
    MissingDependencyError,
    RegistrationRejectedError,
    SocketInUseError,
    UnknownDeviceError,
)
from devplugin_sdk.plugin import DevicePlugin
from devplugin_sdk.runner import run, serve
from devplugin_sdk.settings import Settings
from devplugin_sdk.types import (
    Allocation,
    Device,
    DeviceNode,
    Health,
    HealthEvent,
    Mount,
    RescanEvent,
    replicate,
)

__version__ = "0.1.0"

# Only what a plugin author needs; everything else lives in its module (runner, config,
# allocation, cdi, fswatch, observe, metrics, healthz, testing).
__all__ = [
    "Allocation",
    "AllocationError",
    "BackendError",
    "ConfigError",
    "Device",
    "DeviceNode",
    "DevicePlugin",
    "DevicePluginError",
    "Health",
    "HealthEvent",
    "MissingDependencyError",
    "Mount",
    "RegistrationRejectedError",
    "RescanEvent",
    "Settings",
    "SocketInUseError",
    "UnknownDeviceError",
    "replicate",
    "run",
    "serve",
]
