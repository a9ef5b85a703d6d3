"""A CDI spec in memory: a kind, each device's container edits and the common ones, the oldest
CDI version that has every feature used, and the JSON runtimes read (SPEC.md,
specs-go/version.go, pkg/cdi/container-edits.go of cncf-tags/container-device-interface).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from devplugin_sdk.cdi.names import validate_device_name, validate_kind
from devplugin_sdk.types import Allocation, Device

__all__ = ["CdiSpec"]


def _check_edits(where: str, edits: Allocation) -> None:
    if edits.annotations or edits.cdi_devices:
        raise ValueError(
            f"{where}: CDI container edits carry device nodes, mounts and env only; "
            "annotations and CDI names belong in the Allocate response"
        )
    for key in edits.env:
        # The runtime splits "K=V" at the first '=' (pkg/cdi/container-edits.go, ValidateEnv).
        if not key or "=" in key or "\0" in key:
            raise ValueError(f"{where}: invalid environment variable name {key!r}")
        if "\0" in edits.env[key]:
            raise ValueError(f"{where}: environment variable {key} contains a NUL byte")


def _edits_empty(edits: Allocation) -> bool:
    return not (edits.device_nodes or edits.mounts or edits.env)


def _edits_json(edits: Allocation, *, env: bool = True) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if env and edits.env:
        out["env"] = [f"{k}={v}" for k, v in edits.env.items()]
    if edits.device_nodes:
        nodes = []
        for node in edits.device_nodes:
            entry: dict[str, Any] = {"path": node.container_path}
            if node.host_path != node.container_path:
                entry["hostPath"] = node.host_path  # a CDI 0.5.0 field; "path" when absent
            # An empty permissions string would mean "rwm" to the runtime; always be explicit.
            entry["permissions"] = node.permissions
            nodes.append(entry)
        out["deviceNodes"] = nodes
    if edits.mounts:
        # Bind mounts need "bind" or "rbind" in the OCI options; rbind is what CRI mounts use.
        out["mounts"] = [
            {
                "hostPath": m.host_path,
                "containerPath": m.container_path,
                "options": ["rbind", "ro"] if m.read_only else ["rbind"],
            }
            for m in edits.mounts
        ]
    return out


@dataclass(frozen=True)
class CdiSpec:
    """One CDI spec: a kind and the container edits of each of its devices.

    Each device's edits are an ``Allocation`` holding device nodes, mounts and env (the runtime
    applies them when a container asks for that device by its CDI name). ``common`` edits are
    applied once whenever any device of the spec is used.

    ``cdi_version`` is the oldest CDI version that has every feature the spec uses, so that older
    runtimes (containerd 1.7 ships an older CDI library) accept it: 0.3.0 by default; 0.5.0 when a
    device node's host path differs from its container path (``hostPath``) or a device name
    starts with a digit; 0.6.0 when the class contains a dot (specs-go/version.go).

    Args:
        kind: ``vendor.com/class``.
        devices: Container edits by CDI device name, in the order to write them.
        common: Edits applied whenever any device of this spec is requested.

    Raises:
        ValueError: a bad kind or device name, a device with no edits (CDI rejects those), or
            edits with annotations or CDI names.
    """

    kind: str
    devices: Mapping[str, Allocation] = field(default_factory=dict)
    common: Allocation = field(default_factory=Allocation)

    def __post_init__(self) -> None:
        validate_kind(self.kind)
        for name, edits in self.devices.items():
            validate_device_name(name)
            if not isinstance(edits, Allocation):
                raise TypeError(f"CDI device {name!r}: edits must be an Allocation")
            if _edits_empty(edits):
                # The CDI validator rejects a device without edits ("empty container edits").
                raise ValueError(f"CDI device {name!r} has no device nodes, mounts or env")
            _check_edits(f"CDI device {name!r}", edits)
        _check_edits("CDI common edits", self.common)
        object.__setattr__(self, "devices", dict(self.devices))

    @classmethod
    def from_devices(
        cls,
        kind: str,
        devices: Iterable[Device],
        *,
        env: bool = True,
        common: Allocation | None = None,
    ) -> CdiSpec:
        """Build a spec from SDK devices: each device's nodes, mounts and env become its edits.

        The CDI device name is the device ID. Devices that declare no nodes, mounts or env (with
        ``env=False``: no nodes or mounts) are left out, as CDI forbids empty devices.

        Args:
            kind: ``vendor.com/class``.
            devices: The devices, e.g. what ``discover()`` returned.
            env: Put each device's env in the spec; False leaves env out of the spec.
            common: Edits applied whenever any device of the spec is requested.

        Raises:
            ValueError: a bad kind, or a device ID that is not a valid CDI device name.
        """
        edits: dict[str, Allocation] = {}
        for device in devices:
            one = Allocation(
                device_nodes=device.device_nodes,
                mounts=device.mounts,
                env=dict(device.env) if env else {},
            )
            if not _edits_empty(one):
                try:
                    validate_device_name(device.id)
                except ValueError as exc:
                    raise ValueError(
                        f"device {device.id!r} cannot be a CDI device: {exc}"
                    ) from None
                edits[device.id] = one
        return cls(kind, edits, common or Allocation())

    @property
    def cdi_version(self) -> str:
        """The oldest CDI version that supports everything this spec uses."""
        _, klass = validate_kind(self.kind)
        if "." in klass:
            return "0.6.0"
        edits = [*self.devices.values(), self.common]
        if any(not name[0].isalpha() for name in self.devices) or any(
            n.host_path != n.container_path for e in edits for n in e.device_nodes
        ):
            return "0.5.0"
        return "0.3.0"

    def qualified(self, name: str) -> str:
        """The fully qualified CDI name of device ``name``.

        Raises:
            KeyError: the spec has no such device.
        """
        if name not in self.devices:
            raise KeyError(f"CDI spec {self.kind} has no device {name!r}")
        return f"{self.kind}={name}"

    def to_dict(self) -> dict[str, Any]:
        """The spec as the JSON object runtimes read."""
        out: dict[str, Any] = {
            "cdiVersion": self.cdi_version,
            "kind": self.kind,
            "devices": [
                {"name": name, "containerEdits": _edits_json(edits)}
                for name, edits in self.devices.items()
            ],
        }
        common = _edits_json(self.common)
        if common:
            out["containerEdits"] = common
        return out

    def to_json(self) -> bytes:
        """The spec file's bytes (UTF-8 JSON, indented, newline-terminated)."""
        return (json.dumps(self.to_dict(), indent=2) + "\n").encode()
