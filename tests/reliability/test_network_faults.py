"""Network and registration faults against a real plugin process (issue 12, rows 4, 6, 7, 10-12).

Each test runs ``_net_plugin_main.py`` (the one runner, with its HTTP endpoints) as a real
process against a FakeKubelet in the test process, applies one fault as someone with access to
the node would (idle connections, an extra ListAndWatch client, a client that never reads, forged
device IDs, a permissive umask, half-open connections), checks that the plugin keeps serving and
prints what it measured: ``pytest -s`` shows the figures that docs/reliability.md reports.
"""

from __future__ import annotations

import errno
import os
import signal
import socket
import stat
import sys
import time
from pathlib import Path

import anyio
import anyio.to_thread
import grpc
import pytest
from anyio.abc import SocketStream
from plugin_process import spawned
from reliability._net_harness import (
    RESOURCE,
    SOCKET,
    FdPeak,
    http_get,
    plugin_process,
)

from devplugin_sdk.api.deviceplugin.v1beta1 import deviceplugin_pb2 as pb
from devplugin_sdk.api.deviceplugin.v1beta1 import deviceplugin_pb2_grpc as pb_grpc
from devplugin_sdk.testing import FakeKubelet

# Each test starts a Python process (about 1 s on 2 cores) and some wait out the plugin's
# idle-connection timeout (5 s) on purpose: more than the suite's 20 s default.
pytestmark = pytest.mark.timeout(60)


def figure(row: int, text: str) -> None:
    """Print one measured figure for docs/reliability.md."""
    print(f"\n[issue 12 row {row}] {text}")


async def healthz_until(port: int, wanted: int, timeout: float = 10.0) -> tuple[int, str]:
    """Probe ``/healthz`` as the kubelet does (fresh connection, 1 s timeout) until it answers
    ``wanted``; return that answer."""
    with anyio.fail_after(timeout):
        while True:
            reply = await http_get(port, "/healthz")
            if reply is not None and reply[0] == wanted:
                return reply
            await anyio.sleep(0.05)  # the probe's period, scaled down


def count(lines: list[str], text: str) -> int:
    return sum(text in line for line in lines)


# ------------------------------------------------------------------------- row 4: HTTP at the fd limit


async def test_idle_http_connections_past_the_fd_limit_never_stop_the_plugin() -> None:
    nofile, connections = 1024, 1100  # the figures
    async with (
        FakeKubelet() as kubelet,
        plugin_process("--dir", str(kubelet.directory), "--nofile", str(nofile)) as plugin,
    ):
        await kubelet.wait_for_allocatable(RESOURCE, 4, timeout=20)
        peak = FdPeak(plugin.pid)
        idle: list[SocketStream] = []
        probes: list[float | None] = []
        async with anyio.create_task_group() as tg:
            tg.start_soon(peak.run)
            try:
                for _ in range(connections):
                    idle.append(await anyio.connect_tcp("127.0.0.1", plugin.http_port))
                # Every probe comes while the idle connections are held open.
                for _ in range(10):
                    started = time.perf_counter()
                    reply = await http_get(plugin.http_port, "/healthz", timeout=1.0)
                    ok = reply is not None and reply[0] == 200
                    probes.append(time.perf_counter() - started if ok else None)
                allocated = await kubelet.allocate(RESOURCE, 1)
            finally:
                for stream in idle:
                    await stream.aclose()
                tg.cancel_scope.cancel()
        assert plugin.process.returncode is None, plugin.error_output
        crowded = count(plugin.stderr, "connections open, the limit")
        assert await plugin.stop() == 0
    assert not (kubelet.directory / SOCKET).exists()  # removed by a clean stop
    answered = [p for p in probes if p is not None]
    assert len(answered) == len(probes), probes
    assert allocated.device_ids
    assert peak.peak < nofile
    figure(
        4,
        f"{connections} idle HTTP connections, fd limit {nofile}: plugin kept running, "
        f"{len(answered)}/{len(probes)} /healthz probes answered 200 (slowest "
        f"{max(answered) * 1e3:.1f} ms), Allocate answered, peak {peak.peak} fds, "
        f"{crowded} connection-cap log line(s)",
    )


async def test_http_accept_errors_at_the_fd_limit_are_logged_and_retried() -> None:
    async with (
        FakeKubelet() as kubelet,
        plugin_process("--dir", str(kubelet.directory), "--hog-for", "3") as plugin,
    ):
        await kubelet.wait_for_allocatable(RESOURCE, 4, timeout=20)
        plugin.signal(signal.SIGUSR2)  # every free descriptor taken, as by a leaking backend
        await plugin.wait_for_line("hogging", stream="stdout")
        starved = [await http_get(plugin.http_port, "/healthz") for _ in range(3)]
        await plugin.wait_for_line("released fds", stream="stdout")
        released = time.perf_counter()
        await healthz_until(plugin.http_port, 200)
        back = time.perf_counter() - released
        assert plugin.process.returncode is None, plugin.error_output
        accept_errors = [line for line in plugin.stderr if "accepting a connection failed" in line]
        assert await plugin.stop() == 0
    assert starved == [None, None, None]  # nothing could be accepted
    assert 1 <= len(accept_errors) <= 2, accept_errors  # one line per 10 s at most
    assert os.strerror(errno.EMFILE) in accept_errors[0]  # the errno's text, as logged
    figure(
        4,
        f"HTTP accept() failing with EMFILE for 3 s (every descriptor taken): plugin kept "
        f"running, {len(accept_errors)} log line(s), /healthz 200 again {back * 1e3:.0f} ms "
        f"after descriptors were freed",
    )


# ------------------------------------------------------- rows 6 and 7: the kubelet's stream only


async def test_a_lost_kubelet_stream_is_replaced_while_devplugin_probe_watch_is_connected() -> None:
    async with (
        FakeKubelet() as kubelet,
        plugin_process("--dir", str(kubelet.directory)) as plugin,
    ):
        await kubelet.wait_for_allocatable(RESOURCE, 4, timeout=20)
        socket_path = str(kubelet.directory / SOCKET)
        async with spawned(
            [sys.executable, "-m", "devplugin_sdk", "probe", "--socket", socket_path, "--watch"]
        ):
            # The probe opens a stream for its report, ends it, then opens the one it watches:
            # the second is the extra client that stays.
            await plugin.wait_for("a client's ListAndWatch stream opened", count=2)
            assert (await plugin.status())["plugins"][0]["streams"] == 2
            assert (await http_get(plugin.http_port, "/healthz")) == (200, "ok\n")

            dropped = time.perf_counter()
            assert await kubelet.drop_streams(RESOURCE) == 1  # the kubelet's own stream only
            await plugin.wait_for_line("the kubelet's ListAndWatch stream ended")
            during = await http_get(plugin.http_port, "/healthz")
            await plugin.wait_for_line("no ListAndWatch stream from the kubelet")
            noticed = time.perf_counter() - dropped
            await kubelet.wait_for_registrations(RESOURCE, 2, timeout=10)
            await kubelet.wait_for_allocatable(RESOURCE, 4)
            recovered = time.perf_counter() - dropped
            await healthz_until(plugin.http_port, 200)
            live_again = time.perf_counter() - dropped
    assert during is not None
    assert during[0] == 503
    assert "no ListAndWatch stream from the kubelet; 1 from other clients" in during[1]
    figure(
        6,
        f"kubelet's stream dropped with devplugin probe --watch connected: /healthz 503 at once, "
        f"loss acted on after {noticed:.2f} s (stream_lost_grace 1 s), allocatable back after "
        f"{recovered:.2f} s, /healthz 200 after {live_again:.2f} s",
    )


async def test_a_client_that_never_reads_while_devices_flap_leaves_healthz_live() -> None:
    stuck_after = 1.0
    async with (
        FakeKubelet() as kubelet,
        plugin_process(
            "--dir",
            str(kubelet.directory),
            "--count",
            "300",
            "--id-width",
            "60",
            "--stuck-after",
            str(stuck_after),
            "--flap",
            "0.02",
            "--flap-for",
            "3",
        ) as plugin,
    ):
        await kubelet.wait_for_allocatable(RESOURCE, 300, timeout=20)
        # No BDP probing: the window stays at HTTP/2's 64 KiB, a few lists of ~22 KB.
        options = [("grpc.http2.bdp_probe", 0)]
        socket_path = kubelet.directory / SOCKET
        async with grpc.aio.insecure_channel(f"unix:{socket_path}", options=options) as channel:
            call = pb_grpc.DevicePluginStub(channel).ListAndWatch(pb.Empty())  # never read
            await call.initial_metadata()
            await plugin.wait_for_line("a client's ListAndWatch stream opened")
            before = kubelet.messages(RESOURCE)
            plugin.signal(signal.SIGUSR1)
            answers: list[int | None] = []
            with anyio.fail_after(15):
                while not any("flapping ended" in line for line in plugin.stdout):
                    reply = await http_get(plugin.http_port, "/healthz")
                    answers.append(None if reply is None else reply[0])
                    await anyio.sleep(0.1)  # the probe's period, scaled down
            await kubelet.wait_for_health(RESOURCE, "d0".ljust(60, "x"), "Healthy")
            lists = kubelet.messages(RESOURCE) - before
            status = (await plugin.status())["plugins"][0]
            call.cancel()
    assert answers
    assert all(a == 200 for a in answers), answers
    assert status["registered"]
    assert status["pending_seconds"] == 0
    assert status["streams"] == 2
    figure(
        7,
        f"a ListAndWatch client that never reads, d0 flapping every 20 ms for 3 s: the kubelet "
        f"got {lists} lists of ~22 KB ({lists * 22 / 1024:.1f} MB; the idle client's window is "
        f"64 KiB), /healthz {len(answers)}/{len(answers)} answers 200 with stuck_after "
        f"{stuck_after:g} s",
    )


# ------------------------------------------------------------------- row 10: control characters


async def test_device_ids_with_control_characters_cannot_forge_log_lines() -> None:
    forged = "2031-01-01 00:00:00,000 ERROR   devplugin_sdk: FORGED"
    ids = [f"d0\n{forged}", "d1\r\x1b[2J\u2028tail"]
    async with (
        FakeKubelet() as kubelet,
        plugin_process("--dir", str(kubelet.directory)) as plugin,
    ):
        await kubelet.wait_for_allocatable(RESOURCE, 4, timeout=20)
        socket_path = kubelet.directory / SOCKET
        async with grpc.aio.insecure_channel(f"unix:{socket_path}") as channel:
            stub = pb_grpc.DevicePluginStub(channel)
            request = pb.AllocateRequest(
                container_requests=[pb.ContainerAllocateRequest(devices_ids=ids)]
            )
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Allocate(request)
            prefer = pb.PreferredAllocationRequest(
                container_requests=[
                    pb.ContainerPreferredAllocationRequest(
                        available_deviceIDs=["d2", *ids], allocation_size=1
                    )
                ]
            )
            preferred = await stub.GetPreferredAllocation(prefer)
        allocate_line = await plugin.wait_for_line("Allocate refused")
        prefer_line = await plugin.wait_for_line("GetPreferredAllocation named")
        assert await plugin.stop() == 0
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "\n" not in (refused.value.details() or "")
    assert list(preferred.container_responses[0].deviceIDs) == ["d2"]
    output = "\n".join(plugin.stderr)
    assert not any(line.startswith("2031-01-01") for line in plugin.stderr)  # no forged line
    assert all(f"d0\\n{forged}" in line for line in plugin.stderr if "FORGED" in line)
    for raw in ("\x1b", "\r", "\u2028"):
        assert raw not in output
    for line in (allocate_line, prefer_line):
        assert f"d0\\n{forged}" in line
        assert "d1\\r\\x1b[2J\\u2028tail" in line
    figure(
        10,
        "Allocate and GetPreferredAllocation with IDs holding \\n, \\r, ESC and U+2028: "
        f"INVALID_ARGUMENT / a valid preference; {len(plugin.stderr)} log lines, none forged, "
        "each request on one line with the characters escaped",
    )


# ------------------------------------------------------------------------ row 11: socket mode


@pytest.mark.parametrize("registration", ["kubelet", "watcher"])
async def test_the_socket_is_0600_under_umask_000(registration: str) -> None:
    async with FakeKubelet(plugin_watcher=registration == "watcher") as kubelet:
        args = ["--dir", str(kubelet.directory), "--umask", "000"]
        directory = kubelet.directory
        if registration == "watcher":
            args += ["--registry-dir", str(kubelet.registry_directory)]
            directory = kubelet.registry_directory
        async with plugin_process(*args) as plugin:
            await kubelet.wait_for_allocatable(RESOURCE, 4, timeout=20)
            mode = stat.S_IMODE((directory / SOCKET).stat().st_mode)
            umask = plugin.umask()
    assert umask == "0000"
    assert mode == 0o600, oct(mode)
    figure(11, f"{registration} path, plugin under umask {umask}: socket mode {mode:04o}")


# ------------------------------------------------------------- row 12: half-open connections


def _half_open(path: Path, count: int) -> list[socket.socket]:
    """Up to ``count`` connections to ``path`` that never send a byte (blocking connects: run
    it in a worker thread)."""
    opened = []
    for _ in range(count):
        client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        client.settimeout(2.0)
        try:
            client.connect(str(path))
        except OSError:
            client.close()  # the backlog stayed full for 2 s: one fewer
            continue
        client.setblocking(False)
        opened.append(client)
    return opened


async def _all_closed_by_the_plugin(clients: list[socket.socket]) -> None:
    """Wait until the plugin has closed every connection (each reads EOF or a reset)."""
    for client in clients:
        while True:
            await anyio.wait_readable(client)
            try:
                if client.recv(4096) == b"":
                    break
            except BlockingIOError:
                continue
            except OSError:
                break


async def _fresh_client_answered(path: Path) -> float:
    """Seconds until a new connection gets GetDevicePluginOptions answered, retried as the
    kubelet's dial retries (each attempt bounded)."""
    started = time.perf_counter()
    while True:
        async with grpc.aio.insecure_channel(f"unix:{path}") as channel:
            try:
                await pb_grpc.DevicePluginStub(channel).GetDevicePluginOptions(
                    pb.Empty(), timeout=1.0
                )
                return time.perf_counter() - started
            except grpc.aio.AioRpcError:
                pass
        await anyio.sleep(0.1)  # the kubelet's dial backoff, scaled down


async def test_half_open_connections_on_the_plugin_socket_are_closed_and_new_ones_get_in() -> None:
    flood = 500
    async with (
        FakeKubelet() as kubelet,
        plugin_process("--dir", str(kubelet.directory), "--nofile", "256") as plugin,
    ):
        await kubelet.wait_for_allocatable(RESOURCE, 4, timeout=20)
        path = kubelet.directory / SOCKET
        peak = FdPeak(plugin.pid)
        clients = await anyio.to_thread.run_sync(_half_open, path, flood)
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(peak.run)
                started = time.perf_counter()
                allocated = await kubelet.allocate(RESOURCE, 1)  # the kubelet's connection
                with anyio.fail_after(20):
                    fresh = await _fresh_client_answered(path)
                with anyio.fail_after(20):
                    await _all_closed_by_the_plugin(clients)
                all_closed = time.perf_counter() - started
                tg.cancel_scope.cancel()
        finally:
            for client in clients:
                client.close()
        assert plugin.process.returncode is None, plugin.error_output
        # The kubelet's connection, its stream open, outlived the 5 s idle timeout untouched.
        assert kubelet.ended_streams(RESOURCE) == 0
        assert len(kubelet.successful_registrations(RESOURCE)) == 1
        after_flood = await kubelet.allocate(RESOURCE, 1)
    assert allocated.device_ids
    assert after_flood.device_ids
    assert peak.peak < 256
    figure(
        12,
        f"{len(clients)} half-open connections on the plugin socket, fd limit 256: the kubelet's "
        f"connection kept working, a new connection answered after {fresh:.2f} s, every "
        f"half-open one closed by the plugin after {all_closed:.2f} s, peak {peak.peak} fds",
    )


async def test_a_restarting_kubelet_gets_in_through_a_flood_of_half_open_connections() -> None:
    """The plugin-watcher path keeps its socket across a kubelet restart: the kubelet dials it
    again while the flood holds connections."""
    async with FakeKubelet(plugin_watcher=True) as kubelet:
        args = ["--dir", str(kubelet.directory), "--registry-dir", str(kubelet.registry_directory)]
        async with plugin_process(*args, "--nofile", "256") as plugin:
            await kubelet.wait_for_allocatable(RESOURCE, 4, timeout=20)
            flood = kubelet.registry_directory / SOCKET
            clients = await anyio.to_thread.run_sync(_half_open, flood, 500)
            try:
                started = time.perf_counter()
                await kubelet.restart()
                await kubelet.wait_for_registrations(RESOURCE, 2, timeout=20)
                await kubelet.wait_for_allocatable(RESOURCE, 4)
                back = time.perf_counter() - started
            finally:
                for client in clients:
                    client.close()
            assert plugin.process.returncode is None, plugin.error_output
    figure(
        12,
        f"plugin-watcher path, kubelet restarted during a flood of {len(clients)} half-open connections "
        f"(fd limit 256): registered and allocatable again after {back:.2f} s",
    )
