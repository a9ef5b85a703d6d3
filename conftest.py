"""Shared pytest configuration: every async test runs on asyncio (grpc.aio needs it), and all of
them on one event loop.

grpcio's aio poller thread hands completions to the loop it first served; with a fresh loop per
test, a completion for a server a finished test stopped can land on that test's closed loop and
fail the next test ("Event loop is closed"). One loop for the session removes that.

Every test depends on `anyio_backend` through that autouse fixture, so anyio's pytest plugin runs
every `async def` test and fixture without `anyio_mode = "auto"` (an option anyio before 4.11
does not know, and the floor run has anyio 4.7).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session", autouse=True)
async def _one_event_loop(anyio_backend: str) -> AsyncIterator[None]:
    """Holds anyio's test runner (and so its event loop) for the whole session."""
    yield  # noqa: PT022 - the suspended fixture is what holds the runner
