"""Fixtures shared by the SDK's own tests."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from packaging_helpers import build_sdist_and_wheel

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


@pytest.fixture(scope="session")
def distributions(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(sdist, wheel) of the checkout, built offline once for the packaging and image tests."""
    return build_sdist_and_wheel(tmp_path_factory.mktemp("dist"))
