"""FakeKubelet's public fault hooks and views: each does what a real kubelet does, no more."""

from __future__ import annotations

import socket

import pytest
from sdk_helpers import RESOURCE, widgets

from devplugin_sdk.api import constants
from devplugin_sdk.testing import AdmissionError, FakeKubelet, KubeletDevice, StaticPlugin, serving

OTHER = "acme.com/gadget"


async def test_drop_streams_disconnects_the_plugin_and_never_redials(kubelet: FakeKubelet) -> None:
    """The stream ends from the kubelet's side: devices turn unhealthy, capacity stays (grace)."""
    settings = kubelet.settings(stream_lost_grace=60.0)  # the plugin does not re-register
    async with serving(StaticPlugin(RESOURCE, widgets(2)), settings=settings):
        await kubelet.wait_for_allocatable(RESOURCE, 2)
        assert await kubelet.drop_streams() == 1
        # Processed before drop_streams returns.
        assert kubelet.ended_streams(RESOURCE) == 1
        assert (kubelet.capacity(RESOURCE), kubelet.allocatable(RESOURCE)) == (2, 0)
        assert not kubelet.is_registered(RESOURCE)
        assert kubelet.connections(RESOURCE) == 0
        with pytest.raises(AdmissionError, match="no healthy devices present"):
            await kubelet.allocate(RESOURCE, 1)
        assert len(kubelet.registrations) == 1


async def test_drop_streams_of_one_resource_leaves_the_others(kubelet: FakeKubelet) -> None:
    settings = kubelet.settings(stream_lost_grace=60.0)
    plugins = StaticPlugin(RESOURCE, widgets(2)), StaticPlugin(OTHER, widgets(3))
    async with serving(*plugins, settings=settings):
        await kubelet.wait_for_allocatable(RESOURCE, 2)
        await kubelet.wait_for_allocatable(OTHER, 3)
        assert await kubelet.drop_streams(OTHER) == 1
        assert kubelet.allocatable(OTHER) == 0
        assert kubelet.allocatable(RESOURCE) == 2
        assert kubelet.is_registered(RESOURCE)
        assert kubelet.ended_streams(RESOURCE) == 0
        assert await kubelet.drop_streams(OTHER) == 0  # nothing left open for it


async def test_reject_answers_every_registration_until_cleared(kubelet: FakeKubelet) -> None:
    kubelet.reject("the kubelet is not ready")
    async with serving(StaticPlugin(RESOURCE, widgets(1)), settings=kubelet.settings()):
        await kubelet.wait_for(lambda: len(kubelet.registrations) >= 3, what="3 rejections")
        assert kubelet.connections(RESOURCE) == 0
        kubelet.reject(None)
        await kubelet.wait_for_allocatable(RESOURCE, 1)
    errors = [r.error for r in kubelet.registrations]
    assert errors[-1] is None
    assert set(errors[:-1]) == {"the kubelet is not ready"}


def test_reject_needs_a_positive_count() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        FakeKubelet().reject("no", times=0)


async def test_on_list_sees_each_message_before_the_kubelets_bookkeeping() -> None:
    seen: list[tuple[str, tuple[str, ...], int]] = []

    def on_list(resource: str, devices: tuple[KubeletDevice, ...]) -> None:
        seen.append((resource, tuple(d.id for d in devices), kubelet.messages(resource)))

    kubelet = FakeKubelet(on_list=on_list)
    plugin = StaticPlugin(RESOURCE, widgets(2))
    async with kubelet, serving(plugin, settings=kubelet.settings()):
        await kubelet.wait_for_allocatable(RESOURCE, 2)
        plugin.set_health("w1", "Unhealthy")
        await kubelet.wait_for_allocatable(RESOURCE, 1)
    assert seen[:2] == [(RESOURCE, ("w0", "w1"), 0), (RESOURCE, ("w0", "w1"), 1)]


async def test_restart_keeps_what_a_kubelet_start_keeps(kubelet: FakeKubelet) -> None:
    """The checkpoint and subdirectories (and the sockets in them) stay; all else goes."""
    subdirectory = kubelet.directory / "sub"
    subdirectory.mkdir()
    kept = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    kept.bind(str(subdirectory / "x.sock"))
    gone = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    gone.bind(str(kubelet.directory / "x.sock"))
    kept.close()
    gone.close()
    (kubelet.directory / "DEPRECATION").touch()
    kubelet.checkpoint_path.write_text('{"Data": {"RegisteredDevices": {}}, "Checksum": 0}')
    await kubelet.restart()
    assert sorted(p.name for p in kubelet.directory.iterdir()) == [
        constants.KUBELET_SOCKET_NAME,
        constants.CHECKPOINT_NAME,
        "sub",
    ]
    assert (subdirectory / "x.sock").is_socket()
    assert kubelet.restarts == 1
