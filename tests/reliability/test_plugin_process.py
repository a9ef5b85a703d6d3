"""Plugin processes dying, doubling and stopping: SIGKILL, a second instance, SIGTERM mid-work.

Each test runs ``_plugin_main.py`` (a plugin author's ``main`` calling ``devplugin_sdk.run``)
as a real process against a FakeKubelet in the test process.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path

import anyio
import anyio.abc
import grpc
import pytest
from process_output import ProcessOutput

from devplugin_sdk.api.deviceplugin.v1beta1 import deviceplugin_pb2 as pb
from devplugin_sdk.api.deviceplugin.v1beta1 import deviceplugin_pb2_grpc as pb_grpc
from devplugin_sdk.testing import FakeKubelet

RESOURCE = "reliability.example.com/dev"
SOCKET = "reliability.example.com_dev.sock"

pytestmark = pytest.mark.timeout(60)

PLUGIN_MAIN = Path(__file__).with_name("_plugin_main.py")


class PluginProcess(ProcessOutput):
    """A running ``_plugin_main.py``, with its output collected line by line."""

    async def wait_for_stdout(self, prefix: str, timeout: float = 10.0) -> str:
        """Wait for a stdout line starting with ``prefix``; return it."""
        with anyio.fail_after(timeout):
            while True:
                for line in self.stdout:
                    if line.startswith(prefix):
                        return line
                await self._changed.wait()

    async def wait_exit(self, timeout: float = 10.0) -> int:
        """Wait for the process to end (output collected); return its exit status."""
        with anyio.fail_after(timeout):
            return await self.process.wait()


SpawnPlugin = Callable[..., AbstractAsyncContextManager[PluginProcess]]


@pytest.fixture
def spawn_plugin() -> SpawnPlugin:
    """Start ``_plugin_main.py`` with the given arguments for the body of an ``async with``.

    On exit a process still running is killed; its output stays readable on the object.
    """

    @asynccontextmanager
    async def spawn(*args: str) -> AsyncIterator[PluginProcess]:
        process = await anyio.open_process(
            [sys.executable, str(PLUGIN_MAIN), *args], stdin=subprocess.DEVNULL
        )
        plugin = PluginProcess(process)
        assert process.stdout is not None
        assert process.stderr is not None
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(plugin.collect, process.stdout, plugin.stdout)
                tg.start_soon(plugin.collect, process.stderr, plugin.stderr)
                try:
                    yield plugin
                finally:
                    with anyio.CancelScope(shield=True):
                        if process.returncode is None:
                            process.kill()
                        await process.wait()
        finally:
            with anyio.CancelScope(shield=True):
                await process.aclose()

    return spawn


async def test_sigkilled_plugin_is_started_again_over_its_stale_socket_and_registers(
    spawn_plugin: SpawnPlugin,
) -> None:
    async with FakeKubelet() as kubelet:
        socket_path = kubelet.directory / SOCKET
        async with spawn_plugin("--dir", str(kubelet.directory)) as first:
            await kubelet.wait_for_allocatable(RESOURCE, 4, timeout=20)
            first.signal(signal.SIGKILL)
            assert await first.wait_exit() == -signal.SIGKILL
        # The kubelet saw the stream break; the dead process's socket file stays behind.
        await kubelet.wait_for_allocatable(RESOURCE, 0)
        assert socket_path.exists()
        assert not kubelet.is_registered(RESOURCE)

        async with spawn_plugin("--dir", str(kubelet.directory)) as second:
            await kubelet.wait_for_registrations(RESOURCE, 2, timeout=20)
            await kubelet.wait_for_allocatable(RESOURCE, 4)
            got = await kubelet.allocate(RESOURCE, 2)
            assert len(got.device_ids) == 2
            assert await second.wait_for_stdout("allocating")
            assert kubelet.connections(RESOURCE) == 1
            assert "served by another live process" not in second.error_output


async def test_second_process_for_the_same_resource_exits_with_a_message_and_first_serves_on(
    spawn_plugin: SpawnPlugin,
) -> None:
    async with FakeKubelet() as kubelet, spawn_plugin("--dir", str(kubelet.directory)) as first:
        await kubelet.wait_for_allocatable(RESOURCE, 4, timeout=20)
        async with spawn_plugin("--dir", str(kubelet.directory)) as second:
            status = await second.wait_exit(timeout=20)
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


async def test_sigterm_with_streams_and_an_allocation_in_flight_ends_cleanly(
    spawn_plugin: SpawnPlugin,
) -> None:
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
                await plugin.wait_for_stdout("allocating d1,d3")
                plugin.signal(signal.SIGTERM)
                assert await plugin.wait_exit(timeout=20) == 0

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
