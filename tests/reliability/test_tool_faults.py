"""The test tools under faults (issue 25, rows 6 and 10): FakeKubelet restarted while a
registration or a DRA prepare is in flight, and peers that answer bytes that are not protobuf.

The plugins here are raw gRPC servers on real unix sockets, so that a test holds the exact point
a call is at (a GetDevicePluginOptions or a NodePrepareResources that has arrived and not
answered); the commands are real ``python -m devplugin_sdk`` subprocesses.
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import grpc
import pytest
from cli_process import devplugin, running

from devplugin_sdk import Device
from devplugin_sdk._wire import client, dra_convert, dra_service, watcher_registration
from devplugin_sdk.api import constants
from devplugin_sdk.api.deviceplugin.v1beta1 import deviceplugin_pb2 as pb
from devplugin_sdk.api.deviceplugin.v1beta1 import deviceplugin_pb2_grpc as pb_grpc
from devplugin_sdk.dra.resources import AllocatedDevice, ResourceClaim
from devplugin_sdk.kubelet.fake_dra import PodPreparationError
from devplugin_sdk.testing import FakeKubelet, MemoryApi, StaticPlugin, serving

pytestmark = pytest.mark.timeout(60)

RESOURCE = "tools.example.com/dev"
DRIVER = "tools.example.com"
#: Bytes no protobuf message parses ("Wire format was corrupt").
GARBAGE = b"\xff\xff\xff\xff"

Answer = Callable[[bytes], Awaitable[bytes]]


async def _hang(request: bytes) -> bytes:
    await anyio.sleep_forever()
    raise AssertionError("unreachable")


async def _garbage(request: bytes) -> bytes:
    return GARBAGE


def _raw_garbage(request: bytes, context: Any) -> bytes:
    return GARBAGE


async def _empty(request: bytes) -> bytes:
    return b""  # an empty message: valid for every type


class RawPlugin:
    """A v1beta1.DevicePlugin server answering raw bytes; ``arrived`` records each method
    called, and ``called(method)`` is set when it first arrives."""

    def __init__(self, answers: dict[str, Answer], stream: Answer | None = None) -> None:
        self.answers = answers
        self.stream = stream or _hang
        self.events: dict[str, anyio.Event] = {}

    def called(self, method: str) -> anyio.Event:
        return self.events.setdefault(method, anyio.Event())

    def handler(self) -> grpc.GenericRpcHandler:
        def unary(method: str) -> grpc.RpcMethodHandler[Any, Any]:
            async def answer(request: bytes, context: Any) -> bytes:
                self.called(method).set()
                return await self.answers.get(method, _empty)(request)

            return grpc.unary_unary_rpc_method_handler(answer)

        async def list_and_watch(request: bytes, context: Any) -> AsyncIterator[bytes]:
            self.called("ListAndWatch").set()
            yield await self.stream(request)
            await anyio.sleep_forever()

        methods = {
            m: unary(m)
            for m in (
                "GetDevicePluginOptions",
                "Allocate",
                "GetPreferredAllocation",
                "PreStartContainer",
            )
        }
        methods["ListAndWatch"] = grpc.unary_stream_rpc_method_handler(list_and_watch)
        return grpc.method_handlers_generic_handler("v1beta1.DevicePlugin", methods)


@asynccontextmanager
async def served(path: Path, *handlers: grpc.GenericRpcHandler) -> AsyncIterator[Path]:
    server = grpc.aio.server()
    server.add_generic_rpc_handlers(handlers)
    server.add_insecure_port(f"unix:{path}")
    await server.start()
    try:
        yield path
    finally:
        with anyio.CancelScope(shield=True):
            await server.stop(0)


async def register(kubelet_sock: Path, endpoint: str, resource: str = RESOURCE) -> str:
    """Call Register as a plugin does; the outcome as a word (``ok`` or the status code)."""
    async with grpc.aio.insecure_channel(f"unix:{kubelet_sock}") as channel:
        try:
            await pb_grpc.RegistrationStub(channel).Register(
                pb.RegisterRequest(
                    version=constants.VERSION, endpoint=endpoint, resource_name=resource
                ),
                timeout=20,
            )
        except grpc.aio.AioRpcError as exc:
            return exc.code().name
    return "ok"


# ------------------------------------------------------------------------------ row 6: restarts


async def test_restart_while_register_dials_back_runs_the_body_to_its_end() -> None:
    plugin = RawPlugin({"GetDevicePluginOptions": _hang})
    reached_the_end = False
    outcomes: list[str] = []
    started = time.monotonic()
    async with FakeKubelet() as kubelet:
        async with (
            served(kubelet.directory.parent / "hang.sock", plugin.handler()) as sock,
            anyio.create_task_group() as tg,
        ):

            async def call() -> None:
                outcomes.append(await register(kubelet.socket_path, f"../{sock.name}"))

            tg.start_soon(call)
            # The kubelet has dialled back and waits for GetDevicePluginOptions.
            with anyio.fail_after(10):
                await plugin.called("GetDevicePluginOptions").wait()
            await kubelet.restart()
            await kubelet.wait_for(lambda: bool(outcomes), what="the Register call to end")
        # The kubelet runs on: a plugin registers after the restart.
        async with serving(StaticPlugin(RESOURCE, [Device("d0")]), settings=kubelet.settings()):
            await kubelet.wait_for_allocatable(RESOURCE, 1, timeout=10)
        reached_the_end = True
    assert reached_the_end
    # The plugin's Register failed (the kubelet went away under it); it is not left hanging.
    assert outcomes != ["ok"]
    assert time.monotonic() - started < 20


async def test_restart_storm_while_a_plugin_registers_never_cuts_the_body_short() -> None:
    reached = 0
    async with FakeKubelet() as kubelet:
        plugin = StaticPlugin(RESOURCE, [Device("d0"), Device("d1")])
        async with serving(plugin, settings=kubelet.settings(register_backoff_max=0.05)):
            await kubelet.wait_for_allocatable(RESOURCE, 2, timeout=10)
            for _ in range(25):
                calls = kubelet.register_calls
                await kubelet.restart()
                # Restart again as soon as the plugin's Register arrives: mid dial-back.
                await kubelet.wait_for(lambda: kubelet.register_calls > calls, timeout=10)  # noqa: B023
                reached += 1
            await kubelet.restart()
            await kubelet.wait_for_allocatable(RESOURCE, 2, timeout=10)
            reached += 1
    assert reached == 26


def _claim(memory: MemoryApi, pod_uid: str, node: str) -> None:
    memory.claims[("default", "c0")] = ResourceClaim(
        "default",
        "c0",
        "uid-c0",
        allocated=True,
        results=(AllocatedDevice("r", DRIVER, node, "w0"),),
        reserved_for=(pod_uid,),
    )


@asynccontextmanager
async def dra_driver(
    kubelet: FakeKubelet, *handlers: grpc.GenericRpcHandler
) -> AsyncIterator[None]:
    """A DRA driver serving ``handlers`` on its DRA socket, registered through plugins_registry."""
    registered = anyio.Event()
    dra_sock = kubelet.directory.parent / "dra.sock"

    def on_status(ok: bool, error: str) -> None:
        if ok:
            registered.set()

    info = watcher_registration.handler(
        DRIVER,
        on_status,
        plugin_type=constants.PLUGIN_TYPE_DRA_PLUGIN,
        endpoint=str(dra_sock),
        versions=[constants.DRA_SERVICE_V1],
    )
    kubelet.registry_directory.mkdir(parents=True, exist_ok=True)
    async with (
        served(dra_sock, *handlers),
        served(kubelet.registry_directory / f"{DRIVER}-reg.sock", info),
    ):
        with anyio.fail_after(10):
            await registered.wait()
        yield


async def _unprepare(claims: Any) -> dict[str, str]:
    return {c.uid: "" for c in claims}


async def test_restart_while_a_dra_prepare_is_in_flight_fails_the_pod_not_the_body() -> None:
    memory = MemoryApi()
    arrived = anyio.Event()

    async def prepare(claims: Any) -> dict[str, Any]:
        arrived.set()
        await anyio.sleep_forever()
        raise AssertionError("unreachable")

    failures: list[str] = []
    reached_the_end = False
    handlers = dra_service.handlers(prepare, _unprepare, [constants.DRA_SERVICE_V1])
    async with FakeKubelet(dra_api=memory) as kubelet, dra_driver(kubelet, *handlers):
        pod = kubelet.dra.pod("default", "p0", ["c0"])
        _claim(memory, pod.uid, kubelet.node_name)

        async def admit() -> None:
            try:
                await kubelet.dra.prepare(pod)
            except PodPreparationError as exc:
                failures.append(str(exc))

        async with anyio.create_task_group() as tg:
            tg.start_soon(admit)
            with anyio.fail_after(10):
                await arrived.wait()
            await kubelet.restart()
        reached_the_end = True
    assert reached_the_end
    assert len(failures) == 1
    assert failures[0].startswith("NodePrepareResources failed: ")
    assert "kubelet stopped" in failures[0]


async def test_fake_kubelet_command_survives_sighups_while_a_register_is_in_flight(
    short_dir: Path,
) -> None:
    directory = short_dir / "device-plugins"
    plugin = RawPlugin({"GetDevicePluginOptions": _hang})
    async with (
        running("fake-kubelet", "--dir", str(directory)) as kubelet,
        served(short_dir / "hang.sock", plugin.handler()) as sock,
        anyio.create_task_group() as tg,
    ):
        await kubelet.wait_for(f"fake kubelet serving {directory}/kubelet.sock", stream="stdout")
        for storm in range(1, 4):
            dialled = plugin.events["GetDevicePluginOptions"] = anyio.Event()
            tg.start_soon(register_until, directory / "kubelet.sock", f"../{sock.name}", dialled)
            with anyio.move_on_after(10):
                await dialled.wait()
            assert dialled.is_set(), (kubelet.process.returncode, kubelet.text("stdout"))
            kubelet.signal(signal.SIGHUP)
            await kubelet.wait_for("restarting (SIGHUP)", stream="stdout", count=storm)
        # Still serving: a plugin registers after the storm.
        config = _generic(short_dir)
        async with running(
            "run", "generic", "--config", str(config), "--device-plugin-dir", str(directory)
        ):
            await kubelet.wait_for(
                "example.com/serial: device list: capacity 1, allocatable 1", stream="stdout"
            )
        assert kubelet.process.returncode is None
        assert await kubelet.stop() == 0
        tg.cancel_scope.cancel()
    assert "fake kubelet stopped" in kubelet.text("stdout")
    assert "Traceback" not in kubelet.text("stderr")


async def register_until(kubelet_sock: Path, endpoint: str, dialled: anyio.Event) -> None:
    """Register (again after each failure, as a plugin does) until the kubelet dials back."""
    while not dialled.is_set():
        await register(kubelet_sock, endpoint)
        await anyio.sleep(0.05)  # a plugin's retry interval


def _generic(root: Path) -> Path:
    devices = root / "devs"
    devices.mkdir(exist_ok=True)
    (devices / "tty0").touch()
    config = root / "serial.yaml"
    config.write_text(
        "registration: kubelet\n"
        f"resources:\n  - resourceName: example.com/serial\n    paths: ['{devices}/tty*']\n"
    )
    return config


# ------------------------------------------------------------------------------ row 10: garbage


async def test_probe_reports_an_undecodable_answer_in_one_line(short_dir: Path) -> None:
    plugin = RawPlugin({"GetDevicePluginOptions": _garbage})
    async with served(short_dir / "garbage.sock", plugin.handler()) as sock:
        result = await anyio.to_thread.run_sync(lambda: devplugin("probe", "--socket", str(sock)))
    output = (result.stdout + result.stderr).strip()
    assert result.returncode == 1, output
    assert "Traceback" not in output
    assert len(output.splitlines()) == 1, output
    assert "GetDevicePluginOptions" in output
    assert "not a valid DevicePluginOptions message" in output


async def test_probe_reports_an_undecodable_list_in_one_line(short_dir: Path) -> None:
    plugin = RawPlugin({}, stream=_garbage)
    async with served(short_dir / "garbage.sock", plugin.handler()) as sock:
        result = await anyio.to_thread.run_sync(lambda: devplugin("probe", "--socket", str(sock)))
    output = (result.stdout + result.stderr).strip()
    assert result.returncode == 1, output
    assert "Traceback" not in output
    assert len(output.splitlines()) == 1, output
    assert "not a valid ListAndWatchResponse message" in output


async def test_fake_kubelet_command_refuses_an_undecodable_plugin_and_keeps_going(
    short_dir: Path,
) -> None:
    directory = short_dir / "device-plugins"
    options = RawPlugin({"GetDevicePluginOptions": _garbage})
    listing = RawPlugin({}, stream=_garbage)
    async with (
        running("fake-kubelet", "--dir", str(directory)) as kubelet,
        served(short_dir / "opts.sock", options.handler()) as opts,
        served(short_dir / "list.sock", listing.handler()) as lists,
    ):
        await kubelet.wait_for(f"fake kubelet serving {directory}/kubelet.sock", stream="stdout")
        assert await register(directory / "kubelet.sock", f"../{opts.name}") == "UNKNOWN"
        await kubelet.wait_for(
            f"{RESOURCE}: Register refused: failed to get device plugin options: rpc error: "
            "code = Internal desc = the plugin's answer is not a valid DevicePluginOptions message",
            stream="stdout",
        )
        other = "tools.example.com/list"
        assert await register(directory / "kubelet.sock", f"../{lists.name}", other) == "ok"
        await kubelet.wait_for(f"{other}: ListAndWatch stream ended", stream="stdout")
        assert kubelet.process.returncode is None
        assert await kubelet.stop() == 0
    assert "Traceback" not in kubelet.text("stderr")


async def test_conformance_register_dir_reports_an_undecodable_plugin_and_finishes(
    short_dir: Path,
) -> None:
    directory = short_dir / "device-plugins"
    plugin = RawPlugin({"GetDevicePluginOptions": _garbage})
    args = ("--register-dir", str(directory), "--wait", "20", "--restart-timeout", "1")
    args += ("--timeout", "2")  # the raw plugin never lists: list-prompt waits this long
    async with (
        running("conformance", *args) as conformance,
        served(short_dir / "garbage.sock", plugin.handler()) as sock,
    ):
        await conformance.wait_for("waiting for a plugin to register", stream="stdout")
        await register(directory / "kubelet.sock", f"../{sock.name}")
        code = await conformance.exited(timeout=30)
    assert "Traceback" not in conformance.text("stderr"), conformance.text("stderr")
    assert code == 1, conformance.text("stdout")  # checks failed: the verdict, not a crash
    assert "not a valid DevicePluginOptions message" in conformance.text("stdout")
    assert conformance.lines(
        "FAIL  registration-valid  the kubelet rejected it: failed to get "
        "device plugin options: rpc error: code = Internal",
        "stdout",
    )
    assert " failed" in conformance.stdout[-1]  # the summary: it ran to its end


async def test_fake_kubelet_survives_undecodable_answers_on_every_path(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """GetInfo, GetDevicePluginOptions, ListAndWatch and NodePrepareResources answered with
    garbage: each is the kubelet's error for that call, never an exception of FakeKubelet."""
    memory = MemoryApi()
    info_garbage = grpc.method_handlers_generic_handler(
        "pluginregistration.Registration",
        {"GetInfo": grpc.unary_unary_rpc_method_handler(lambda request, context: GARBAGE)},
    )
    caplog.set_level(logging.INFO, "devplugin_sdk")
    async with FakeKubelet(dra_api=memory, plugin_watcher=True) as kubelet:
        kubelet.registry_directory.mkdir(parents=True, exist_ok=True)
        async with (
            served(kubelet.registry_directory / "garbage.sock", info_garbage),
            served(kubelet.directory.parent / "list.sock", RawPlugin({}, _garbage).handler()) as s,
        ):
            assert await register(kubelet.socket_path, f"../{s.name}") == "ok"
            await kubelet.wait_for(lambda: kubelet.ended_streams(RESOURCE) == 1)
            assert not kubelet.is_registered(RESOURCE)

        pod = kubelet.dra.pod("default", "p0", ["c0"])
        _claim(memory, pod.uid, kubelet.node_name)
        package = dra_convert.VERSIONS[constants.DRA_SERVICE_V1].DESCRIPTOR.package
        garbage_dra = grpc.method_handlers_generic_handler(
            f"{package}.DRAPlugin",
            {"NodePrepareResources": grpc.unary_unary_rpc_method_handler(_raw_garbage)},
        )
        async with dra_driver(kubelet, garbage_dra):
            with pytest.raises(PodPreparationError) as failed:
                await kubelet.dra.prepare(pod)
        assert str(failed.value).startswith(
            "NodePrepareResources failed: rpc error: code = INTERNAL desc = the plugin's answer "
            "is not a valid NodePrepareResourcesResponse message"
        )
    assert not [r for r in caplog.records if r.exc_info], [r.getMessage() for r in caplog.records]
    messages = [r.getMessage() for r in caplog.records]
    assert any("ListAndWatch for tools.example.com/dev ended: INTERNAL" in m for m in messages)


async def test_a_call_on_a_closed_channel_is_the_kubelets_cancelled_error(short_dir: Path) -> None:
    """The fake's calls meet a channel closed under them (a v1.32 stream end disconnecting the
    newest client): a CANCELLED error of the call, never grpc.aio's UsageError or a bare
    CancelledError."""
    async with served(short_dir / "p.sock", RawPlugin({"GetDevicePluginOptions": _hang}).handler()):
        channel = grpc.aio.insecure_channel(f"unix:{short_dir / 'p.sock'}")
        plugin = client.DevicePluginClient(channel)
        async with anyio.create_task_group() as tg:
            errors: list[grpc.aio.AioRpcError] = []

            async def options() -> None:
                try:
                    await client.call(plugin.options())
                except grpc.aio.AioRpcError as exc:
                    errors.append(exc)

            tg.start_soon(options)
            await client.ready(channel, 5)
            await anyio.wait_all_tasks_blocked()
            await channel.close()
        with pytest.raises(grpc.aio.AioRpcError) as closed:
            await client.call(plugin.options())
    assert [e.code() for e in errors] == [grpc.StatusCode.CANCELLED]
    assert closed.value.code() is grpc.StatusCode.CANCELLED
