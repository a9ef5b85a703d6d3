"""The kubelet's two directories: the device-plugin directory (``kubelet.sock``, the plugins'
sockets, the checkpoint) and ``plugins_registry``.

Given, or made on entry as a short temporary tree (unix socket paths are limited to 107 bytes)
and removed on exit. The device-plugin directory is cleaned at each kubelet start as the kubelet
cleans it; ``plugins_registry`` never is (its sockets are found and registered again).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from devplugin_sdk.api import constants

__all__ = ["Directories"]


class Directories:
    """Where one FakeKubelet keeps its sockets.

    Args:
        directory: The device-plugin directory, or None for a temporary one made on ``make``.
        registry_directory: The plugins_registry directory; by default ``plugins_registry``
            beside the device-plugin directory.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str] | None,
        registry_directory: str | os.PathLike[str] | None,
    ) -> None:
        self._own = directory is None
        self.device_plugins = Path(directory) if directory is not None else Path()
        self._registry_arg = Path(registry_directory) if registry_directory is not None else None
        self.registry = self._registry_arg or self.device_plugins.parent / "plugins_registry"

    def make(self) -> None:
        """Choose the temporary tree, if the directory was not given (on entry)."""
        if self._own:
            root = Path(tempfile.mkdtemp(prefix="dpk-", dir="/tmp"))
            self.device_plugins = root / "device-plugins"
            self.registry = self._registry_arg or root / "plugins_registry"

    def remove(self) -> None:
        """Remove the temporary tree, if it was made here (on exit)."""
        if self._own:
            shutil.rmtree(self.device_plugins.parent, ignore_errors=True)

    def create(self) -> None:
        """Create the device-plugin directory if missing (at each kubelet start)."""
        self.device_plugins.mkdir(mode=0o750, parents=True, exist_ok=True)

    def clean(self) -> None:
        """Clean the device-plugin directory as the kubelet does at start."""
        # The kubelet removes every entry directly in its directory except the checkpoint and
        # subdirectories, whatever its type (CleanupPluginDirectory).
        for entry in os.scandir(self.device_plugins):
            if entry.name == constants.CHECKPOINT_NAME or entry.is_dir(follow_symlinks=False):
                continue
            # os.RemoveAll in the kubelet: a file already gone is not an error.
            Path(entry.path).unlink(missing_ok=True)
