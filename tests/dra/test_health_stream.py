"""The kubelet's DRAResourceHealth stream: listed in GetInfo beside DRAPlugin, both versions,
the full state when a stream opens, every change after, the same reason as the taint and the
log, ``UNKNOWN`` for the devices of a plugin that stopped, and a heartbeat inside the timeout.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path

import anyio
import grpc
import pytest
from dra_helpers import DRIVER
from sdk_helpers import RESOURCE, widgets

from devplugin_sdk import Device, Health
from devplugin_sdk._wire.dra_health import MESSAGE_LIMIT, DraHealthClient
from devplugin_sdk._wire.dra_model import DeviceHealthStatus
from devplugin_sdk.api.dra_health.v1 import dra_health_pb2 as health_v1
from devplugin_sdk.api.dra_health.v1alpha1 import dra_health_pb2 as health_v1alpha1
from devplugin_sdk.dra.resources import DeviceTaint
from devplugin_sdk.runner import Reload
from devplugin_sdk.testing import DraNode, FakeKubelet, MemoryApi, StaticPlugin
from devplugin_sdk.types import Effect, HealthReport

ALL_SERVICES = (
    "v1.DRAPlugin",
    "v1beta1.DRAPlugin",
    "v1.DRAResourceHealth",
    "v1alpha1.DRAResourceHealth",
)
XID_79 = "Xid 79 (GPU has fallen off the bus)"


def health_of(kubelet: FakeKubelet, name: str) -> tuple[str, str]:
    return kubelet.dra.health.health(DRIVER, kubelet.node_name, name)


async def test_a_137_kubelet_follows_v1_and_sees_each_change_with_its_reason() -> None:
    plugin = StaticPlugin(RESOURCE, widgets(3))
    async with DraNode(plugin, driver=DRIVER) as node:
        kubelet, api, running = node.kubelet, node.api, node.running
        await kubelet.wait_for(
            lambda: kubelet.dra.health.streams.get(DRIVER) == "v1.DRAResourceHealth",
            what="the v1 health stream",
        )
        (registration,) = kubelet.dra.successful_registrations(DRIVER)
        assert registration.versions == ALL_SERVICES
        assert registration.service == "v1.DRAPlugin"
        assert running.dra is not None
        assert running.dra.health_streams == 1
        assert [health_of(kubelet, n) for n in ("w0", "w1", "w2")] == [("Healthy", "")] * 3

        plugin.set_health("w1", Health.UNHEALTHY, XID_79)
        await kubelet.wait_for(
            lambda: health_of(kubelet, "w1") == ("Unhealthy", XID_79), what="w1 unhealthy"
        )

        # The same reason is the taint's cause and the log's (the pool is written within the
        # publisher's coalescing window, which the stream does not wait for).
        def taints() -> tuple[DeviceTaint, ...]:
            return next(
                d.taints for s in api.pool(DRIVER, "node-1") for d in s.devices if d.name == "w1"
            )

        await kubelet.wait_for(lambda: bool(taints()), what="w1 tainted")
        (taint,) = taints()
        assert taint.value == "Xid-79-GPU-has-fallen-off-the-bus"

        plugin.set_health("w2", Health.HEALTHY, "Xid 43 (GPU stopped processing)", Effect.ADVISORY)
        await kubelet.wait_for(
            lambda: (
                health_of(kubelet, "w2") == ("Healthy", "advisory: Xid 43 (GPU stopped processing)")
            ),
            what="an advisory on w2",
        )
        plugin.set_health("w1", Health.HEALTHY, "recovered")
        await kubelet.wait_for(lambda: health_of(kubelet, "w1") == ("Healthy", ""))


@pytest.mark.parametrize(
    ("services", "followed"),
    [
        (("v1.DRAPlugin", "v1beta1.DRAPlugin", "v1alpha1.DRAResourceHealth"), "v1alpha1"),
        (("v1beta1.DRAPlugin",), None),
    ],
    ids=["kubelet-1.34", "kubelet-1.32"],
)
async def test_older_kubelets_follow_what_they_speak(
    services: tuple[str, ...], followed: str | None
) -> None:
    plugin = StaticPlugin(RESOURCE, widgets(2))
    async with DraNode(plugin, driver=DRIVER, kubelet_options={"dra_services": services}) as node:
        kubelet = node.kubelet
        if followed is None:
            # Registered, prepared through v1beta1; nothing asked for health.
            assert kubelet.dra.health.streams == {}
            assert health_of(kubelet, "w0") == ("Unknown", "")
            return
        await kubelet.wait_for(
            lambda: kubelet.dra.health.streams.get(DRIVER) == f"{followed}.DRAResourceHealth"
        )
        plugin.set_health("w0", Health.UNHEALTHY, "gone")
        await kubelet.wait_for(lambda: health_of(kubelet, "w0") == ("Unhealthy", "gone"))


@pytest.mark.parametrize("service", ["v1.DRAResourceHealth", "v1alpha1.DRAResourceHealth"])
async def test_a_stream_gets_the_full_state_then_every_change(service: str) -> None:
    """A client of the upstream messages (field numbers checked in tests/api): the first message
    holds every device, the next ones follow each change."""
    plugin = StaticPlugin(RESOURCE, widgets(3))
    async with DraNode(plugin, driver=DRIVER) as node:
        options = node.options
        async with _stream(options.resolved_plugin_dir / "dra.sock", service) as messages:
            first = await messages.__anext__()
            assert [(d.pool, d.device, d.health, d.message) for d in first] == [
                ("node-1", f"w{i}", "HEALTHY", "") for i in range(3)
            ]
            assert {d.timeout_seconds for d in first} == {30}
            assert all(abs(d.updated - time.time()) < 60 for d in first)
            plugin.set_health("w2", Health.UNHEALTHY, "x" * 2000)
            changed = await messages.__anext__()
            w2 = next(d for d in changed if d.device == "w2")
            assert w2.health == "UNHEALTHY"
            assert w2.message == "x" * 1021 + "..."  # the kubelet's limit, our cut
            assert len(changed) == 3


async def test_the_devices_of_a_stopped_plugin_are_unknown(tmp_path: Path) -> None:
    api = MemoryApi(nodes=["node-1"])
    widget = StaticPlugin(RESOURCE, widgets(2))
    gizmo = StaticPlugin("acme.com/gizmo", [Device("g0"), Device("g1")])
    current: list[StaticPlugin] = [widget, gizmo]
    config = tmp_path / "config.yaml"
    config.write_text("1")
    reload = Reload(lambda: list(current), config, sighup=False)
    async with DraNode(*current, driver=DRIVER, memory=api, reload=reload) as node:
        kubelet = node.kubelet
        await kubelet.wait_for(lambda: health_of(kubelet, "g0") == ("Healthy", ""))
        del current[1]
        (tmp_path / "next.yaml").write_text("2")
        (tmp_path / "next.yaml").replace(config)
        await kubelet.wait_for(
            lambda: health_of(kubelet, "g0") == ("Unknown", "the plugin of acme.com/gizmo stopped"),
            what="g0 unknown",
        )
        assert health_of(kubelet, "w0") == ("Healthy", "")


async def test_a_quiet_pool_is_sent_again_inside_the_timeout() -> None:
    """The kubelet reads a device it has not heard about within health_check_timeout_seconds
    as Unknown: with nothing changing, every device is sent again at timeout / 3."""
    plugin = StaticPlugin(RESOURCE, widgets(1))
    async with DraNode(plugin, driver=DRIVER, health_timeout=3) as node:
        kubelet = node.kubelet
        await kubelet.wait_for(lambda: kubelet.dra.health.messages >= 1)
        seen = kubelet.dra.health.messages
        await kubelet.wait_for(
            lambda: kubelet.dra.health.messages >= seen + 2, what="two heartbeats"
        )
        assert health_of(kubelet, "w0") == ("Healthy", "")


class _LongReasons(StaticPlugin):
    """Polled health: every device Unhealthy with a long reason once ``failed`` (one poll
    makes them all fail at once)."""

    def __init__(self, count: int) -> None:
        super().__init__(RESOURCE, widgets(count))
        self.failed = False

    async def check_health(self, devices: Sequence[Device]) -> Mapping[str, Health]:
        if not self.failed:
            return {}
        return HealthReport(
            {d.id: Health.UNHEALTHY for d in devices}, {d.id: "x" * 1024 for d in devices}
        )


async def test_every_stream_of_either_version_sends_the_same_encoded_messages() -> None:
    """The state is encoded once per change and written as it is to every stream: v1 and
    v1alpha1 have the same field numbers, so the bytes are the same; messages stay under the
    limit, and together hold every device once."""
    plugin = _LongReasons(3000)  # 3,000 x ~1 KiB: three messages of MESSAGE_LIMIT and more
    async with DraNode(plugin, driver=DRIVER, settings={"health_interval": 0.1}) as node:
        socket = node.options.resolved_plugin_dir / "dra.sock"
        plugin.failed = True
        kubelet = node.kubelet
        await kubelet.wait_for(lambda: health_of(kubelet, "w2999")[0] == "Unhealthy")
        first = await _raw_state(socket, "v1")
        second = await _raw_state(socket, "v1alpha1")
    assert first == second
    assert len(first) > 2
    assert all(len(message) <= MESSAGE_LIMIT for message in first)
    names = [
        d.device.device_name
        for message in first
        for d in health_v1.NodeWatchResourcesResponse.FromString(message).devices
    ]
    assert sorted(names) == sorted(f"w{i}" for i in range(3000))


async def _raw_state(socket: Path, version: str) -> list[bytes]:
    """The messages of one whole state on a new stream of ``version``, as bytes."""
    pb = health_v1 if version == "v1" else health_v1alpha1
    async with grpc.aio.insecure_channel(f"unix:{socket}") as channel:
        call = channel.unary_stream(
            f"/{version}.DRAResourceHealth/NodeWatchResources",
            request_serializer=pb.NodeWatchResourcesRequest.SerializeToString,
            response_deserializer=bytes,
        )(pb.NodeWatchResourcesRequest())
        messages: list[bytes] = []
        names: set[str] = set()
        with anyio.fail_after(10):
            while len(names) < 3000:
                messages.append(await call.read())
                response = pb.NodeWatchResourcesResponse.FromString(messages[-1])
                names.update(d.device.device_name for d in response.devices)
        call.cancel()
    return messages


async def test_a_client_that_takes_nothing_is_dropped_and_gets_the_whole_state_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A client that never reads: its window (64 KiB without BDP probing) fills with the first
    message, the write waits a heartbeat period (health_timeout / 3 = 1 s) and the stream is
    ended with RESOURCE_EXHAUSTED and one warning; a stream opened again gets every device."""
    plugin = _LongReasons(200)  # ~200 KiB a state: more than the window
    async with DraNode(
        plugin, driver=DRIVER, health_timeout=3, settings={"health_interval": 0.1}
    ) as node:
        socket = node.options.resolved_plugin_dir / "dra.sock"
        plugin.failed = True
        kubelet = node.kubelet
        await kubelet.wait_for(lambda: health_of(kubelet, "w199")[0] == "Unhealthy")
        options = [("grpc.http2.bdp_probe", 0)]
        async with grpc.aio.insecure_channel(f"unix:{socket}", options=options) as channel:
            client = DraHealthClient(channel, "v1.DRAResourceHealth")
            mute = client.watch()
            pending = anyio.Event()

            async def open_and_stay_mute() -> None:
                # The first read opens the stream; nothing more is read after it.
                await mute.__anext__()
                pending.set()

            async with anyio.create_task_group() as tg:
                tg.start_soon(open_and_stay_mute)
                await pending.wait()
            await kubelet.wait_for(lambda: node.status.health_streams == 2, what="2 streams")
            await kubelet.wait_for(
                lambda: node.status.health_streams == 1, timeout=10, what="the mute one dropped"
            )
            with pytest.raises(grpc.aio.AioRpcError) as ended:
                await _read_to_the_end(mute)
            assert ended.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            again = client.watch()
            states: set[str] = set()
            with anyio.fail_after(10):
                while len(states) < 200:
                    states.update(d.device for d in await again.__anext__())
            await again.aclose()  # type: ignore[attr-defined]
        assert health_of(kubelet, "w0")[0] == "Unhealthy"  # the kubelet's own stream kept
    dropped = [r for r in caplog.records if "took no message" in r.getMessage()]
    assert len(dropped) == 1
    assert dropped[0].levelname == "WARNING"
    assert [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info] == []


async def _read_to_the_end(stream: AsyncIterator[list[DeviceHealthStatus]]) -> None:
    with anyio.fail_after(10):
        async for _ in stream:
            pass


class _Messages:
    def __init__(self, iterator: AsyncIterator[list[DeviceHealthStatus]]) -> None:
        self.iterator = iterator

    async def __anext__(self) -> list[DeviceHealthStatus]:
        with anyio.fail_after(5):
            return await self.iterator.__anext__()


class _stream:
    """A DRAResourceHealth client on ``socket`` for the body of an ``async with``."""

    def __init__(self, socket: Path, service: str) -> None:
        self.channel = grpc.aio.insecure_channel(f"unix:{socket}")
        self.iterator = DraHealthClient(self.channel, service).watch()

    async def __aenter__(self) -> _Messages:
        return _Messages(self.iterator)

    async def __aexit__(self, *exc: object) -> None:
        await self.iterator.aclose()  # type: ignore[attr-defined]
        await self.channel.close()
