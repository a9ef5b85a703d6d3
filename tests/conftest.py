"""Fixtures shared by the SDK's own tests."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from devplugin_sdk.testing import FakeKubelet


@pytest.fixture
async def kubelet() -> AsyncIterator[FakeKubelet]:
    async with FakeKubelet() as fake:
        yield fake


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A short temporary directory (unix socket paths are limited to 107 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="dpt-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)
