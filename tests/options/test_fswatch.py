"""``fswatch.changes`` / ``watch_or_rescan``: the watch-or-rescan loop every hot-plug backend uses.

Real directories and real inotify (or the polling fallback). Every wait is bounded by the
per-test timeout; nothing here sleeps to wait.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import anyio
import pytest

from devplugin_sdk import fswatch


async def test_changes_announces_a_rescan_once_armed_then_reports_relevant_paths(
    tmp_path: Path,
) -> None:
    """First an empty set (armed: rescan now), then each relevant change as it happens."""
    stream = fswatch.changes([tmp_path], 60.0, relevant=lambda p: p.name.startswith("dev"))
    async with contextlib.aclosing(stream) as batches:
        assert await batches.__anext__() == set()
        (tmp_path / "other").touch()  # irrelevant: never reported
        (tmp_path / "dev0").touch()
        assert await batches.__anext__() == {tmp_path / "dev0"}
        (tmp_path / "dev0").unlink()
        assert await batches.__anext__() == {tmp_path / "dev0"}


@pytest.mark.parametrize("use_inotify", [True, False], ids=["inotify", "polling"])
async def test_changes_asks_for_a_full_rescan_every_interval(
    tmp_path: Path, use_inotify: bool
) -> None:
    stream = fswatch.changes([tmp_path], 0.05, use_inotify=use_inotify)
    async with contextlib.aclosing(stream) as batches:
        assert await batches.__anext__() == set()
        started = time.monotonic()
        assert await batches.__anext__() == set()
        assert await batches.__anext__() == set()
        # Two intervals passed between the first and the third announcement.
        assert time.monotonic() - started >= 0.09


async def test_periodic_rescans_come_even_while_irrelevant_changes_keep_arriving(
    tmp_path: Path,
) -> None:
    """A busy /dev (irrelevant churn) must not starve the health re-read."""
    stream = fswatch.changes([tmp_path], 0.2, relevant=lambda p: p.name == "never")
    rescans = 0
    async with anyio.create_task_group() as tg:

        async def churn() -> None:
            n = 0
            while True:
                (tmp_path / f"noise{n % 5}").touch()
                (tmp_path / f"noise{n % 5}").unlink()
                n += 1
                await anyio.sleep(0.005)

        tg.start_soon(churn)
        async with contextlib.aclosing(stream) as batches:
            async for batch in batches:
                assert batch == set()
                rescans += 1
                if rescans == 3:
                    break
        tg.cancel_scope.cancel()
    assert rescans == 3


async def test_changes_rearms_when_the_directory_list_changes(tmp_path: Path) -> None:
    """A directory function is re-read after a change; a new directory gets watched too."""
    base = tmp_path / "bus"
    base.mkdir()

    def directories() -> list[Path]:
        return [base, *sorted(p for p in base.iterdir() if p.is_dir())]

    stream = fswatch.changes(directories, 60.0)
    async with contextlib.aclosing(stream) as batches:
        assert await batches.__anext__() == set()
        (base / "001").mkdir()
        assert await batches.__anext__() == {base / "001"}
        # Re-armed with bus/001 watched, announced with a full rescan.
        assert await batches.__anext__() == set()
        (base / "001" / "dev5").touch()
        assert await batches.__anext__() == {base / "001" / "dev5"}


async def test_watch_or_rescan_turns_changes_into_rescan_events(tmp_path: Path) -> None:
    stream = fswatch.watch_or_rescan([tmp_path], 60.0)
    async with contextlib.aclosing(stream) as events:
        first = await events.__anext__()
        assert "periodic" in first.reason
        (tmp_path / "uverbs0").touch()
        event = await events.__anext__()
        assert event.reason == "changed: uverbs0"


def test_changes_rejects_a_non_positive_interval(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="interval must be > 0"):
        anyio.run(anext, fswatch.changes([tmp_path], 0))  # type: ignore[arg-type]
