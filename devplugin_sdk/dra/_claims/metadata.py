"""Device metadata for workloads (KEP-5304): one ``metadata.json`` per prepared request.

As Kubernetes' kubeletplugin helper writes it (``kubeletplugin/metadata.go``; the protocol is
the website's "Device metadata protocol"): on the host under the plugin's directory,
``dra-device-metadata/<namespace>_<claim>/<request>/metadata.json``, holding one
``metadata.resource.k8s.io/v1alpha1`` ``DeviceMetadata`` object (the claim, its request with the
full ``<request>/<subrequest>`` name, and each device's driver, pool, name, attributes and
network data); bind-mounted read-only by the claim's CDI spec at
``/var/run/kubernetes.io/dra-device-attributes/resourceclaims/<claim>/<request>/<driver>-metadata.json``
(``resourceclaimtemplates/<pod claim name>/...`` for a claim made from a template). Written
before the spec that mounts it, removed with the claim.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from devplugin_sdk import _files
from devplugin_sdk.dra.resources import ResourceClaim
from devplugin_sdk.types import AttributeValue, Mount, NetworkData, Version

__all__ = ["CONTAINER_ROOT", "Metadata", "MetadataDevice"]

#: Where the files appear in containers (k8s.io/dynamic-resource-allocation api/metadata).
CONTAINER_ROOT = "/var/run/kubernetes.io/dra-device-attributes"
_API_VERSION = "metadata.resource.k8s.io/v1alpha1"
_SUBDIR = "dra-device-metadata"


@dataclass(frozen=True, slots=True)
class MetadataDevice:
    """One device of a request as its metadata lists it."""

    pool: str
    name: str
    attributes: Mapping[str, AttributeValue]
    network_data: NetworkData | None = None


class Metadata:
    """The metadata files of one driver under ``plugin_dir`` (blocking; call from a thread).

    Args:
        driver: The driver name (the file's name in the container).
        plugin_dir: The driver's directory (``/var/lib/kubelet/plugins/<driver>``).
    """

    def __init__(self, driver: str, plugin_dir: Path) -> None:
        self.driver = driver
        self.root = plugin_dir / _SUBDIR

    def claim_dir(self, namespace: str, name: str) -> Path:
        """The host directory of one claim's files."""
        return self.root / f"{namespace}_{name}"

    def write(
        self, claim: ResourceClaim, request: str, full_name: str, devices: Sequence[MetadataDevice]
    ) -> Mount:
        """Write ``request``'s file (``full_name`` may carry the subrequest); the mount that
        puts it in the container.

        Raises:
            OSError: it could not be written.
        """
        document = {
            "kind": "DeviceMetadata",
            "apiVersion": _API_VERSION,
            "metadata": {
                "name": claim.name,
                "namespace": claim.namespace,
                "uid": claim.uid,
                "generation": 1,
            },
            **({"podClaimName": claim.pod_claim_name} if claim.pod_claim_name else {}),
            "requests": [
                {"name": full_name, "devices": [self._device(d) for d in devices]},
            ],
        }
        mount = self.mount(claim, request)
        data = (json.dumps(document, indent=2, sort_keys=True) + "\n").encode()
        path = Path(mount.host_path)
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
        # Readable by the workload (0644, as kubeletplugin writes it); a reader sees all or none.
        _files.write_atomically(path, data, mode=0o644)
        return mount

    def mount(self, claim: ResourceClaim, request: str) -> Mount:
        """The bind mount of ``request``'s file (what ``write`` returns), without writing it."""
        path = self.claim_dir(claim.namespace, claim.name) / request / "metadata.json"
        if claim.pod_claim_name:
            where = f"resourceclaimtemplates/{claim.pod_claim_name}"
        else:
            where = f"resourceclaims/{claim.name}"
        container = f"{CONTAINER_ROOT}/{where}/{request}/{self.driver}-metadata.json"
        return Mount(str(path), container, read_only=True)

    def _device(self, device: MetadataDevice) -> dict[str, Any]:
        out: dict[str, Any] = {"driver": self.driver, "pool": device.pool, "name": device.name}
        if device.attributes:
            out["attributes"] = {k: _attribute(v) for k, v in device.attributes.items()}
        net = device.network_data
        if net is not None:
            out["networkData"] = {
                k: v
                for k, v in (
                    ("interfaceName", net.interface_name),
                    ("ips", list(net.ips)),
                    ("hardwareAddress", net.hardware_address),
                )
                if v
            }
        return out

    def remove(self, namespace: str, name: str) -> None:
        """Remove one claim's files (nothing when there are none)."""
        if not (namespace and name):
            return
        shutil.rmtree(self.claim_dir(namespace, name), ignore_errors=True)


def _attribute(value: AttributeValue) -> dict[str, Any]:
    # A resource.k8s.io DeviceAttribute: exactly one of bool, int, string, version.
    if isinstance(value, bool):
        return {"bool": value}
    if isinstance(value, int):
        return {"int": value}
    if isinstance(value, Version):
        return {"version": value.text}
    return {"string": value}
