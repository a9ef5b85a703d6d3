"""devplugin probe: what the kubelet gets from a plugin, and clear errors when it gets nothing."""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import re
import socket
import sys
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import anyio
import grpc
import pytest
from broken_plugins import serve_not_grpc, serve_silent, serving_raw

from devplugin_sdk import (
    Device,
    DeviceNode,
    DevicePlugin,
    Health,
    HealthEvent,
    Mount,
)
from devplugin_sdk._wire import client as _client
from devplugin_sdk.kubelet import _cli_probe
from devplugin_sdk.kubelet.probe import (
    NotADevicePluginError,
    NotAnsweringError,
    PluginClient,
    ProtocolViolation,
    SocketMissingError,
    probe,
)
from devplugin_sdk.testing import FakeKubelet, serving
from devplugin_sdk.types import RescanEvent

RESOURCE = "acme.com/widget"
SOCKET = "acme.com_widget.sock"


class Widgets(DevicePlugin):
    """Four widgets on two NUMA nodes; prefers the highest IDs; w1 turns unhealthy on cue."""

    resource_name = RESOURCE

    def __init__(self) -> None:
        super().__init__()
        self.break_w1 = anyio.Event()

    async def discover(self) -> Sequence[Device]:
        return [
            Device(
                f"w{i}",
                numa_nodes=(i // 2,),
                device_nodes=(DeviceNode(f"/dev/widget{i}", permissions="rw"),),
                mounts=(Mount("/opt/widget/lib", "/usr/lib/widget", read_only=True),),
                env={"WIDGET_VISIBLE": f"w{i}"},
                annotations={"acme.com/widget": f"w{i}"},
                cdi_devices=(f"acme.com/widget=w{i}",),
            )
            for i in range(4)
        ]

    async def preferred_allocation(
        self, available: Sequence[Device], must_include: Sequence[Device], size: int
    ) -> Sequence[str]:
        return sorted((d.id for d in available), reverse=True)[:size]

    async def watch(self) -> AsyncIterator[HealthEvent | RescanEvent]:
        await self.break_w1.wait()
        yield HealthEvent("w1", Health.UNHEALTHY, reason="test")
        await anyio.sleep_forever()


class Output(io.StringIO):
    """stdout for a command running in the test's event loop; lets the test wait for lines."""

    def __init__(self) -> None:
        super().__init__()
        self._changed = anyio.Event()

    def write(self, text: str) -> int:
        written = super().write(text)
        self._changed.set()
        self._changed = anyio.Event()
        return written

    async def wait_for(self, pattern: str, timeout: float = 5.0) -> re.Match[str]:
        with anyio.fail_after(timeout):
            while (match := re.search(pattern, self.getvalue(), re.MULTILINE)) is None:
                await self._changed.wait()
        return match


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="devplugin")
    _cli_probe.register(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


async def run_probe(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    code = await _cli_probe._probe(parse(["probe", *argv]), out, out)
    return code, out.getvalue()


@pytest.fixture
async def widgets(kubelet: FakeKubelet) -> AsyncIterator[tuple[Widgets, Path]]:
    plugin = Widgets()
    async with serving(plugin, settings=kubelet.settings()):
        await kubelet.wait_for_allocatable(RESOURCE, 4)
        yield plugin, kubelet.directory / SOCKET


# ------------------------------------------------------------------------------------------ output


async def test_probe_prints_options_and_the_first_list_with_health_and_numa(
    widgets: tuple[Widgets, Path],
) -> None:
    _, path = widgets
    code, text = await run_probe("--socket", str(path))
    lines = text.splitlines()
    assert code == 0
    assert lines[0] == f"socket      {path}"
    assert lines[2].startswith(
        "options     pre_start_required=false get_preferred_allocation_available=true"
    )
    assert lines[3].startswith("devices     capacity 4, allocatable 4 (first list after ")
    assert lines[4:] == [
        "  ID  HEALTH     NUMA",
        "  w0  Healthy    0",
        "  w1  Healthy    0",
        "  w2  Healthy    1",
        "  w3  Healthy    1",
    ]


async def test_allocate_count_asks_the_preferred_choice_and_shows_the_container_response(
    widgets: tuple[Widgets, Path],
) -> None:
    _, path = widgets
    code, text = await run_probe("--socket", str(path), "--allocate", "2", "--json")
    report = json.loads(text)
    assert code == 0
    allocation = report["allocation"]
    assert allocation["preferred"] == ["w3", "w2"]
    assert allocation["device_ids"] == ["w3", "w2"]
    assert allocation["response"] == {
        "devices": [
            {
                "container_path": f"/dev/widget{i}",
                "host_path": f"/dev/widget{i}",
                "permissions": "rw",
            }
            for i in (3, 2)
        ],
        "mounts": [
            {"container_path": "/usr/lib/widget", "host_path": "/opt/widget/lib", "read_only": True}
        ],
        "envs": {"WIDGET_VISIBLE": "w2"},
        "annotations": {"acme.com/widget": "w2"},
        "cdi_devices": ["acme.com/widget=w3", "acme.com/widget=w2"],
    }


async def test_allocate_explicit_ids_prints_every_part_of_the_response(
    widgets: tuple[Widgets, Path],
) -> None:
    _, path = widgets
    code, text = await run_probe("--socket", str(path), "--allocate", "w0,w1")
    assert code == 0
    assert "allocate    w0,w1\n  allocated   w0,w1\n" in text
    assert "  preferred" not in text
    assert "  device      /dev/widget0 -> /dev/widget0 (rw)" in text
    assert "  mount       /opt/widget/lib -> /usr/lib/widget (ro)" in text
    assert "  env         WIDGET_VISIBLE=w1" in text
    assert "  annotation  acme.com/widget=w1" in text
    assert "  cdi         acme.com/widget=w0" in text


async def test_allocate_of_an_unknown_id_shows_the_plugins_error(
    widgets: tuple[Widgets, Path],
) -> None:
    _, path = widgets
    code, text = await run_probe("--socket", str(path), "--allocate", "nope,")
    assert code == 1
    assert (
        "error: Allocate failed: INVALID_ARGUMENT: acme.com/widget: unknown device IDs: nope"
        in text
    )


async def test_allocate_more_than_healthy_gives_the_kubelets_reason(
    widgets: tuple[Widgets, Path],
) -> None:
    _, path = widgets
    code, text = await run_probe("--socket", str(path), "--allocate", "5", "--json")
    assert code == 1
    assert json.loads(text)["error"] == {
        "kind": "protocol-violation",
        "message": "requested number of devices unavailable. Requested: 5, Available: 4",
    }


@pytest.mark.parametrize(
    ("text", "parsed"),
    [("2", 2), ("w0,w1", ("w0", "w1")), ("3,", ("3",)), ("gpu-0", ("gpu-0",))],
)
def test_allocate_argument_is_a_count_or_ids(text: str, parsed: Any) -> None:
    assert _cli_probe.parse_allocate(text) == parsed


@pytest.mark.parametrize("text", ["0", ",", ""])
def test_allocate_argument_rejects_nothing_to_allocate(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        _cli_probe.parse_allocate(text)


async def test_watch_prints_each_change_with_a_timestamp(widgets: tuple[Widgets, Path]) -> None:
    plugin, path = widgets
    out = Output()
    async with anyio.create_task_group() as tg:
        tg.start_soon(_cli_probe._probe, parse(["probe", "--socket", str(path), "--watch"]), out)
        await out.wait_for("^watching ListAndWatch")
        plugin.break_w1.set()
        match = await out.wait_for(r"^(\d\d:\d\d:\d\d\.\d{3})  (.*)$")
        tg.cancel_scope.cancel()
    assert match.group(2) == "capacity 4, allocatable 3: w1 Healthy -> Unhealthy"


async def test_watch_json_is_one_line_per_change(widgets: tuple[Widgets, Path]) -> None:
    plugin, path = widgets
    out = Output()
    args = parse(["probe", "--socket", str(path), "--watch", "--json"])
    async with anyio.create_task_group() as tg:
        tg.start_soon(_cli_probe._probe, args, out)
        await out.wait_for(r"^\{.*\}\n")
        plugin.break_w1.set()
        await out.wait_for(r"\n\{.*\}\n")
        tg.cancel_scope.cancel()
    first, change = (json.loads(line) for line in out.getvalue().splitlines())
    assert first["allocatable"] == 4
    assert change["allocatable"] == 3
    assert change["changes"] == [
        {
            "id": "w1",
            "before": {"id": "w1", "health": "Healthy", "numa_nodes": [0]},
            "after": {"id": "w1", "health": "Unhealthy", "numa_nodes": [0]},
        }
    ]
    assert re.match(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}", change["time"])


async def test_watch_exits_one_when_the_plugin_ends_the_stream(short_dir: Path) -> None:
    async with serving_raw(short_dir / "raw.sock", "ends-stream"):
        code, text = await run_probe("--socket", str(short_dir / "raw.sock"), "--watch")
    assert code == 1
    assert text.splitlines()[-1].startswith(
        "devplugin: error: the plugin ended the ListAndWatch stream"
    )


# ------------------------------------------------------------------------------------------ errors


async def test_missing_socket_is_reported_as_missing(short_dir: Path) -> None:
    code, text = await run_probe("--socket", str(short_dir / "gone.sock"), "--json")
    assert code == 1
    error = json.loads(text)["error"]
    assert error["kind"] == "socket-missing"
    assert error["message"].startswith(f"no socket at {short_dir / 'gone.sock'}")
    with pytest.raises(SocketMissingError):
        await PluginClient.connect(short_dir / "gone.sock")


async def test_stale_socket_nobody_answers_is_refused_at_once(short_dir: Path) -> None:
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(short_dir / "stale.sock"))  # bound, never listening
    stale.close()
    with pytest.raises(NotAnsweringError, match="connection refused"):
        await PluginClient.connect(short_dir / "stale.sock")


async def test_hung_server_is_reported_after_the_dial_timeout(short_dir: Path) -> None:
    async with anyio.create_task_group() as tg:
        await tg.start(serve_silent, short_dir / "hung.sock")
        code, text = await run_probe("--socket", str(short_dir / "hung.sock"), "--timeout", "0.3")
        tg.cancel_scope.cancel()
    assert code == 1
    assert "no gRPC server answered within 0.3 s" in text


async def test_grpc_server_without_the_device_plugin_service_is_not_a_device_plugin(
    short_dir: Path,
) -> None:
    server = grpc.aio.server()
    server.add_insecure_port(f"unix:{short_dir / 'other.sock'}")
    await server.start()
    try:
        code, text = await run_probe("--socket", str(short_dir / "other.sock"), "--json")
    finally:
        await server.stop(0)
    assert code == 1
    error = json.loads(text)["error"]
    assert error["kind"] == "not-a-device-plugin"
    assert "GetDevicePluginOptions is UNIMPLEMENTED" in error["message"]


async def test_kubelet_sock_is_named_as_the_registration_server(kubelet: FakeKubelet) -> None:
    client = await PluginClient.connect(kubelet.socket_path)
    async with client:
        with pytest.raises(NotADevicePluginError, match="kubelet's Registration server"):
            await client.options()


async def test_socket_that_does_not_speak_grpc_is_not_a_device_plugin(short_dir: Path) -> None:
    async with anyio.create_task_group() as tg:
        await tg.start(serve_not_grpc, short_dir / "http.sock")
        with pytest.raises(NotADevicePluginError, match=r"does not speak gRPC \(HTTP/2\)"):
            await PluginClient.connect(short_dir / "http.sock")
        tg.cancel_scope.cancel()


async def test_regular_file_is_not_a_socket(short_dir: Path) -> None:
    (short_dir / "file.sock").write_text("")
    with pytest.raises(NotADevicePluginError, match="is not a unix socket"):
        await PluginClient.connect(short_dir / "file.sock")


async def test_list_over_the_kubelets_limit_is_the_kubelets_error(short_dir: Path) -> None:
    async with serving_raw(short_dir / "raw.sock", "oversized-list"):
        client = await PluginClient.connect(short_dir / "raw.sock")
        async with client:
            with pytest.raises(ProtocolViolation, match="over the kubelet's 4194304 byte"):
                await probe(client)


async def test_plugin_that_never_lists_is_reported_after_the_timeout(short_dir: Path) -> None:
    async with serving_raw(short_dir / "raw.sock", "no-initial-list"):
        code, text = await run_probe("--socket", str(short_dir / "raw.sock"), "--timeout", "0.3")
    assert code == 1
    assert "error: no ListAndWatch message within 0.3 s" in text


async def test_probe_command_exits_one_with_a_message_for_a_missing_socket(
    short_dir: Path,
) -> None:
    script = (
        "import argparse, sys; from devplugin_sdk.kubelet import _cli_probe; "
        "p = argparse.ArgumentParser(); _cli_probe.register(p.add_subparsers()); "
        "a = p.parse_args(sys.argv[1:]); sys.exit(a.func(a))"
    )
    result = await anyio.run_process(
        [sys.executable, "-c", script, "probe", "--socket", str(short_dir / "gone.sock")],
        check=False,
    )
    assert result.returncode == 1
    assert result.stdout.decode() == ""
    assert result.stderr.decode().startswith(
        f"devplugin: error: no socket at {short_dir / 'gone.sock'}"
    )


async def test_a_timed_out_dial_leaves_no_grpc_watch_behind(short_dir: Path) -> None:
    """The connectivity watch pending at the timeout finishes before the dial returns.

    A watch left in gRPC core completes later, maybe on a closed event loop, and fails whatever
    runs on the next one ("Event loop is closed").
    """
    async with anyio.create_task_group() as tg:
        await tg.start(serve_silent, short_dir / "hung.sock")
        channel = grpc.aio.insecure_channel(f"unix:{short_dir / 'hung.sock'}")
        assert not await _client.ready(channel, 0.2)
        tg.cancel_scope.cancel()
    watches = [t for t in asyncio.all_tasks() if "wait_for_state_change" in repr(t.get_coro())]
    assert watches == []
