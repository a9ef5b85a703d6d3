"""What FakeKubelet reports: the errors it raises for a pod and its records of registrations,
devices and allocations (the names ``devplugin_sdk.testing`` re-exports)."""

from __future__ import annotations

from dataclasses import dataclass

from devplugin_sdk._wire import client as _client
from devplugin_sdk.types import Allocation

__all__ = [
    "AdmissionError",
    "ContainerAllocation",
    "ContainerStartError",
    "FakeKubeletError",
    "KubeletDevice",
    "Registration",
]


class FakeKubeletError(Exception):
    """An error the kubelet would report for a pod."""


class AdmissionError(FakeKubeletError):
    """Pod admission failed (``UnexpectedAdmissionError`` on a real node)."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(f"Allocate failed due to {reason}, which is unexpected")


class ContainerStartError(FakeKubeletError):
    """Container creation failed (``CreateContainerConfigError`` on a real node)."""


#: A device as the kubelet last heard of it (id, health string, NUMA nodes); ``healthy`` is
#: true only for the exact string "Healthy".
KubeletDevice = _client.ListedDevice


@dataclass(frozen=True, slots=True)
class Registration:
    """One Register call as the kubelet saw it."""

    resource_name: str
    endpoint: str
    version: str
    pre_start_required: bool
    preferred_allocation: bool
    at: float
    error: str | None = None


@dataclass(frozen=True, slots=True)
class ContainerAllocation:
    """What a container got: the chosen device IDs and the plugin's response."""

    pod: str
    container: str
    resource_name: str
    device_ids: tuple[str, ...]
    allocation: Allocation
    preferred: tuple[str, ...] | None = None


def with_error(record: Registration, error: str) -> Registration:
    """``record`` answered with the kubelet's ``error``."""
    return Registration(
        resource_name=record.resource_name,
        endpoint=record.endpoint,
        version=record.version,
        pre_start_required=record.pre_start_required,
        preferred_allocation=record.preferred_allocation,
        at=record.at,
        error=error,
    )
