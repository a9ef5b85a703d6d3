"""The kubelet's DRA calls in SDK terms: which claims, and what preparing one gave.

The gRPC service, the preparer, the checkpoint and the kubelet's side (FakeKubelet, conformance)
speak these; only ``_convert`` turns them into and out of protobuf.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from devplugin_sdk.api import constants

__all__ = [
    "ClaimRef",
    "DeviceHealthStatus",
    "HealthStatus",
    "PreparedClaim",
    "PreparedDevice",
    "health_message",
]

#: A device's health on the kubelet's DRAResourceHealth stream.
HealthStatus = Literal["UNKNOWN", "HEALTHY", "UNHEALTHY"]


@dataclass(frozen=True, slots=True)
class ClaimRef:
    """A claim as the kubelet names it in NodePrepareResources/NodeUnprepareResources."""

    namespace: str
    uid: str
    name: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name} ({self.uid})"


@dataclass(frozen=True, slots=True)
class PreparedDevice:
    """One prepared device of a claim: what the kubelet hands to the runtime for it, and which
    share of the device it is (``share_id``, answered on v1 only: v1beta1 has no field)."""

    request_names: tuple[str, ...]
    pool: str
    device: str
    cdi_ids: tuple[str, ...]
    share_id: str = ""


@dataclass(frozen=True, slots=True)
class PreparedClaim:
    """The outcome for one claim: its devices, or an error (then the devices are ignored)."""

    devices: tuple[PreparedDevice, ...] = ()
    error: str = ""


@dataclass(frozen=True, slots=True)
class DeviceHealthStatus:
    """One device's entry in a DRAResourceHealth message.

    Args:
        pool: Its pool.
        device: Its name in the pool.
        health: ``HEALTHY``, ``UNHEALTHY`` or ``UNKNOWN``.
        message: Why (at most 1024 characters).
        timeout_seconds: How long the kubelet may trust it (``health_check_timeout_seconds``).
        updated: When it was determined, Unix seconds (``last_updated_time``).
    """

    pool: str
    device: str
    health: HealthStatus
    message: str = ""
    timeout_seconds: int = 0
    updated: int = 0


def health_message(text: str) -> str:
    """``text`` as a DRAResourceHealth message: cut to 1021 characters and ``...`` when longer
    than 1024, as the kubelet cuts it (the driver sends it so; the fake kubelet reads it so)."""
    limit = constants.DRA_HEALTH_MESSAGE_MAX
    return text if len(text) <= limit else text[: limit - 3] + "..."
