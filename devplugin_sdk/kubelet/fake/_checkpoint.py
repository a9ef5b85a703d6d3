"""The device manager's checkpoint file (``kubelet_internal_checkpoint``): its format, what
kubelet start reads back from it, and a writer that keeps it off the event loop.

The kubelet writes it after every ListAndWatch message and allocation, and at start gives each
resource it names a stopped endpoint with empty device sets (protocol reference, section 7).
Written durably (``_files.write_atomically``) and read as any file from outside (``read_file``).
"""

from __future__ import annotations

import json
import logging
import zlib
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import anyio
import anyio.to_thread

from devplugin_sdk._files import read_file, write_atomically
from devplugin_sdk.errors import ConfigError
from devplugin_sdk.kubelet.fake._records import ContainerAllocation

__all__ = ["CheckpointWriter", "checkpoint_text", "read_resources"]

log = logging.getLogger("devplugin_sdk.fake_kubelet")

# A few hundred bytes per container holding devices: 16 MiB is tens of thousands of them (the
# bound the SDK's own reader of a node's checkpoint uses).
_MAX_BYTES = 16 << 20


def checkpoint_text(
    allocations: Iterable[ContainerAllocation], registered: Mapping[str, list[str]]
) -> str:
    """The checkpoint of ``allocations`` and each resource's ``registered`` healthy IDs."""
    entries = [
        {
            "PodUID": a.pod,
            "ContainerName": a.container,
            "ResourceName": a.resource_name,
            "DeviceIDs": {"-1": list(a.device_ids)},
            "AllocResp": "",
        }
        for a in allocations
    ]
    data = json.dumps(
        {"PodDeviceEntries": entries, "RegisteredDevices": registered}, sort_keys=True
    )
    return f'{{"Data":{data},"Checksum":{zlib.crc32(data.encode())}}}'


def read_resources(path: Path) -> list[str]:
    """The resources a checkpoint at ``path`` names; none when it is missing or unreadable."""
    try:
        data = json.loads(read_file(path, _MAX_BYTES))["Data"]
    except (ConfigError, ValueError, KeyError):
        return []
    return list(data.get("RegisteredDevices", {}))


class CheckpointWriter:
    """Writes the checkpoint when asked, off the event loop, coalescing requests.

    Args:
        path: Where the checkpoint is now (FakeKubelet's directory is chosen on entry).
        text: The checkpoint's contents now.
    """

    def __init__(self, path: Callable[[], Path], text: Callable[[], str]) -> None:
        self._path = path
        self._text = text
        self._dirty = False
        self._wakeup = anyio.Event()
        #: Held while the directory is cleaned at start: it must not see a temp file.
        self.lock = anyio.Lock()

    def schedule(self) -> None:
        """Schedule a checkpoint write (the kubelet writes one after every list and allocation).

        Writes happen off the event loop and coalesce, so the views update first, as in the
        kubelet, and a slow disk does not inflate what tests measure; ``flush`` writes now.
        """
        self._dirty = True
        self._wakeup.set()

    def flush(self) -> None:
        """Write a scheduled checkpoint now (FakeKubelet stops), under ``lock``."""
        if not self._dirty:
            return
        self._dirty = False
        write_atomically(self._path(), self._text().encode())

    async def run(self) -> None:
        """Write each scheduled checkpoint, for as long as FakeKubelet is entered."""
        while True:
            await self._wakeup.wait()
            self._wakeup = anyio.Event()
            # start() cleans the directory under the same lock: it must not see a temp file.
            async with self.lock:
                text = self._text()
                self._dirty = False
                path = self._path()

                try:
                    await anyio.to_thread.run_sync(write_atomically, path, text.encode())
                except OSError:
                    log.exception("FakeKubelet could not write its checkpoint")
