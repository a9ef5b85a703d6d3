"""Shared pytest configuration: every async test runs on asyncio (grpc.aio needs it)."""

from __future__ import annotations

import pytest


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"
