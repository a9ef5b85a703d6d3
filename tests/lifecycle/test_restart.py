"""Kubelet restarts: detected both ways, recovered within milliseconds, never a duplicate."""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import AsyncIterator, Iterable
from contextlib import aclosing

import anyio
import pytest
from sdk_helpers import RESOURCE, widgets

from devplugin_sdk import Device, Settings, SocketInUseError, fswatch
from devplugin_sdk.testing import FakeKubelet, StaticPlugin, serving
from devplugin_sdk.types import HealthEvent, RescanEvent


class _Losses:
    """An observer that records why the plugin re-registers, as it happens."""

    def __init__(self) -> None:
        self.reasons: list[str] = []
        self._changed = anyio.Event()

    def reregistering(self, resource: str, reason: str) -> None:
        self.reasons.append(reason)
        self._changed.set()
        self._changed = anyio.Event()

    async def wait_for(self, count: int, timeout: float = 5.0) -> None:
        with anyio.fail_after(timeout):
            while len(self.reasons) < count:
                await self._changed.wait()


class _Tracked(StaticPlugin):
    """A StaticPlugin that counts the events the SDK has taken from watch() and handled."""

    def __init__(self, resource_name: str, devices: Iterable[Device]) -> None:
        super().__init__(resource_name, devices)
        self.handled = 0
        self._changed = anyio.Event()

    async def watch(self) -> AsyncIterator[HealthEvent | RescanEvent]:
        async for event in super().watch():
            yield event
            # The SDK asks for the next event only once it has handled this one.
            self.handled += 1
            self._changed.set()
            self._changed = anyio.Event()

    async def wait_handled(self, count: int, timeout: float = 5.0) -> None:
        with anyio.fail_after(timeout):
            while self.handled < count:
                await self._changed.wait()


async def test_reregisters_after_kubelet_restart(kubelet: FakeKubelet) -> None:
    """restart() wipes the directory and recreates kubelet.sock: the plugin is back."""
    async with serving(StaticPlugin(RESOURCE, widgets(3)), settings=kubelet.settings()):
        await kubelet.wait_for_allocatable(RESOURCE, 3)
        await kubelet.restart()
        assert kubelet.allocatable(RESOURCE) == 0  # from the checkpoint, before re-registration
        await kubelet.wait_for_allocatable(RESOURCE, 3)
        assert len(kubelet.successful_registrations(RESOURCE)) == 2
        assert kubelet.connections(RESOURCE) == 1


async def test_reregisters_when_only_its_socket_is_removed(kubelet: FakeKubelet) -> None:
    """Our socket deleted while kubelet.sock stays: serve again and register again."""
    async with serving(StaticPlugin(RESOURCE, widgets(2)), settings=kubelet.settings()):
        await kubelet.wait_for_allocatable(RESOURCE, 2)
        os.unlink(kubelet.directory / "acme.com_widget.sock")
        await kubelet.wait_for_registrations(RESOURCE, 2)
        await kubelet.wait_for_allocatable(RESOURCE, 2)
        assert (kubelet.directory / "acme.com_widget.sock").exists()
        # The old stream's end, once the kubelet has processed it, left the new one alone.
        await kubelet.wait_for(lambda: kubelet.ended_streams(RESOURCE) == 1, what="the old end")
        assert kubelet.is_registered(RESOURCE)
        assert kubelet.connections(RESOURCE) == 1


async def test_reregisters_when_only_kubelet_sock_is_recreated(kubelet: FakeKubelet) -> None:
    """kubelet.sock with a new identity is a restart signal on its own, our socket intact.

    No kubelet start keeps our socket (its cleanup comes before the new kubelet.sock), so this
    isolates the second signal by hand: the kubelet drops the stream, then kubelet.sock is
    renamed away and back (a new ctime, the same listening server). The stream-lost grace is
    far longer than the wait, so only kubelet.sock can be what brings the plugin back.
    """
    losses = _Losses()
    settings = kubelet.settings(stream_lost_grace=60.0)
    async with serving(StaticPlugin(RESOURCE, widgets(2)), settings=settings, observer=losses):
        await kubelet.wait_for_allocatable(RESOURCE, 2)
        await kubelet.drop_streams()
        aside = kubelet.directory / "kubelet.sock.aside"
        os.rename(kubelet.socket_path, aside)
        os.rename(aside, kubelet.socket_path)
        await kubelet.wait_for_allocatable(RESOURCE, 2)
        (reason,) = losses.reasons
        assert "kubelet.sock" in reason
        assert (kubelet.directory / "acme.com_widget.sock").exists()
        assert len(kubelet.successful_registrations(RESOURCE)) == 2


async def test_reregisters_when_the_kubelet_drops_the_stream(kubelet: FakeKubelet) -> None:
    """The kubelet ends ListAndWatch while staying up (e.g. issue #121994): register again."""
    async with serving(
        StaticPlugin(RESOURCE, widgets(2)), settings=kubelet.settings(stream_lost_grace=0.2)
    ):
        await kubelet.wait_for_allocatable(RESOURCE, 2)
        assert await kubelet.drop_streams() == 1
        assert kubelet.allocatable(RESOURCE) == 0
        await kubelet.wait_for_allocatable(RESOURCE, 2)
        assert len(kubelet.successful_registrations(RESOURCE)) == 2


async def test_recovers_from_a_crashed_kubelet_with_a_stale_socket(kubelet: FakeKubelet) -> None:
    """A crashed kubelet leaves a dead kubelet.sock; the plugin retries until the new one answers."""
    losses = _Losses()
    settings = kubelet.settings()
    async with serving(StaticPlugin(RESOURCE, widgets(2)), settings=settings, observer=losses):
        await kubelet.wait_for_allocatable(RESOURCE, 2)
        await kubelet.crash()
        assert kubelet.socket_path.exists()
        await losses.wait_for(1)  # the plugin saw the stale kubelet.sock and is registering again
        await kubelet.start()
        await kubelet.wait_for_allocatable(RESOURCE, 2)


async def test_socket_deleted_while_register_is_in_flight_is_served_again(
    kubelet: FakeKubelet,
) -> None:
    """A kubelet starting just after the plugin published its socket deletes it, then serves
    kubelet.sock, and the plugin's Register reaches that new kubelet: its dial-back must find a
    socket again (not wait out its 10 s dial timeout), and one registration results."""
    async with serving(StaticPlugin(RESOURCE, widgets(2)), settings=kubelet.settings()):
        await kubelet.wait_for_allocatable(RESOURCE, 2)
        kubelet.register_delay = 0.3  # the kubelet dials back only after this
        await kubelet.restart()
        await kubelet.wait_for(lambda: kubelet.register_calls == 2, what="the second Register")
        socket_path = kubelet.directory / "acme.com_widget.sock"
        socket_path.unlink()  # what the starting kubelet's cleanup did to the published socket
        await kubelet.wait_for_allocatable(RESOURCE, 2, timeout=3.0)
        assert socket_path.exists()
        assert kubelet.register_calls == 2
        assert len(kubelet.successful_registrations(RESOURCE)) == 2
        assert kubelet.connections(RESOURCE) == 1


async def test_many_restarts_in_a_row_with_allocations(kubelet: FakeKubelet) -> None:
    """Every one of 30 restarts is recovered; allocations keep working between them."""
    async with serving(StaticPlugin(RESOURCE, widgets(4)), settings=kubelet.settings()):
        await kubelet.wait_for_allocatable(RESOURCE, 4)
        for round_ in range(30):
            await kubelet.restart()
            await kubelet.wait_for_allocatable(RESOURCE, 4 - len(kubelet.allocated(RESOURCE)))
            got = await kubelet.allocate(RESOURCE, 1, pod=f"p{round_}")
            assert len(got.device_ids) == 1
            kubelet.release(got)
        assert len(kubelet.successful_registrations(RESOURCE)) == 31
        assert kubelet.connections(RESOURCE) == 1


async def test_health_changes_during_an_outage_reach_the_new_kubelet(kubelet: FakeKubelet) -> None:
    """Health keeps flowing while the kubelet is down; the first list after recovery has it."""
    plugin = _Tracked(RESOURCE, widgets(3))
    async with serving(plugin, settings=kubelet.settings()):
        await kubelet.wait_for_allocatable(RESOURCE, 3)
        await kubelet.stop()
        plugin.set_health("w1", "Unhealthy", "failed while the kubelet was down")
        await plugin.wait_handled(1)  # in the plugin's state before the kubelet is back
        await kubelet.start()
        await kubelet.wait_for_health(RESOURCE, "w1", "Unhealthy")
        assert kubelet.allocatable(RESOURCE) == 2


async def test_removes_a_stale_socket_file_at_start(kubelet: FakeKubelet) -> None:
    """A socket left by a killed instance (nobody listening) is removed and replaced."""
    path = kubelet.directory / "acme.com_widget.sock"
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(path))
    stale.close()
    async with serving(StaticPlugin(RESOURCE, widgets(1)), settings=kubelet.settings()):
        await kubelet.wait_for_allocatable(RESOURCE, 1)


async def test_refuses_to_steal_a_live_socket(kubelet: FakeKubelet) -> None:
    """A second instance for the same socket stops with SocketInUseError; the first keeps serving."""
    settings = kubelet.settings()
    async with serving(StaticPlugin(RESOURCE, widgets(2)), settings=settings):
        await kubelet.wait_for_allocatable(RESOURCE, 2)
        with pytest.raises(SocketInUseError, match="another live process"):
            async with serving(StaticPlugin(RESOURCE, widgets(2)), settings=settings):
                await anyio.sleep_forever()  # serving raises
        assert kubelet.is_registered(RESOURCE)
        assert len(kubelet.successful_registrations(RESOURCE)) == 1
        await kubelet.allocate(RESOURCE, 1)


async def test_restart_is_detected_by_polling_without_inotify(
    kubelet: FakeKubelet, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where inotify is unavailable, the directory poll still catches the restart."""
    from devplugin_sdk import fswatch

    def no_inotify() -> None:
        raise OSError(38, "inotify disabled for this test")

    monkeypatch.setattr(fswatch._Inotify, "__init__", lambda self: no_inotify())
    settings: Settings = kubelet.settings(restart_poll_interval=0.05)
    async with serving(StaticPlugin(RESOURCE, widgets(2)), settings=settings):
        await kubelet.wait_for_allocatable(RESOURCE, 2)
        await kubelet.restart()
        await kubelet.wait_for_allocatable(RESOURCE, 2)


async def test_restarts_keep_the_socket_name_and_leave_nothing_behind(
    kubelet: FakeKubelet,
) -> None:
    """The next server is bound aside (in the staging subdirectory) while the kubelet restarts
    and renamed onto the same name; once the plugin stops, only the kubelet's files remain."""
    async with serving(StaticPlugin(RESOURCE, widgets(2)), settings=kubelet.settings()):
        await kubelet.wait_for_allocatable(RESOURCE, 2)
        for _ in range(3):
            await kubelet.restart()
            await kubelet.wait_for_allocatable(RESOURCE, 2)
        endpoints = {r.endpoint for r in kubelet.successful_registrations(RESOURCE)}
        assert endpoints == {"acme.com_widget.sock"}
        assert kubelet.connections(RESOURCE) == 1
    # Nothing of the plugin's is left: no socket but the kubelet's, no staging subdirectory.
    # (The kubelet may still be writing its checkpoint, through a temporary file of its own.)
    sockets = sorted(p.name for p in kubelet.directory.iterdir() if p.is_socket())
    assert sockets == ["kubelet.sock"]
    assert [p.name for p in kubelet.directory.iterdir() if p.is_dir()] == []


async def test_the_next_server_is_bound_aside_when_the_kubelet_drops_the_stream(
    kubelet: FakeKubelet,
) -> None:
    """A kubelet stopping ends our stream seconds before a new one cleans the directory and
    serves kubelet.sock: the next server is bound aside then, and it is that server the new
    kubelet reaches (the rename keeps the socket's inode)."""
    staging = kubelet.directory / ".devplugin-sdk"
    async with serving(StaticPlugin(RESOURCE, widgets(2)), settings=kubelet.settings()):
        await kubelet.wait_for_allocatable(RESOURCE, 2)
        assert list(staging.iterdir()) == []
        await kubelet.stop()
        with anyio.fail_after(5):
            # changes() yields once the watch is armed, then on every change in the directory.
            async with aclosing(fswatch.changes([staging], 1.0)) as changes:
                async for _ in changes:
                    if list(staging.iterdir()):
                        break
        (staged,) = staging.iterdir()
        inode = staged.lstat().st_ino
        await kubelet.start()
        await kubelet.wait_for_allocatable(RESOURCE, 2)
        assert (kubelet.directory / "acme.com_widget.sock").lstat().st_ino == inode
        assert len(kubelet.successful_registrations(RESOURCE)) == 2


async def test_without_a_staging_directory_it_serves_in_place(
    kubelet: FakeKubelet, caplog: pytest.LogCaptureFixture
) -> None:
    """A file where the staging subdirectory would go: the plugin says so once and serves on
    its socket path directly, across restarts too."""
    caplog.set_level(logging.INFO, logger="devplugin_sdk")
    (kubelet.directory / ".devplugin-sdk").write_text("not a directory")
    async with serving(StaticPlugin(RESOURCE, widgets(2)), settings=kubelet.settings()):
        await kubelet.wait_for_allocatable(RESOURCE, 2)
        await kubelet.restart()
        await kubelet.wait_for_allocatable(RESOURCE, 2)
        assert len(kubelet.successful_registrations(RESOURCE)) == 2
    said = [r.getMessage() for r in caplog.records if "cannot stage servers" in r.getMessage()]
    assert len(said) == 1, said


async def test_staged_sockets_of_a_killed_process_are_removed_at_start(
    kubelet: FakeKubelet,
) -> None:
    staging = kubelet.directory / ".devplugin-sdk"
    staging.mkdir()
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(staging / "0badc0de-3"))  # bound, never listening: its process is gone
    dead.close()
    live = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    live.bind(str(staging / "1badc0de-0"))  # another plugin process's next server
    live.listen()
    try:
        async with serving(StaticPlugin(RESOURCE, widgets(2)), settings=kubelet.settings()):
            await kubelet.wait_for_allocatable(RESOURCE, 2)
            assert sorted(p.name for p in staging.iterdir()) == ["1badc0de-0"]
        assert staging.is_dir()  # still in use by the other process
    finally:
        live.close()
