"""Registration liveness follows the kubelet's own ListAndWatch stream, never another client's.

Other clients (``devplugin probe --watch``, a monitoring agent) may hold streams on the plugin's
socket. The stream the kubelet opened in answer to our registration is the one that matters: its
end is a lost registration whatever else is connected, and only it can make the plugin look stuck.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import grpc
from sdk_helpers import RESOURCE, widgets

from devplugin_sdk import Device, Health, healthz
from devplugin_sdk.api.deviceplugin.v1beta1 import deviceplugin_pb2 as pb
from devplugin_sdk.api.deviceplugin.v1beta1 import deviceplugin_pb2_grpc as pb_grpc
from devplugin_sdk.observe import PluginStatus
from devplugin_sdk.runner import Running
from devplugin_sdk.testing import FakeKubelet, StaticPlugin, serving

SOCKET = "acme.com_widget.sock"

# A client that never reads: no BDP probing, so its flow-control window stays at the HTTP/2
# default (64 KiB) and the plugin's sends to it block once that much is in flight.
_NEVER_READS = [("grpc.http2.bdp_probe", 0)]


class _Losses:
    """An observer that records why the plugin re-registers."""

    def __init__(self) -> None:
        self.reasons: list[str] = []

    def reregistering(self, resource: str, reason: str) -> None:
        self.reasons.append(reason)


@asynccontextmanager
async def other_client(
    socket_path: Path, *, ask_options: bool = True, read: bool = True
) -> AsyncIterator[grpc.aio.UnaryStreamCall[pb.Empty, pb.ListAndWatchResponse]]:
    """A client of the plugin's socket beside the kubelet, with a ListAndWatch stream open.

    Like ``devplugin probe --watch`` it asks for the options first (``ask_options``); with
    ``read`` it reads the first list, else it never reads anything.
    """
    async with grpc.aio.insecure_channel(f"unix:{socket_path}", options=_NEVER_READS) as channel:
        stub = pb_grpc.DevicePluginStub(channel)
        if ask_options:
            await stub.GetDevicePluginOptions(pb.Empty())
        call = stub.ListAndWatch(pb.Empty())
        if read:
            await call.read()
        else:
            await call.initial_metadata()
        try:
            yield call
        finally:
            call.cancel()


def status_of(running: Running) -> PluginStatus:
    (status,) = running.statuses()
    return status


async def test_the_kubelets_stream_lost_beside_another_client_is_a_lost_registration(
    kubelet: FakeKubelet,
) -> None:
    losses = _Losses()
    plugin = StaticPlugin(RESOURCE, widgets(2))
    async with serving(plugin, settings=kubelet.settings(), observer=losses) as running:
        await kubelet.wait_for_allocatable(RESOURCE, 2)
        async with other_client(kubelet.directory / SOCKET):
            await kubelet.wait_for(lambda: status_of(running).streams == 2, what="2 streams")
            assert status_of(running).registered  # the other stream is not the kubelet's

            assert await kubelet.drop_streams() == 1  # the kubelet's stream only
            await kubelet.wait_for(lambda: not status_of(running).registered, what="not live")
            lost = status_of(running)
            assert lost.streams == 1  # the other client's stream is still open
            assert "no ListAndWatch stream from the kubelet; 1 from other" in "".join(
                healthz.problems([lost])
            )

            await kubelet.wait_for_registrations(RESOURCE, 2)
            await kubelet.wait_for_allocatable(RESOURCE, 2)
            await kubelet.wait_for(lambda: status_of(running).registered, what="live again")
            assert kubelet.connections(RESOURCE) == 1
    (reason,) = losses.reasons
    assert "no ListAndWatch stream from the kubelet" in reason
    assert "1 from other clients" in reason


async def test_another_clients_stream_ending_is_not_a_lost_registration(
    kubelet: FakeKubelet,
) -> None:
    plugin = StaticPlugin(RESOURCE, widgets(2))
    async with serving(plugin, settings=kubelet.settings()) as running:
        await kubelet.wait_for_allocatable(RESOURCE, 2)
        async with other_client(kubelet.directory / SOCKET):
            await kubelet.wait_for(lambda: status_of(running).streams == 2, what="2 streams")
        await kubelet.wait_for(lambda: status_of(running).streams == 1, what="1 stream")
        assert status_of(running).registered
        # Still the kubelet's stream: its end is seen as a loss.
        assert await kubelet.drop_streams() == 1
        await kubelet.wait_for_registrations(RESOURCE, 2)
        await kubelet.wait_for_allocatable(RESOURCE, 2)


async def test_a_stream_opened_while_register_is_in_flight_is_not_taken_for_the_kubelets() -> None:
    """Only the stream after the kubelet's dial-back (GetDevicePluginOptions) is the kubelet's."""
    async with FakeKubelet(register_delay=0.3) as kubelet:
        plugin = StaticPlugin(RESOURCE, widgets(2))
        async with serving(plugin, settings=kubelet.settings()) as running:
            await kubelet.wait_for(lambda: kubelet.register_calls == 1, what="Register called")
            async with other_client(kubelet.directory / SOCKET, ask_options=False):
                await kubelet.wait_for_allocatable(RESOURCE, 2)
                await kubelet.wait_for(lambda: status_of(running).registered, what="live")
                assert status_of(running).streams == 2
                assert await kubelet.drop_streams() == 1
                await kubelet.wait_for(lambda: not status_of(running).registered, what="lost")
                await kubelet.wait_for_registrations(RESOURCE, 2)
                await kubelet.wait_for_allocatable(RESOURCE, 2)


async def test_a_client_that_never_reads_does_not_make_the_plugin_look_stuck(
    kubelet: FakeKubelet,
) -> None:
    # Lists of about 20 KB: a few changes fill the idle client's 64 KiB window.
    devices = [Device(f"widget-{i:04d}-{'x' * 40}") for i in range(300)]
    flapping = devices[0].id
    plugin = StaticPlugin(RESOURCE, devices)
    async with serving(plugin, settings=kubelet.settings()) as running:
        await kubelet.wait_for_allocatable(RESOURCE, 300)
        async with other_client(kubelet.directory / SOCKET, read=False):
            await kubelet.wait_for(lambda: status_of(running).streams == 2, what="2 streams")
            for flap in range(20):
                health = Health.UNHEALTHY if flap % 2 == 0 else Health.HEALTHY
                plugin.set_health(flapping, health)
                await kubelet.wait_for_health(RESOURCE, flapping, health)
            # The kubelet has every list (its stream records a send once grpc has written it,
            # which can come just after the kubelet's view changed); the other client is many
            # lists behind, and that never counts.
            await kubelet.wait_for(
                lambda: status_of(running).pending_seconds == 0.0, what="the kubelet up to date"
            )
            status = status_of(running)
            assert status.registered
            assert healthz.problems([status], stuck_after=1e-6) == []


async def test_the_plugin_watcher_path_recreates_its_socket_when_the_kubelets_stream_is_lost() -> (
    None
):
    losses = _Losses()
    async with FakeKubelet(plugin_watcher=True) as kubelet:
        plugin = StaticPlugin(RESOURCE, widgets(2))
        async with serving(plugin, settings=kubelet.settings(), observer=losses) as running:
            await kubelet.wait_for_allocatable(RESOURCE, 2)
            async with other_client(kubelet.registry_directory / SOCKET):
                await kubelet.wait_for(lambda: status_of(running).streams == 2, what="2 streams")
                assert status_of(running).registered
                assert await kubelet.drop_streams() == 1
                await kubelet.wait_for(lambda: not status_of(running).registered, what="lost")
                await kubelet.wait_for_registrations(RESOURCE, 2)
                await kubelet.wait_for_allocatable(RESOURCE, 2)
                await kubelet.wait_for(lambda: status_of(running).registered, what="live again")
    assert any("no ListAndWatch stream from the kubelet" in r for r in losses.reasons)
