"""What can go wrong talking to a plugin socket, each with a stable ``kind`` for scripts."""

from __future__ import annotations

import grpc

__all__ = [
    "NotADevicePluginError",
    "NotAnsweringError",
    "PluginRpcError",
    "ProbeError",
    "ProtocolViolation",
    "SocketMissingError",
]


class ProbeError(Exception):
    """Talking to the plugin failed; ``kind`` is a stable word for scripts (``--json``)."""

    kind = "probe-error"


class SocketMissingError(ProbeError):
    """Nothing exists at the socket path."""

    kind = "socket-missing"


class NotAnsweringError(ProbeError):
    """The path exists but no server answers on it (stale socket, hung server, permissions)."""

    kind = "not-answering"


class NotADevicePluginError(ProbeError):
    """Something answers, but it is not a v1beta1 device plugin (not gRPC, or not the service)."""

    kind = "not-a-device-plugin"


class PluginRpcError(ProbeError):
    """The plugin answered an RPC with an error status, or did not answer it in time.

    Attributes:
        rpc: The method name, e.g. ``"Allocate"``.
        code: The gRPC status code.
        details: The plugin's message.
    """

    kind = "rpc-error"

    def __init__(self, rpc: str, code: grpc.StatusCode, details: str) -> None:
        self.rpc = rpc
        self.code = code
        self.details = details
        super().__init__(f"{rpc} failed: {code.name}: {details}")


class ProtocolViolation(ProbeError):
    """The plugin answered, but with something the kubelet cannot use."""

    kind = "protocol-violation"
