"""Which RDMA devices a resource takes: ``Selector`` groups (vendors, device IDs, drivers, netdevs,
link types, names, PCI addresses, as the Mellanox and SR-IOV plugins' selectors) and
``RdmaResource``, one extended resource with how its devices are handed out.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

from devplugin_sdk import cdi
from devplugin_sdk.backends.rdma.discovery import RdmaDeviceInfo, _hex_id

__all__ = ["RdmaResource", "Selector"]

Mode = Literal["exclusive", "shared"]
_HEX_ID = re.compile(r"^(0x)?[0-9a-fA-F]{1,4}$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_LINK_TYPES = {
    "infiniband": "InfiniBand",
    "ib": "InfiniBand",
    "ethernet": "Ethernet",
    "ether": "Ethernet",  # what k8s-rdma-shared-dev-plugin's linkTypes selector takes (netlink)
    "eth": "Ethernet",
    "roce": "Ethernet",
}


@dataclass(frozen=True, slots=True)
class Selector:
    """One group of selectors, as the Mellanox and SR-IOV plugins define them: a device matches
    when, for every non-empty list, one of its values is in the list (OR within a list, AND
    across lists). An empty Selector matches every device.

    Args:
        vendors: PCI vendor IDs (``15b3``, ``0x15b3``).
        device_ids: PCI device IDs (``101d``).
        drivers: PCI driver names (``mlx5_core``).
        if_names: Network interface names of any port.
        link_types: ``InfiniBand`` or ``Ethernet`` (aliases ``ib``, ``ether``, ``roce``...),
            of any port.
        rdma_devices: RDMA device names (``mlx5_0``).
        pci_addresses: PCI function addresses (``0000:3b:00.0``).
    """

    vendors: tuple[str, ...] = ()
    device_ids: tuple[str, ...] = ()
    drivers: tuple[str, ...] = ()
    if_names: tuple[str, ...] = ()
    link_types: tuple[str, ...] = ()
    rdma_devices: tuple[str, ...] = ()
    pci_addresses: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        ids = {"vendors": self.vendors, "device_ids": self.device_ids}
        for name, values in ids.items():
            for value in values:
                if not _HEX_ID.match(value):
                    raise ValueError(f"Selector.{name}: {value!r} is not a 4-digit hex PCI ID")
            object.__setattr__(self, name, tuple(_hex_id(v) or v for v in values))
        links: list[str] = []
        for value in self.link_types:
            canonical = _LINK_TYPES.get(value.lower())
            if canonical is None:
                raise ValueError(
                    f"Selector.link_types: {value!r} is not one of {', '.join(sorted(_LINK_TYPES))}"
                )
            links.append(canonical)
        object.__setattr__(self, "link_types", tuple(links))
        object.__setattr__(self, "pci_addresses", tuple(a.lower() for a in self.pci_addresses))

    def matches(self, device: RdmaDeviceInfo) -> bool:
        """Whether ``device`` passes every non-empty list of this group."""
        checks: list[tuple[tuple[str, ...], Iterable[str | None]]] = [
            (self.vendors, [device.vendor]),
            (self.device_ids, [device.device_id]),
            (self.drivers, [device.driver]),
            (self.if_names, device.netdevs),
            (self.link_types, device.link_layers),
            (self.rdma_devices, [device.name]),
            (self.pci_addresses, [device.pci_address]),
        ]
        return all(not wanted or any(v in wanted for v in values) for wanted, values in checks)


@dataclass(frozen=True, slots=True)
class RdmaResource:
    """One extended resource made of the RDMA devices some selectors pick.

    Args:
        resource_name: Fully qualified name, e.g. ``rdma/hca_shared``.
        selectors: Selector groups, ORed: a device is part of the resource when it matches any
            group. The default (one empty group) takes every RDMA device.
        mode: ``exclusive``: one device ID per RDMA device; ``shared``: ``shares`` IDs per RDMA
            device (``<dev>::<n>``, like ``rdmaHcaMax`` of the Mellanox shared plugin but per
            device), so that one port failure marks every share.
        shares: IDs per RDMA device in shared mode.
        ports: Ports whose state decides health; empty means all.
        issm: Give containers the ``issmN`` nodes too (needed to run a subnet manager).
        rdma_cm: Give containers ``/dev/infiniband/rdma_cm`` and treat its absence as unhealthy.
        cdi_kind: When set (``vendor.com/class``), devices are handed out as CDI names
            ``<kind>=<rdma device>`` instead of device nodes; the host must have a CDI spec.
        env_prefix: Containers get ``<prefix>_DEVICES`` and ``<prefix>_NETDEVS``.
        exclude: Devices matching any of these groups are left out (claimed by an earlier
            resource of the same config).

    Raises:
        ValueError: on an invalid mode, share count, port, CDI kind or env prefix.
    """

    resource_name: str
    selectors: tuple[Selector, ...] = (Selector(),)
    mode: Mode = "exclusive"
    shares: int = 1
    ports: tuple[int, ...] = ()
    issm: bool = True
    rdma_cm: bool = True
    cdi_kind: str | None = None
    env_prefix: str = "RDMA"
    exclude: tuple[Selector, ...] = field(default=())

    def __post_init__(self) -> None:
        if self.mode not in ("exclusive", "shared"):
            raise ValueError(f"mode must be 'exclusive' or 'shared', got {self.mode!r}")
        if self.shares < 1:
            raise ValueError(f"shares must be >= 1, got {self.shares}")
        if self.mode == "exclusive" and self.shares != 1:
            raise ValueError("shares only applies to mode 'shared'")
        if any(p < 1 for p in self.ports):
            raise ValueError(f"port numbers start at 1, got {self.ports}")
        if self.cdi_kind is not None:
            cdi.validate_kind(self.cdi_kind)
        if not _ENV_NAME.match(self.env_prefix):
            raise ValueError(f"env_prefix must be a valid variable name, got {self.env_prefix!r}")

    def selects(self, device: RdmaDeviceInfo) -> bool:
        """Whether ``device`` belongs to this resource."""
        if any(group.matches(device) for group in self.exclude):
            return False
        return any(group.matches(device) for group in self.selectors)
