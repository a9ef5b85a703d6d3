"""The FPGA backend's configuration keys (``CONFIG_KEYS``), validated into ``FpgaConfig``, which
also names the resource of each key.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, cast

from devplugin_sdk.backends.fpga.board import _canonical_id, sanitize_name_part
from devplugin_sdk.backends.fpga.xrt import XILINX_VENDOR
from devplugin_sdk.config import ConfigReader, shown
from devplugin_sdk.errors import ConfigError

__all__ = ["CONFIG_KEYS", "DEFAULT_DOMAIN", "SCHEMA", "FpgaConfig"]


Family = Literal["xrt", "dfl"]


DflMode = Literal["af", "region"]


DEFAULT_DOMAIN: Mapping[str, str] = {"xrt": "amd.com", "dfl": "fpga.intel.com"}


_PATH = {"type": "string", "pattern": "^/", "description": "an absolute path"}
#: The backend's keys as a JSON Schema object (its part of a ``devplugin run`` file);
#: schemas/fpga.json is generated from it (scripts/gen_schemas.py).
SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["family"],
    "properties": {
        "family": {"enum": ["xrt", "dfl"], "description": "xrt: AMD/Xilinx Alveo; dfl: Intel"},
        "mode": {"enum": ["af", "region"], "default": "af", "description": "family dfl only"},
        "domain": {
            "type": "string",
            "minLength": 1,
            "description": f"domain of generated resource names (xrt: {DEFAULT_DOMAIN['xrt']}, "
            f"dfl: {DEFAULT_DOMAIN['dfl']})",
        },
        "rename": {
            "type": "object",
            "additionalProperties": {"type": "string", "minLength": 1},
            "description": "VBNV, AFU ID or interface ID to resource name",
        },
        "vendors": {
            "type": "array",
            "items": {"type": "string", "pattern": "^0x[0-9a-fA-F]{4}$"},
            "default": [XILINX_VENDOR],
        },
        "includeMgmt": {"type": "boolean", "default": False},
        "includeFme": {"type": "boolean", "default": False},
        "healthInterval": {"type": "number", "exclusiveMinimum": 0, "default": 5.0},
        "sysfsRoot": {**_PATH, "default": "/sys"},
        "devRoot": {**_PATH, "default": "/dev"},
        "hostDevRoot": {**_PATH, "default": "/dev"},
    },
}

#: The backend's keys, as ``from_config`` takes them.
CONFIG_KEYS = tuple(SCHEMA["properties"])


@dataclass(frozen=True, slots=True)
class FpgaConfig:
    """Validated backend settings (the backend's keys of a ``devplugin run`` file).

    Args:
        family: ``"xrt"`` (AMD/Xilinx Alveo) or ``"dfl"`` (Intel, Linux DFL driver).
        mode: DFL only: ``"af"`` (one resource per programmed AFU ID, one device per port) or
            ``"region"`` (one resource per interface ID, one device per card with all its ports).
        domain: Domain of generated resource names (``amd.com`` / ``fpga.intel.com``).
        rename: Key (VBNV, AFU ID or interface ID) to resource name. A bare name gets
            ``domain/`` prepended. Every key listed here is served even when no board has it
            at start, so boards programmed later are picked up; several keys may share a name.
        sysfs_root: Where sysfs is read (``sysfsRoot``).
        dev_root: Where /dev is read and watched (``devRoot``).
        host_dev_root: /dev as the kubelet's host sees it (``hostDevRoot``); device node paths
            given to the kubelet are under it (differs from ``dev_root`` when the plugin runs
            with the host /dev mounted elsewhere).
        include_mgmt: XRT: also give the management node ``/dev/xclmgmt<N>`` (``includeMgmt``;
            it can reflash the card: off by default).
        include_fme: DFL region mode: also give the FME node (``includeFme``; partial
            reconfiguration from inside the container, like Intel's ``regiondevel`` mode).
        vendors: XRT: PCI vendor IDs to consider.
        health_interval: Seconds between rescans of sysfs when /dev shows no change
            (``healthInterval``): the pace at which health read from sysfs is refreshed.
    """

    family: Family
    mode: DflMode = "af"
    domain: str = ""
    rename: Mapping[str, str] = field(default_factory=dict)
    sysfs_root: Path = Path("/sys")
    dev_root: Path = Path("/dev")
    host_dev_root: Path = Path("/dev")
    include_mgmt: bool = False
    include_fme: bool = False
    vendors: tuple[str, ...] = (XILINX_VENDOR,)
    health_interval: float = 5.0

    def __post_init__(self) -> None:
        if not self.domain:
            object.__setattr__(self, "domain", DEFAULT_DOMAIN[self.family])
        for name in ("sysfs_root", "dev_root", "host_dev_root"):
            object.__setattr__(self, name, Path(getattr(self, name)))

    @classmethod
    def from_mapping(cls, config: Mapping[str, Any]) -> FpgaConfig:
        """Validate the backend's keys (``CONFIG_KEYS``) as loaded from YAML.

        Raises:
            ConfigError: naming the full dotted key and the reason.
        """
        reader = ConfigReader(config)
        reader.known(*CONFIG_KEYS)
        family = cast("Family", reader.choice("family", ("xrt", "dfl")))
        if family == "xrt" and reader.has("mode"):
            raise ConfigError(reader.key("mode"), "only applies to family 'dfl'")
        mode = cast("DflMode", reader.choice("mode", ("af", "region"), "af"))
        domain = reader.domain("domain", DEFAULT_DOMAIN[family])
        vendors: list[str] = []
        for i, vendor in enumerate(reader.strings("vendors", (XILINX_VENDOR,))):
            if re.fullmatch(r"0x[0-9a-fA-F]{4}", vendor) is None:
                raise ConfigError(
                    f"{reader.key('vendors')}[{i}]", f"must look like '0x10ee', got {shown(vendor)}"
                )
            vendors.append(vendor.lower())
        names = reader.section("rename")
        rename: dict[str, str] = {}
        for key in names.data:
            if not isinstance(key, str) or not key:
                # An AFU ID of decimal digits only is a number to YAML.
                raise ConfigError(
                    names.key(shown(key)), "must be a non-empty string (quote IDs in YAML)"
                )
            # AFU and interface IDs are compared in the driver's canonical form.
            canonical = key if family == "xrt" else _canonical_id(key)
            rename[canonical] = names.resource_name(key, domain=domain)
        return cls(
            family=family,
            mode=mode,
            domain=domain,
            rename=rename,
            sysfs_root=reader.path("sysfsRoot", "/sys"),
            dev_root=reader.path("devRoot", "/dev"),
            host_dev_root=reader.path("hostDevRoot", "/dev"),
            include_mgmt=reader.boolean("includeMgmt", False),
            include_fme=reader.boolean("includeFme", False),
            vendors=tuple(vendors),
            health_interval=reader.interval("healthInterval", 5.0),
        )

    def resource_name_for(self, key: str) -> str:
        """The resource name of boards whose key is ``key`` (rename map first)."""
        if key in self.rename:
            return self.rename[key]
        if self.family == "xrt":
            return f"{self.domain}/{sanitize_name_part(key)}"
        prefix = "af" if self.mode == "af" else "region"
        return f"{self.domain}/{prefix}-{sanitize_name_part(key)}"
