"""``FpgaPlugin``: one resource per board key, with health read at every rescan (/dev changes at
once, sysfs every interval), and ``scan`` for the configured family.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import anyio
from typing_extensions import Self

from devplugin_sdk import fswatch
from devplugin_sdk.backends import _sysfs
from devplugin_sdk.backends.fpga.board import Board
from devplugin_sdk.backends.fpga.config import FpgaConfig
from devplugin_sdk.backends.fpga.dfl import scan_dfl
from devplugin_sdk.backends.fpga.xrt import scan_xrt
from devplugin_sdk.plugin import DevicePlugin
from devplugin_sdk.types import Device, DeviceNode, HealthEvent, RescanEvent

__all__ = ["FpgaPlugin", "scan"]

# The backend's logger, whichever of its modules logs (the name is in every JSON log line).
log = logging.getLogger("devplugin_sdk.backends.fpga")


def scan(config: FpgaConfig) -> list[Board]:
    """Scan the host for the configured family (blocking)."""
    if config.family == "xrt":
        return scan_xrt(
            config.sysfs_root,
            config.dev_root,
            vendors=config.vendors,
            include_mgmt=config.include_mgmt,
        )
    return scan_dfl(
        config.sysfs_root, config.dev_root, mode=config.mode, include_fme=config.include_fme
    )


def _dra_attributes(board: Board) -> dict[str, str | int]:
    """The board's facts as typed attributes (DRA publishes them): its NUMA node as a number;
    a value longer than a DRA attribute may be (64 bytes) is left out."""
    attributes: dict[str, str | int] = {
        k: v for k, v in board.attributes.items() if len(v.encode()) <= 64
    }
    if board.numa_node is not None:
        attributes["numaNode"] = board.numa_node
    attributes.update(_sysfs.numa_attribute(board.numa_node))
    return attributes


class FpgaPlugin(DevicePlugin):
    """Serve the FPGA boards of one resource (one shell, AFU ID or interface ID, or a rename).

    ``discover()`` reads sysfs and returns the resource's boards, each with its health as the
    driver's own attributes show it now (XRT: driver bound, ``dev_offline``, ``ready``, render
    node present; DFL: all-f IDs, driver bound, port node present). ``watch()`` asks for a
    rescan at once when a relevant /dev entry appears or disappears (inotify) and every
    ``healthInterval`` seconds otherwise (sysfs sends no events); the SDK diffs devices and
    health on every rescan, so faults and recoveries both reach the kubelet that way. Nothing
    is polled besides: health has one source.

    A board whose key stops being readable (driver offline, all-f crash marker) stays in the
    resource that served it, as Unhealthy; a board reprogrammed to another valid key leaves
    this resource at the next rescan and joins the plugin serving that key, if this process
    runs one (see ``from_config``).

    Args:
        resource_name: The extended resource name.
        keys: The VBNVs, AFU IDs or interface IDs whose boards this resource serves.
        config: Backend settings.
        socket_name: Optional socket file name.
    """

    rescan_interval = 0.0  # watch() rescans on its own (inotify and a full rescan per interval)

    def __init__(
        self,
        *,
        resource_name: str,
        keys: Iterable[str],
        config: FpgaConfig,
        socket_name: str | None = None,
    ) -> None:
        super().__init__(resource_name=resource_name, socket_name=socket_name)
        self.config = config
        # Sorted: the plugin's fingerprint (reload) must not depend on set order.
        self.keys: tuple[str, ...] = tuple(sorted(set(keys)))
        # The boards the last discover() returned: a board whose key turns unreadable stays.
        self._served: dict[str, Board] = {}

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> list[Self]:
        """Validate ``config`` (``CONFIG_KEYS``); scan the host; one plugin per resource.

        Resources are those of the boards found now (named by ``rename`` or from the key) plus
        every resource named in ``rename``, found or not: the set of plugins stays fixed until
        a configuration reload calls this again, so a key that first appears after start (a
        board reprogrammed with a new shell or AFU) is only served if it was declared there.
        Boards whose key cannot be read now are logged and left out. Subclasses get plugins
        of their own class.

        Returns:
            Plugins sorted by resource name; empty when nothing is found or declared.

        Raises:
            ConfigError: naming the full dotted key and the reason.
        """
        settings = FpgaConfig.from_mapping(config)
        keys_by_name: dict[str, set[str]] = {}
        for key, name in settings.rename.items():
            keys_by_name.setdefault(name, set()).add(key)
        for board in scan(settings):
            if board.key is None:
                log.warning("FPGA %s skipped: %s", board.id, board.reason or "no key readable")
                continue
            try:
                name = settings.resource_name_for(board.key)
            except ValueError:
                log.warning("FPGA %s skipped: cannot name a resource after %r", board.id, board.key)
                continue
            keys_by_name.setdefault(name, set()).add(board.key)
        return [
            cls(resource_name=name, keys=keys, config=settings)
            for name, keys in sorted(keys_by_name.items())
        ]

    # ------------------------------------------------------------------ hooks

    async def discover(self) -> Sequence[Device]:
        """Read sysfs and return this resource's boards with the health read now."""
        boards = self._select(await anyio.to_thread.run_sync(scan, self.config))
        for board in boards:
            before = self._served.get(board.id)
            # Rescans come every interval: log a fault when it is new or different, not each time.
            if board.reason and (before is None or before.reason != board.reason):
                log.warning("%s: %s is unhealthy: %s", self.resource_name, board.id, board.reason)
        self._served = {b.id: b for b in boards}
        return [self._device(b) for b in boards]

    def watch(self) -> AsyncIterator[HealthEvent | RescanEvent]:
        """Ask for a rescan when a relevant /dev entry changes, and every ``healthInterval``."""
        return fswatch.watch_or_rescan(
            self._watch_dirs(), self.config.health_interval, relevant=self._relevant
        )

    # ------------------------------------------------------------------ helpers

    def _select(self, boards: Iterable[Board]) -> list[Board]:
        """This resource's boards: those with one of its keys, plus boards it served whose key
        is no longer readable (they stay, unhealthy, instead of vanishing)."""
        return [
            b
            for b in boards
            if (b.key is not None and b.key in self.keys)
            or (not b.key_valid and b.id in self._served)
        ]

    def _device(self, board: Board) -> Device:
        host = self.config.host_dev_root
        return Device(
            id=board.id,
            health=board.health,
            numa_nodes=(board.numa_node,) if board.numa_node is not None else (),
            device_nodes=tuple(
                DeviceNode(host_path=str(host / node), container_path=f"/dev/{node}")
                for node in board.device_nodes
            ),
            attributes=_dra_attributes(board),
        )

    def _watch_dirs(self) -> list[Path]:
        dev = self.config.dev_root
        if self.config.family == "xrt":
            return [dev, dev / "dri", dev / "xfpga"]
        return [dev]

    def _relevant(self, path: Path) -> bool:
        """A /dev entry the boards' nodes live in or are named like (not ttys, loops, ...)."""
        if path in self._watch_dirs():
            return True
        prefixes = (
            ("renderD", "xclmgmt", "dma.qdma.")
            if self.config.family == "xrt"
            else ("dfl-port.", "dfl-fme.")
        )
        return path.name.startswith(prefixes)
