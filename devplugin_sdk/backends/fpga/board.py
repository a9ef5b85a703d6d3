"""One schedulable FPGA unit as sysfs shows it (``Board``), and how its key (a shell VBNV, an AFU
ID, an interface ID) becomes part of a resource name.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from devplugin_sdk.types import Health

__all__ = ["UNHEALTHY_ID", "Board", "sanitize_name_part"]


# The DFL driver reports an all-f AFU or interface ID when the card's firmware has crashed
# (intel-device-plugins-for-kubernetes cmd/fpga_plugin/fpga_plugin.go: unhealthyAfuID).
UNHEALTHY_ID = "f" * 32


_PCI_ADDRESS = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")


_NOT_NAME_CHAR = re.compile(r"[^A-Za-z0-9._-]+")


@dataclass(frozen=True, slots=True)
class Board:
    """One schedulable FPGA unit as read from sysfs (an Alveo board, a DFL port or region).

    Args:
        id: Stable device ID: the user function's PCI address (XRT), ``<pci>-port<N>`` (DFL af
            mode) or the card's PCI address (DFL region mode).
        key: What names the resource: the shell VBNV (XRT), the AFU ID (af) or the interface
            ID (region); None when it cannot be read (driver offline, shell not loaded).
        key_valid: False when ``key`` is None or the all-f crash marker; such a board stays in
            the resource that already served it, as Unhealthy.
        device_nodes: Node paths relative to the /dev root (``dri/renderD128``, ``dfl-port.0``).
        numa_node: NUMA node of the PCI device, None when unknown.
        health: Health as read now.
        reason: Why the board is unhealthy ("" when healthy).
        attributes: Facts for logs and custom plugins (PCI addresses, VBNV, AFU ID, ...).
    """

    id: str
    key: str | None
    key_valid: bool
    device_nodes: tuple[str, ...]
    numa_node: int | None
    health: Health
    reason: str = ""
    attributes: Mapping[str, str] = field(default_factory=dict)


def sanitize_name_part(text: str) -> str:
    """Turn ``text`` (a VBNV, an ID) into the part of an extended resource name after the ``/``.

    Runs of characters outside ``[A-Za-z0-9._-]`` become ``_``; leading and trailing
    punctuation is dropped and the result is cut to 63 characters (the kubelet's limit).

    Raises:
        ValueError: if nothing usable is left.
    """
    part = _NOT_NAME_CHAR.sub("_", text).strip("._-")
    part = part[:63].rstrip("._-")
    if not part:
        raise ValueError(f"cannot make a resource name from {text!r}")
    return part


def _canonical_id(text: str) -> str:
    """AFU/interface IDs as the DFL driver prints them: 32 lower-case hex digits, no dashes."""
    return text.strip().replace("-", "").lower()


def _valid_uuid_key(key: str | None) -> bool:
    if key is None or key == UNHEALTHY_ID:
        return False
    return re.fullmatch(r"[0-9a-f]{32}", key) is not None
