"""devplugin-sdk: write Kubernetes device plugins in Python.

Subclass ``DevicePlugin``, describe your devices, and ``run()`` it: the SDK owns the socket,
registration with the kubelet, recovery after kubelet restarts, ListAndWatch and the allocation
RPCs. ``devplugin_sdk.runner`` holds the runner's options (HTTP endpoints, hot reload);
``devplugin_sdk.testing`` has ``FakeKubelet`` for your tests.

The names below load from their modules on first use: ``import devplugin_sdk`` alone loads
nothing else, so the ``devplugin`` command decides what loads first (cold start).
"""

import importlib
import typing

if typing.TYPE_CHECKING:
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

# The module each name of ``__all__`` comes from.
_MODULES = {
    "errors": (
        "AllocationError",
        "BackendError",
        "ConfigError",
        "DevicePluginError",
        "MissingDependencyError",
        "RegistrationRejectedError",
        "SocketInUseError",
        "UnknownDeviceError",
    ),
    "plugin": ("DevicePlugin",),
    "runner": ("run", "serve"),
    "settings": ("Settings",),
    "types": (
        "Allocation",
        "Device",
        "DeviceNode",
        "Health",
        "HealthEvent",
        "Mount",
        "RescanEvent",
        "replicate",
    ),
}
_MODULE_OF = {name: module for module, names in _MODULES.items() for name in names}


def __getattr__(name: str) -> object:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'devplugin_sdk' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"devplugin_sdk.{module}"), name)
    globals()[name] = value  # once loaded, a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
