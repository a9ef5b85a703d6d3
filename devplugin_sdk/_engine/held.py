"""Which devices containers still hold, as the kubelet's own checkpoint says (read only).

The kubelet never tells a plugin that a pod ended: it frees the devices in its own books. Those
books are written to ``kubelet_internal_checkpoint`` in the device-plugin directory, which every
plugin mounts. A reload's retired devices (``feed``) leave the list once a checkpoint written
after the new plugin's first list no longer names them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from devplugin_sdk import config
from devplugin_sdk.errors import ConfigError

__all__ = ["Stamp", "held_devices", "stamp"]

# A node's whole checkpoint: a few hundred bytes per container holding devices (its stored
# Allocate answer included); 16 MiB is tens of thousands of containers.
_MAX_CHECKPOINT_BYTES = 16 << 20

Stamp = tuple[int, int] | None  # (inode, mtime in ns): which write of the file this is


def stamp(path: Path) -> Stamp:
    """Which write of the checkpoint is there now (None when there is none); blocking.

    The kubelet writes a new file and renames it over the old one, so each write is a new
    inode.
    """
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_ino, st.st_mtime_ns)


def held_devices(path: Path, resource: str) -> tuple[Stamp, frozenset[str] | None]:
    """The checkpoint's stamp and the IDs of ``resource`` it records as allocated to containers;
    blocking (run it in a worker thread).

    The IDs are None when the file is missing, unreadable, too big or not a checkpoint: nothing
    can be proved released then. Read with the configuration reader's protections (a regular
    file, a size cap, never a FIFO or a device).
    """
    before = stamp(path)
    try:
        data = json.loads(config.read_file(path, _MAX_CHECKPOINT_BYTES))
        entries = data["Data"]["PodDeviceEntries"]
        held: set[str] = set()
        for entry in entries or ():
            if entry["ResourceName"] == resource:
                held.update(_ids(entry["DeviceIDs"]))
    except (ConfigError, ValueError, RecursionError, KeyError, TypeError):
        return before, None
    return before, frozenset(held)


def _ids(device_ids: Any) -> list[str]:
    # NUMA node -> IDs since Kubernetes 1.20 ({"-1": [...]} without topology); a plain list
    # before.
    if isinstance(device_ids, Mapping):
        return [str(i) for ids in device_ids.values() for i in ids]
    if isinstance(device_ids, list):
        return [str(i) for i in device_ids]
    raise TypeError("DeviceIDs")
