"""Protobuf ↔ SDK types for the kubelet's DRA API, both versions (v1 and v1beta1).

The two versions have the same messages under different packages, so every function takes the
version's generated module; nothing else in the DRA engine sees protobuf (an import-linter
contract checks it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import ModuleType
from typing import Any

from devplugin_sdk._wire.dra_model import ClaimRef, PreparedClaim, PreparedDevice
from devplugin_sdk.api.dra.v1 import dra_pb2 as v1
from devplugin_sdk.api.dra.v1beta1 import dra_pb2 as v1beta1

__all__ = [
    "VERSIONS",
    "claims",
    "prepare_request",
    "prepare_response",
    "prepared",
    "unprepare_request",
    "unprepare_response",
    "unprepared",
]

#: The generated module of each version, by the service name the plugin advertises.
VERSIONS: Mapping[str, ModuleType] = {"v1.DRAPlugin": v1, "v1beta1.DRAPlugin": v1beta1}


def claims(request: Any) -> list[ClaimRef]:
    """The claims of a NodePrepareResources or NodeUnprepareResources request."""
    return [ClaimRef(c.namespace, c.uid, c.name) for c in request.claims]


def prepare_response(pb: ModuleType, results: Mapping[str, PreparedClaim]) -> Any:
    """A NodePrepareResourcesResponse with one entry per claim UID."""
    response = pb.NodePrepareResourcesResponse()
    for uid, result in results.items():
        entry = response.claims[uid]
        entry.error = result.error
        if not result.error:
            entry.devices.extend(_device(pb, d) for d in result.devices)
    return response


def _device(pb: ModuleType, d: PreparedDevice) -> Any:
    device = pb.Device(
        request_names=list(d.request_names),
        pool_name=d.pool,
        device_name=d.device,
        cdi_device_ids=list(d.cdi_ids),
    )
    # Only v1's Device has share_id (field 5): a v1beta1 kubelet never sees shares.
    if d.share_id and pb is v1:
        device.share_id = d.share_id
    return device


def unprepare_response(pb: ModuleType, errors: Mapping[str, str]) -> Any:
    """A NodeUnprepareResourcesResponse with one entry per claim UID (empty error: done)."""
    response = pb.NodeUnprepareResourcesResponse()
    for uid, error in errors.items():
        response.claims[uid].error = error
    return response


# ------------------------------------------------------------------ the kubelet's side


def prepare_request(pb: ModuleType, refs: Sequence[ClaimRef]) -> Any:
    """A NodePrepareResourcesRequest for ``refs``."""
    return pb.NodePrepareResourcesRequest(claims=[_claim(pb, r) for r in refs])


def unprepare_request(pb: ModuleType, refs: Sequence[ClaimRef]) -> Any:
    """A NodeUnprepareResourcesRequest for ``refs``."""
    return pb.NodeUnprepareResourcesRequest(claims=[_claim(pb, r) for r in refs])


def _claim(pb: ModuleType, ref: ClaimRef) -> Any:
    return pb.Claim(namespace=ref.namespace, uid=ref.uid, name=ref.name)


def prepared(response: Any) -> dict[str, PreparedClaim]:
    """The per-claim results of a NodePrepareResourcesResponse, by claim UID."""
    return {
        uid: PreparedClaim(
            devices=tuple(
                PreparedDevice(
                    tuple(d.request_names),
                    d.pool_name,
                    d.device_name,
                    tuple(d.cdi_device_ids),
                    _share_id(d),
                )
                for d in entry.devices
            ),
            error=entry.error,
        )
        for uid, entry in response.claims.items()
    }


def _share_id(device: Any) -> str:
    # v1 has the field (optional: HasField tells set from empty); v1beta1 has none.
    if "share_id" in device.DESCRIPTOR.fields_by_name and device.HasField("share_id"):
        return str(device.share_id)
    return ""


def unprepared(response: Any) -> dict[str, str]:
    """The per-claim errors of a NodeUnprepareResourcesResponse (empty: done), by claim UID."""
    return {uid: entry.error for uid, entry in response.claims.items()}
