"""Kubelet restarts: detected both ways, recovered within milliseconds, never a duplicate."""

from __future__ import annotations

import os
import socket

import anyio
import pytest
from sdk_helpers import RESOURCE, widgets

from devplugin_sdk import Settings, SocketInUseError
from devplugin_sdk.testing import FakeKubelet, StaticPlugin, serving


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
        await anyio.sleep(0.3)  # the old stream's end must not tear the new registration down
        assert kubelet.is_registered(RESOURCE)
        assert kubelet.connections(RESOURCE) == 1


class _KeepSocketsKubelet(FakeKubelet):
    """A kubelet restart that leaves plugin sockets alone: only kubelet.sock is recreated."""

    def _cleanup_directory(self) -> None:
        (self.directory / "kubelet.sock").unlink(missing_ok=True)


async def test_reregisters_when_only_kubelet_sock_is_recreated() -> None:
    kubelet = _KeepSocketsKubelet()
    async with kubelet, serving(StaticPlugin(RESOURCE, widgets(2)), settings=kubelet.settings()):
        await kubelet.wait_for_allocatable(RESOURCE, 2)
        await kubelet.restart()
        await kubelet.wait_for_allocatable(RESOURCE, 2)
        assert len(kubelet.successful_registrations(RESOURCE)) == 2


async def test_reregisters_when_the_kubelet_drops_the_stream(kubelet: FakeKubelet) -> None:
    """The kubelet ends ListAndWatch while staying up (e.g. issue #121994): register again."""
    async with serving(
        StaticPlugin(RESOURCE, widgets(2)), settings=kubelet.settings(stream_lost_grace=0.2)
    ):
        await kubelet.wait_for_allocatable(RESOURCE, 2)
        for client in list(kubelet._clients.values()):
            await kubelet._disconnect(client)
        assert kubelet.allocatable(RESOURCE) == 0
        await kubelet.wait_for_allocatable(RESOURCE, 2)
        assert len(kubelet.successful_registrations(RESOURCE)) == 2


async def test_recovers_from_a_crashed_kubelet_with_a_stale_socket(kubelet: FakeKubelet) -> None:
    """A crashed kubelet leaves a dead kubelet.sock; the plugin retries until the new one answers."""
    async with serving(StaticPlugin(RESOURCE, widgets(2)), settings=kubelet.settings()):
        await kubelet.wait_for_allocatable(RESOURCE, 2)
        await kubelet.crash()
        assert kubelet.socket_path.exists()
        await anyio.sleep(0.1)
        await kubelet.start()
        await kubelet.wait_for_allocatable(RESOURCE, 2)


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
    plugin = StaticPlugin(RESOURCE, widgets(3))
    async with serving(plugin, settings=kubelet.settings()):
        await kubelet.wait_for_allocatable(RESOURCE, 3)
        await kubelet.stop()
        plugin.set_health("w1", "Unhealthy", "failed while the kubelet was down")
        await anyio.sleep(0.05)
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
                await anyio.sleep(5)
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
