"""Packaging hook: a Python older than ``requires-python`` gets one clear line.

pip (up to at least 23.0) resolves a local project's dependencies before it checks its
Requires-Python, so ``pip install .`` on Python 3.9 failed with "No matching distribution found
for grpcio>=1.85.1". The build backend runs on the Python that will run the package and loads
this file while it prepares the metadata, before any dependency is resolved: the check is at
import, because hatchling calls a metadata hook's ``update`` only for dynamic fields (there are
none). It changes no metadata.
"""

from __future__ import annotations

import sys
from typing import Any

from hatchling.metadata.plugin.interface import MetadataHookInterface

MINIMUM = (3, 10)

if sys.version_info < MINIMUM:
    sys.stderr.write(
        f"devplugin-sdk requires Python >= {'.'.join(map(str, MINIMUM))}; this is Python "
        f"{'.'.join(map(str, sys.version_info[:3]))} ({sys.executable})\n"
    )
    raise SystemExit(1)


class CustomMetadataHook(MetadataHookInterface):
    """The hook hatchling loads (``[tool.hatch.metadata.hooks.custom]``); the check is above."""

    def update(self, metadata: dict[str, Any]) -> None:
        """Nothing to change."""
