"""The kubelet's DRAResourceHealth stream under load (issue 36, rows 11, 12 and 26).

A DRA node runs as a process of its own (``_dra_health_main.py``: the driver, the fake kubelet
that follows its health stream, the in-memory API); the test opens real gRPC streams on the
driver's ``dra.sock`` beside the kubelet's (clients that never read, clients that reconnect,
clients that read), makes devices flap, and reads the process's RSS from ``/proc`` and its
prepare times from its output. ``pytest -s`` prints the figures docs/reliability.md reports.
"""

from __future__ import annotations

import logging
import signal
import sys
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path

import anyio
import grpc
import pytest
from dra_helpers import DRIVER
from plugin_process import PluginProcess, spawned
from sdk_helpers import RESOURCE, widgets

from devplugin_sdk import Device, Health
from devplugin_sdk._wire.dra_health import DraHealthClient
from devplugin_sdk._wire.dra_model import health_message
from devplugin_sdk.api.dra_health.v1 import dra_health_pb2 as v1
from devplugin_sdk.testing import DraNode, StaticPlugin
from devplugin_sdk.types import HealthReport

MAIN = Path(__file__).with_name("_dra_health_main.py")
SERVICE = "v1.DRAResourceHealth"

# A node process starts in about 1-2 s on 2 cores, and each test runs a load for seconds.
pytestmark = pytest.mark.timeout(90)


def figure(row: int, text: str) -> None:
    """Print one measured figure for docs/reliability.md."""
    print(f"\n[issue 36 row {row}] {text}")


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


@asynccontextmanager
async def node_process(*args: str) -> AsyncIterator[tuple[PluginProcess, Path]]:
    """The node process, ready; with its driver's ``dra.sock``."""
    async with spawned(
        [sys.executable, str(MAIN), *args], ready="socket ", ready_stream="stdout", ready_timeout=60
    ) as node:
        [line] = node.lines("socket ", "stdout")
        yield node, Path(line.split(" ", 1)[1])


@asynccontextmanager
async def mute_stream(
    socket: Path, *, probing: bool = False
) -> AsyncIterator[grpc.aio.UnaryStreamCall[object, object]]:
    """A NodeWatchResources stream whose client never reads a message. Without BDP probing its
    window stays at HTTP/2's 64 KiB, so the driver's writes to it block within a second; with
    it (gRPC's default) the window grows to ~4 MiB first, which the client holds."""
    options = [("grpc.http2.bdp_probe", int(probing))]
    async with grpc.aio.insecure_channel(f"unix:{socket}", options=options) as channel:
        call = channel.unary_stream(
            "/v1.DRAResourceHealth/NodeWatchResources",
            request_serializer=v1.NodeWatchResourcesRequest.SerializeToString,
            response_deserializer=v1.NodeWatchResourcesResponse.FromString,
        )(v1.NodeWatchResourcesRequest())
        await call.initial_metadata()
        try:
            yield call
        finally:
            call.cancel()


async def load_ended(node: PluginProcess, timeout: float) -> tuple[int, float, float, float]:
    """Wait for the node's load to end; (prepares, p50 ms, p99 ms, its CPU share of a core)."""
    await node.wait_for("flapping ended", stream="stdout", timeout=timeout)
    [line] = node.lines("prepares ", "stdout")
    [cpu] = node.lines("cpu ", "stdout")
    _, count, p50, p99 = line.split()
    return int(count), float(p50), float(p99), float(cpu.split()[1])


# ------------------------------------------------------------------ row 11: clients that never read


async def _under_mute_clients(clients: int, devices: int, seconds: float) -> dict[str, float]:
    """One node process under the load, with ``clients`` streams that never read beside the
    kubelet's: its RSS before and at its peak, its prepares and the streams left open."""
    args = ("--devices", str(devices), "--flips-per-s", "30", "--flap-for", str(seconds))
    # health_timeout 3: a stream goes at most 1 s without a message, and a client that takes
    # none for as long is dropped, within the load.
    async with node_process(*args, "--prepares", "--health-timeout", "3") as (node, socket):
        idle = peak = rss_mib(node.pid)
        async with AsyncExitStack() as stack:
            for i in range(clients):
                await stack.enter_async_context(mute_stream(socket, probing=i % 2 == 0))
            node.signal(signal.SIGUSR1)
            with anyio.fail_after(seconds + 30):
                while not node.lines("flapping ended", "stdout"):
                    peak = max(peak, rss_mib(node.pid))
                    await anyio.sleep(0.1)  # a sampling period, not a wait for an event
            prepares, p50, p99, cpu = await load_ended(node, 5)
            [streams] = node.lines("streams ", "stdout")
        # A client that reads now gets the whole state, the mute ones' streams notwithstanding.
        async with grpc.aio.insecure_channel(f"unix:{socket}") as channel:
            first = await anext(aiter(DraHealthClient(channel, SERVICE).watch()))
    assert len(first) == devices
    return {
        "idle": idle,
        "peak": peak,
        "prepares": prepares,
        "p50": p50,
        "p99": p99,
        "cpu": cpu,
        "streams": int(streams.split()[1]),
    }


async def test_clients_that_never_read_cost_a_bounded_memory() -> None:
    """The same load (30 flips/s on 200 devices, prepares without pause) on two nodes, one with
    50 clients that never read: the RSS they cost is the difference of the two peaks (the
    node's own load grows it too: its in-memory API keeps every slice version). Half the
    clients probe the bandwidth and take ~4 MiB before a write blocks; the other half block
    within a second and are dropped."""
    clients, devices, seconds = 50, 200, 16.0
    alone = await _under_mute_clients(0, devices, seconds)
    mute = await _under_mute_clients(clients, devices, seconds)
    cost = mute["peak"] - alone["peak"]
    figure(
        11,
        f"{clients} clients that never read, {devices} devices, 30 flips/s for {seconds:g} s: "
        f"peak RSS {mute['peak']:.0f} MiB vs {alone['peak']:.0f} without them ({cost:+.1f} MiB; "
        f"idle {alone['idle']:.0f}); {mute['streams']:.0f} streams left open at the end (the "
        f"kubelet's and the probing clients'); prepares p50 {mute['p50']:.1f} / p99 {mute['p99']:.1f} ms "
        f"({mute['prepares']:.0f}) vs {alone['p50']:.1f} / {alone['p99']:.1f} ms "
        f"({alone['prepares']:.0f}) without them; the node {mute['cpu']:.0%} / {alone['cpu']:.0%} "
        f"of a core",
    )
    assert cost < 20
    # Every client whose window filled was dropped: the kubelet's stream and the probing
    # clients' (~4 MiB each to fill at a state per 0.1 s) are left.
    assert mute["streams"] == 1 + clients // 2
    assert mute["prepares"] > 0


# ------------------------------------------------------------------ row 12: 2,000 devices


class _Records(logging.Handler):
    """Every log record of the process while installed."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


class _FailingAtOnce(StaticPlugin):
    """Polled health: every device Unhealthy at once, each with ``reason``, once ``failed``."""

    def __init__(self, devices: int, reason: str) -> None:
        super().__init__(RESOURCE, widgets(devices))
        self.reason = reason
        self.failed = False

    async def check_health(self, devices: Sequence[Device]) -> Mapping[str, Health]:
        if not self.failed:
            return {}
        return HealthReport(
            {d.id: Health.UNHEALTHY for d in devices}, {d.id: self.reason for d in devices}
        )


async def test_two_thousand_devices_reach_the_kubelet_in_messages_under_its_limit() -> None:
    """The kubelet reads at most 4 MiB a message (grpc-go's default, which it keeps; the fake
    kubelet's grpc.aio client has the same default); 2,000 devices with a long message each
    are 10 MB of health."""
    devices = 2000
    reason = "\N{GRINNING FACE}" * 2000  # 4 bytes each in UTF-8; the kubelet keeps 1,024 of them
    records = _Records()
    logging.getLogger().addHandler(records)
    plugin = _FailingAtOnce(devices, reason)
    sizes: list[int] = []
    try:
        async with DraNode(
            plugin, driver=DRIVER, timeout=30, settings={"health_interval": 0.1}
        ) as node:
            kubelet = node.kubelet
            plugin.failed = True
            await kubelet.wait_for(
                lambda: all(
                    kubelet.dra.health.health(DRIVER, node.node_name, f"w{i}")[0] == "Unhealthy"
                    for i in range(devices)
                ),
                timeout=15,
                what="every device unhealthy in the kubelet's cache",
            )
            async with grpc.aio.insecure_channel(
                f"unix:{node.options.resolved_plugin_dir / 'dra.sock'}"
            ) as channel:
                seen = await _one_frame(channel, devices, sizes)
    finally:
        logging.getLogger().removeHandler(records)
    tracebacks = [r.getMessage() for r in records.records if r.exc_info or r.exc_text]
    figure(
        12,
        f"{devices} devices with a {len(health_message(reason).encode())}-byte message each: "
        f"{len(sizes)} messages of at most {max(sizes) / 2**20:.2f} MiB "
        f"({sum(sizes) / 2**20:.1f} MiB in all); the kubelet holds all {devices} Unhealthy; "
        f"{len(tracebacks)} tracebacks",
    )
    assert seen == {f"w{i}" for i in range(devices)}
    assert max(sizes) < 4 * 2**20
    assert tracebacks == []


async def _one_frame(channel: grpc.aio.Channel, devices: int, sizes: list[int]) -> set[str]:
    """Read a stream until every device was in a message; record each message's size."""
    call = channel.unary_stream(
        "/v1.DRAResourceHealth/NodeWatchResources",
        request_serializer=v1.NodeWatchResourcesRequest.SerializeToString,
        response_deserializer=lambda data: data,  # the raw message, to measure it
    )(v1.NodeWatchResourcesRequest())
    seen: set[str] = set()
    with anyio.fail_after(30):
        while len(seen) < devices:
            data = await call.read()
            assert data is not grpc.aio.EOF
            sizes.append(len(data))
            response = v1.NodeWatchResourcesResponse.FromString(data)
            seen.update(d.device.device_name for d in response.devices)
    call.cancel()
    return seen


# ------------------------------------------------------------------ row 26: many streams, one flapping


def _raw_call(channel: grpc.aio.Channel) -> grpc.aio.UnaryStreamCall[object, bytes]:
    """A new NodeWatchResources stream whose messages are read as bytes: the load on the
    driver is the same, and the test's own clients spend no CPU decoding 2,000 devices."""
    return channel.unary_stream(
        "/v1.DRAResourceHealth/NodeWatchResources",
        request_serializer=v1.NodeWatchResourcesRequest.SerializeToString,
        response_deserializer=bytes,
    )(v1.NodeWatchResourcesRequest())


async def _reconnecting(socket: Path) -> None:
    """A client that reads one message and opens its stream again, without end."""
    async with grpc.aio.insecure_channel(f"unix:{socket}") as channel:
        while True:
            call = _raw_call(channel)
            await call.read()
            call.cancel()


async def _reading(socket: Path) -> None:
    async with grpc.aio.insecure_channel(f"unix:{socket}") as channel:
        async for _ in _raw_call(channel):
            pass


async def _prepares_beside(
    devices: int, seconds: float, streams: bool
) -> tuple[int, float, float, float]:
    """One node process: a device of ``devices`` flips every 20 ms (a plugin's health event,
    through the pool to the health board) for ``seconds`` while pods are prepared; with
    ``streams``, 40 clients beside the kubelet's (20 never read, 10 reconnect after each
    message, 10 read)."""
    args = ("--devices", str(devices), "--flips-per-s", "50", "--flap-for", str(seconds))
    async with node_process(*args, "--prepares") as (node, socket):
        async with AsyncExitStack() as stack, anyio.create_task_group() as tg:
            for _ in range(20 if streams else 0):
                await stack.enter_async_context(mute_stream(socket))
            for _ in range(10 if streams else 0):
                tg.start_soon(_reconnecting, socket)
                tg.start_soon(_reading, socket)
            node.signal(signal.SIGUSR1)
            result = await load_ended(node, seconds + 30)
            tg.cancel_scope.cancel()
    return result


async def test_forty_streams_on_two_thousand_devices_leave_prepares_their_pace() -> None:
    """The flips go the whole way, plugin to pool to board: the streams beside the kubelet's
    must leave prepares their pace (the pool's own cost per batch is rows 13 and 14's)."""
    devices, seconds = 2000, 5.0
    alone = await _prepares_beside(devices, seconds, streams=False)
    prepares, p50, p99, cpu = await _prepares_beside(devices, seconds, streams=True)
    figure(
        26,
        f"40 streams (20 never read, 10 reconnect, 10 read) on {devices} devices, one flip every "
        f"20 ms for {seconds:g} s: {prepares} prepares, p50 {p50:.1f} ms, p99 {p99:.1f} ms, the "
        f"node {cpu:.0%} of a core; with the kubelet's stream alone {alone[0]}, p50 "
        f"{alone[1]:.1f} ms, p99 {alone[2]:.1f} ms, {alone[3]:.0%}",
    )
    assert prepares > alone[0] / 4
