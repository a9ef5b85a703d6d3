"""Plugin processes dying, doubling and stopping: SIGKILL, a second instance, SIGTERM mid-work.

Each test runs ``_plugin_main.py`` (a plugin author's ``main`` calling ``devplugin_sdk.run``)
as a real process against a FakeKubelet in the test process.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import grpc
import pytest
from plugin_process import PluginProcess, spawned

from devplugin_sdk.api.deviceplugin.v1beta1 import deviceplugin_pb2 as pb
from devplugin_sdk.api.deviceplugin.v1beta1 import deviceplugin_pb2_grpc as pb_grpc
from devplugin_sdk.testing import FakeKubelet

RESOURCE = "reliability.example.com/dev"
SOCKET = "reliability.example.com_dev.sock"

pytestmark = pytest.mark.timeout(60)

PLUGIN_MAIN = Path(__file__).with_name("_plugin_main.py")


@asynccontextmanager
async def spawn_plugin(*args: str) -> AsyncIterator[PluginProcess]:
    """Run ``_plugin_main.py`` with ``args`` for the body of an ``async with``.

    On exit a process still running is killed; its output stays readable on the object.
    """
    async with spawned(
        [sys.executable, str(PLUGIN_MAIN), *args], leave_with=signal.SIGKILL
    ) as plugin:
        yield plugin


async def test_sigkilled_plugin_is_started_again_over_its_stale_socket_and_registers() -> None:
    async with FakeKubelet() as kubelet:
        socket_path = kubelet.directory / SOCKET
        async with spawn_plugin("--dir", str(kubelet.directory)) as first:
            await kubelet.wait_for_allocatable(RESOURCE, 4, timeout=20)
            first.signal(signal.SIGKILL)
            assert await first.exited() == -signal.SIGKILL
        # The kubelet saw the stream break; the dead process's socket file stays behind.
        await kubelet.wait_for_allocatable(RESOURCE, 0)
        assert socket_path.exists()
        assert not kubelet.is_registered(RESOURCE)

        async with spawn_plugin("--dir", str(kubelet.directory)) as second:
            await kubelet.wait_for_registrations(RESOURCE, 2, timeout=20)
            await kubelet.wait_for_allocatable(RESOURCE, 4)
            got = await kubelet.allocate(RESOURCE, 2)
            assert len(got.device_ids) == 2
            assert await second.wait_for_line("allocating", stream="stdout")
            assert kubelet.connections(RESOURCE) == 1
            assert "served by another live process" not in second.error_output


async def test_second_process_for_the_same_resource_exits_with_a_message_and_first_serves_on() -> (
    None
):
    async with FakeKubelet() as kubelet, spawn_plugin("--dir", str(kubelet.directory)) as first:
        await kubelet.wait_for_allocatable(RESOURCE, 4, timeout=20)
        async with spawn_plugin("--dir", str(kubelet.directory)) as second:
            status = await second.exited(timeout=20)
        assert status != 0
        assert "SocketInUseError" in second.error_output
        assert "served by another live process" in second.error_output
        # The first instance never noticed: same registration, same stream, still allocating.
        assert len(kubelet.successful_registrations(RESOURCE)) == 1
        assert kubelet.connections(RESOURCE) == 1
        assert (kubelet.directory / SOCKET).exists()
        got = await kubelet.allocate(RESOURCE, 1)
        assert got.allocation.device_nodes[0].host_path == f"/dev/{got.device_ids[0]}"
        assert first.process.returncode is None


async def test_sigterm_with_streams_and_an_allocation_in_flight_ends_cleanly() -> None:
    async with (
        FakeKubelet() as kubelet,
        spawn_plugin("--dir", str(kubelet.directory), "--allocate-delay", "0.3") as plugin,
    ):
        await kubelet.wait_for_allocatable(RESOURCE, 4, timeout=20)
        socket_path = kubelet.directory / SOCKET
        stream_ends: list[grpc.StatusCode | None] = []
        responses: list[pb.AllocateResponse] = []

        # A client of its own beside the kubelet's connection (which the kubelet closes when
        # its stream ends): one more ListAndWatch stream and an Allocate still in the hook.
        async with grpc.aio.insecure_channel(f"unix:{socket_path}") as channel:
            stub = pb_grpc.DevicePluginStub(channel)

            async def watch_until_end() -> None:
                try:
                    async for _ in stub.ListAndWatch(pb.Empty()):
                        pass
                    stream_ends.append(None)
                except grpc.aio.AioRpcError as exc:
                    stream_ends.append(exc.code())

            async def allocate() -> None:
                request = pb.ContainerAllocateRequest(devices_ids=["d1", "d3"])
                responses.append(
                    await stub.Allocate(pb.AllocateRequest(container_requests=[request]))
                )

            async with anyio.create_task_group() as tg:
                tg.start_soon(watch_until_end)
                tg.start_soon(allocate)
                await plugin.wait_for_line("allocating d1,d3", stream="stdout")
                plugin.signal(signal.SIGTERM)
                assert await plugin.exited(timeout=20) == 0

        # The allocation in flight got the stop grace and its answer; streams ended cleanly.
        assert [[d.host_path for d in r.devices] for r in responses[0].container_responses] == [
            ["/dev/d1", "/dev/d3"]
        ]
        assert stream_ends == [None]
        await kubelet.wait_for_allocatable(RESOURCE, 0)
        assert not kubelet.is_registered(RESOURCE)
        # Nothing left behind: the socket is gone, only the kubelet's own files remain.
        assert sorted(p.name for p in kubelet.directory.iterdir()) == [
            "kubelet.sock",
            "kubelet_internal_checkpoint",
        ]
        assert "Traceback" not in plugin.error_output
        assert "received SIGTERM; shutting down" in plugin.error_output
