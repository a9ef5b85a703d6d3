"""The SDK's exceptions, in one small tree.

::

    DevicePluginError
    ├── RegistrationRejectedError       the kubelet refused for good (version, resource name)
    ├── SocketInUseError                another live server answers on our socket path
    ├── AllocationError                 an Allocate/PreStartContainer request cannot be served
    │   └── UnknownDeviceError          the request names device IDs the plugin does not have
    ├── BackendError                    the hardware layer failed (NVML, sysfs, ...)
    │   └── MissingDependencyError      an optional extra is not installed
    ├── ConfigError                     a configuration file or value is invalid
    └── KubeApiError                    the Kubernetes API refused a DRA request (status, reason)

Misuse of the API (a bad resource name, a bad socket name) raises ``ValueError`` at
construction instead. ``_rpc`` maps these to gRPC status codes, in that one place.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = [
    "AllocationError",
    "BackendError",
    "ConfigError",
    "DevicePluginError",
    "KubeApiError",
    "MissingDependencyError",
    "RegistrationRejectedError",
    "SocketInUseError",
    "UnknownDeviceError",
]


class DevicePluginError(Exception):
    """Base class of every error the SDK raises on purpose."""


class RegistrationRejectedError(DevicePluginError):
    """The kubelet rejected the registration for a reason that retrying cannot fix."""


class SocketInUseError(DevicePluginError):
    """Another live server answers on the plugin's socket path; the SDK will not steal it."""


class AllocationError(DevicePluginError):
    """A request cannot be served; the message is returned to the kubelet."""


class UnknownDeviceError(AllocationError):
    """A request named device IDs that the plugin does not have."""

    def __init__(self, resource_name: str, device_ids: Iterable[str]) -> None:
        self.device_ids = tuple(device_ids)
        super().__init__(f"{resource_name}: unknown device IDs: {summarize_ids(self.device_ids)}")


def summarize_ids(ids: Iterable[str], limit: int = 10, width: int = 80) -> str:
    """``a, b, c`` for the first ``limit`` IDs (each cut to ``width`` characters), then
    ``and N more``: an error status travels in gRPC metadata, which allows about 16 KiB."""
    ordered = sorted(ids)
    shown = [i if len(i) <= width else i[: width - 3] + "..." for i in ordered[:limit]]
    rest = len(ordered) - len(shown)
    return ", ".join(shown) + (f" and {rest} more" if rest > 0 else "")


class BackendError(DevicePluginError):
    """The hardware layer failed (NVML, sysfs, a driver)."""


class MissingDependencyError(BackendError, ImportError):
    """An optional dependency is missing; the message names the extra to install."""


class ConfigError(DevicePluginError, ValueError):
    """A configuration value is invalid; the message names the key and the reason."""

    def __init__(self, key: str, reason: str) -> None:
        self.key = key
        self.reason = reason
        super().__init__(f"{key}: {reason}")


class KubeApiError(DevicePluginError):
    """The Kubernetes API answered a DRA driver's request with an error.

    Attributes:
        status: The HTTP status (404 not found, 409 conflict, 403 forbidden...); 0 when the API
            server could not be reached.
        reason: The API server's message (printable, at most a few hundred characters).
        malformed: The answer was not what the API server sends (HTML from a proxy, a 503 with
            an odd body, a list where an object goes, deep JSON, garbage): retryable, and it
            proves nothing (a proxy's 404 page says nothing about the object).
    """

    def __init__(self, status: int, reason: str, *, malformed: bool = False) -> None:
        self.status = status
        self.reason = reason
        self.malformed = malformed
        super().__init__(f"Kubernetes API: {status or 'unreachable'}: {reason}")

    @property
    def not_found(self) -> bool:
        """Whether the API server said the object does not exist (404, its own ``Status``)."""
        return self.status == 404 and not self.malformed

    @property
    def conflict(self) -> bool:
        """Whether the write lost a race (409: the object changed or already exists)."""
        return self.status == 409 and not self.malformed
