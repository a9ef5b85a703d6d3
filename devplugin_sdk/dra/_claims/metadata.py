"""Device metadata for workloads (KEP-5304): one ``metadata.json`` per prepared request.

As Kubernetes' kubeletplugin helper writes it (``kubeletplugin/metadata.go``; the protocol is
the website's "Device metadata protocol"): on the host under the plugin's directory,
``dra-device-metadata/<claim UID>/<request>/metadata.json``, holding one
``metadata.resource.k8s.io/v1alpha1`` ``DeviceMetadata`` object (the claim, its request with the
full ``<request>/<subrequest>`` name, and each device's driver, pool, name, attributes and
network data); bind-mounted read-only by the claim's CDI spec at
``/var/run/kubernetes.io/dra-device-attributes/resourceclaims/<claim>/<request>/<driver>-metadata.json``
(``resourceclaimtemplates/<pod claim name>/...`` for a claim made from a template). Written
before the spec that mounts it, removed with the claim. The host side is keyed by the claim's UID,
not its name: a claim deleted and re-created under its name is another claim, with files of its
own (earlier versions used ``<namespace>_<claim>``; such directories go with their claim).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from devplugin_sdk import _files
from devplugin_sdk._wire.dra_model import ClaimRef, PreparedDevice
from devplugin_sdk.dra._claims.names import UID, ref_problem
from devplugin_sdk.dra.resources import ResourceClaim
from devplugin_sdk.errors import ConfigError
from devplugin_sdk.types import AttributeValue, Mount, NetworkData, Version

__all__ = ["CONTAINER_ROOT", "Metadata", "MetadataDevice"]

#: Where the files appear in containers (k8s.io/dynamic-resource-allocation api/metadata).
CONTAINER_ROOT = "/var/run/kubernetes.io/dra-device-attributes"
_API_VERSION = "metadata.resource.k8s.io/v1alpha1"
_SUBDIR = "dra-device-metadata"
_FILE = "metadata.json"
# A metadata document lists a request's devices with their attributes: a few KiB; a bigger file
# is not ours.
_MAX_BYTES = 1 << 20


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

    def path(self, uid: str, request: str) -> Path:
        """The host file of one request's metadata (the UID and request name checked to stay
        inside the directory).

        Raises:
            ValueError: a name that would reach outside it.
        """
        return _files.inside(self.root, uid, request, _FILE)

    def document(
        self, claim: ResourceClaim, full_name: str, devices: Sequence[MetadataDevice]
    ) -> dict[str, Any]:
        """The ``DeviceMetadata`` of one request (``full_name`` may carry the subrequest)."""
        return {
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

    def write(self, uid: str, request: str, document: Mapping[str, Any]) -> None:
        """Write ``request``'s file (the prepare's, or the same again when it is gone).

        Raises:
            OSError: it could not be written.
            ValueError: a name that would reach outside the directory.
        """
        path = self.path(uid, request)
        data = (json.dumps(document, indent=2, sort_keys=True) + "\n").encode()
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
        # Readable by the workload (0644, as kubeletplugin writes it); a reader sees all or none.
        _files.write_atomically(path, data, mode=0o644)

    def mount(self, claim: ResourceClaim, request: str) -> Mount:
        """The bind mount of ``request``'s file, without writing it.

        Raises:
            ValueError: a name that would reach outside the directory.
        """
        path = self.path(claim.uid, request)
        if claim.pod_claim_name:
            where = f"resourceclaimtemplates/{claim.pod_claim_name}"
        else:
            where = f"resourceclaims/{claim.name}"
        # The container side keeps the claim's name, as kubeletplugin mounts it (KEP-5304).
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

    def remove(self, ref: ClaimRef) -> None:
        """Remove one claim's files (nothing when there are none), and its directory of the
        former layout (by name) when the files there are this claim's."""
        if UID.fullmatch(ref.uid):
            shutil.rmtree(_files.inside(self.root, ref.uid), ignore_errors=True)
        if ref_problem(ref) is None:
            legacy = _files.inside(self.root, f"{ref.namespace}_{ref.name}")
            if self._owners(legacy) == {ref.uid}:
                shutil.rmtree(legacy, ignore_errors=True)

    def clean(self, known: Collection[str]) -> int:
        """Remove the files of claims not ``known`` (by UID: a prepare that never answered;
        the former layout's directories whose files name no known claim); how many claims'."""
        removed = 0
        for name in self._names():
            path = self.root / name
            if UID.fullmatch(name):
                stale = name not in known
            else:
                owners = self._owners(path)
                stale = bool(owners) and not owners & set(known)
            if stale:
                shutil.rmtree(path, ignore_errors=True)
                removed += 1
        return removed

    def recorded(self) -> dict[str, tuple[ClaimRef, tuple[PreparedDevice, ...]]]:
        """What the files on disk say each claim holds, by UID: its namespace and name, and
        each request's devices (for claims whose checkpoint entry was lost)."""
        found: dict[str, tuple[ClaimRef, list[PreparedDevice]]] = {}
        for name in self._names():
            for document in self._documents(self.root / name):
                meta = _mapping(document.get("metadata"))
                uid = str(meta.get("uid") or "")
                if not UID.fullmatch(uid) or (UID.fullmatch(name) and name != uid):
                    continue
                ref = ClaimRef(str(meta.get("namespace") or ""), uid, str(meta.get("name") or ""))
                if ref_problem(ref) is not None:
                    ref = ClaimRef("", uid, "")  # its devices count; its names are not used
                devices = found.setdefault(uid, (ref, []))[1]
                requests = document.get("requests")
                for request in map(_mapping, requests if isinstance(requests, list) else []):
                    main = str(request.get("name") or "").split("/")[0]
                    listed = request.get("devices")
                    devices += [
                        PreparedDevice((main,), str(d.get("pool", "")), str(d.get("name", "")), ())
                        for d in map(_mapping, listed if isinstance(listed, list) else [])
                        if d.get("driver") == self.driver
                    ]
        return {uid: (ref, tuple(devices)) for uid, (ref, devices) in found.items()}

    def _names(self) -> list[str]:
        try:
            return sorted(os.listdir(self.root))
        except OSError:
            return []

    def _owners(self, directory: Path) -> set[str]:
        """The claim UIDs the metadata files under ``directory`` name."""
        return {
            str(_mapping(d.get("metadata")).get("uid") or "") for d in self._documents(directory)
        }

    def _documents(self, directory: Path) -> list[dict[str, Any]]:
        """The metadata documents under ``directory`` (``<request>/metadata.json``), read as
        files from outside: bounded, regular files only; an unreadable one is skipped."""
        out: list[dict[str, Any]] = []
        try:
            requests = sorted(os.listdir(directory))
        except OSError:
            return out
        for request in requests:
            with contextlib.suppress(ConfigError, ValueError, RecursionError):
                document = json.loads(_files.read_file(directory / request / _FILE, _MAX_BYTES))
                if isinstance(document, dict):
                    out.append(document)
        return out


def _mapping(value: object) -> Mapping[str, Any]:
    return value if isinstance(value, dict) else {}


def _attribute(value: AttributeValue) -> dict[str, Any]:
    # A resource.k8s.io DeviceAttribute: exactly one of bool, int, string, version.
    if isinstance(value, bool):
        return {"bool": value}
    if isinstance(value, int):
        return {"int": value}
    if isinstance(value, Version):
        return {"version": value.text}
    return {"string": value}
