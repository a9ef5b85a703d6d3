"""The one runner: ``serve`` (readiness, errors, options) and what it reads its status from."""

from __future__ import annotations

import errno
import gc
import socket
import sys
import warnings
from collections.abc import Sequence
from functools import partial
from typing import Any

import anyio
import pytest
from prometheus_client import CollectorRegistry
from sdk_helpers import RESOURCE, widgets

from devplugin_sdk import Device, DevicePlugin, serve
from devplugin_sdk._engine.events import Events
from devplugin_sdk._engine.hooks import run_hook
from devplugin_sdk._engine.servicer import DevicePluginServicer
from devplugin_sdk._engine.state import DeviceState
from devplugin_sdk._engine.streams import Streams
from devplugin_sdk.runner import Http, Running
from devplugin_sdk.testing import FakeKubelet, StaticPlugin, serving

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import ExceptionGroup


class _Failing(StaticPlugin):
    def __init__(self, resource: str, error: Exception) -> None:
        super().__init__(resource, [])
        self.error = error

    async def discover(self) -> Sequence[Device]:
        raise self.error


async def test_started_reports_the_running_set_once_every_plugin_has_discovered(
    kubelet: FakeKubelet,
) -> None:
    plugins = StaticPlugin(RESOURCE, widgets(2)), StaticPlugin("acme.com/b", widgets(1))
    async with anyio.create_task_group() as tg:
        running = await tg.start(partial(serve, *plugins, settings=kubelet.settings()))
        assert isinstance(running, Running)
        assert running.resources == [RESOURCE, "acme.com/b"]
        assert running.http_port is None
        # Discovered already: the status counts the devices before any kubelet involvement.
        assert {s.resource: s.devices for s in running.statuses()} == {
            RESOURCE: {"Healthy": 2},
            "acme.com/b": {"Healthy": 1},
        }
        await kubelet.wait_for_allocatable(RESOURCE, 2)
        tg.cancel_scope.cancel()


async def test_a_discovery_error_at_start_is_raised_by_start(kubelet: FakeKubelet) -> None:
    async with anyio.create_task_group() as tg:
        failing = _Failing(RESOURCE, OSError("no sysfs"))
        with pytest.raises(OSError, match="no sysfs"):
            await tg.start(partial(serve, failing, settings=kubelet.settings()))
    assert not (kubelet.directory / "acme.com_widget.sock").exists()


async def test_every_error_of_several_failing_plugins_is_raised(kubelet: FakeKubelet) -> None:
    """Two plugins fail at start in two ways: both errors come out, none is dropped."""
    plugins = (
        _Failing(RESOURCE, TypeError("bad type in plugin a")),
        _Failing("acme.com/b", ValueError("bad value in plugin b")),
    )
    with pytest.raises(ExceptionGroup) as caught:
        async with serving(*plugins, settings=kubelet.settings()):
            pass
    messages = sorted(str(e) for e in caught.value.exceptions)
    assert messages == ["bad type in plugin a", "bad value in plugin b"]


async def test_serve_needs_a_plugin() -> None:
    with pytest.raises(ValueError, match="at least one plugin"):
        await serve()


async def test_a_taken_http_port_fails_before_any_plugin_starts(kubelet: FakeKubelet) -> None:
    discovered = anyio.Event()

    class Watched(StaticPlugin):
        async def discover(self) -> Sequence[Device]:
            discovered.set()
            return await super().discover()

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        http = Http(port=port, host="127.0.0.1", registry=CollectorRegistry())
        with pytest.raises(OSError) as refused:  # noqa: PT011 - its errno, not its words
            async with serving(
                Watched(RESOURCE, widgets(1)), settings=kubelet.settings(), http=http
            ):
                pass
    assert refused.value.errno == errno.EADDRINUSE
    assert not discovered.is_set()
    assert not (kubelet.directory / "acme.com_widget.sock").exists()
    # The floor's anyio (4.7) leaves the socket of a failed bind unclosed (the locked release
    # closes it), held by the error's frames: collect it here, not in whichever later test the
    # garbage collector runs in.
    del refused
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        gc.collect()


@pytest.mark.parametrize(
    ("fields", "error"),
    [
        ({"port": 70000}, ValueError),
        ({"port": -1}, ValueError),
        ({"port": True}, TypeError),
        ({"port": 0, "stuck_after": 0}, ValueError),
    ],
)
def test_http_options_are_checked_at_construction(fields: dict[str, Any], error: type) -> None:
    with pytest.raises(error):
        Http(**fields)


async def test_two_runners_in_one_process_each_report_their_own_plugins(
    kubelet: FakeKubelet,
) -> None:
    """Status and metrics read the runner they belong to, not a process-wide registry."""
    first = StaticPlugin(RESOURCE, widgets(2))
    second = StaticPlugin("acme.com/b", widgets(1))
    settings = kubelet.settings()
    http_a = Http(port=0, host="127.0.0.1", registry=CollectorRegistry())
    http_b = Http(port=0, host="127.0.0.1", registry=CollectorRegistry())
    async with (
        serving(first, settings=settings, http=http_a) as a,
        serving(second, settings=settings, http=http_b) as b,
    ):
        await kubelet.wait_for_allocatable(RESOURCE, 2)
        await kubelet.wait_for_allocatable("acme.com/b", 1)
        assert [s.resource for s in a.statuses()] == [RESOURCE]
        assert [s.resource for s in b.statuses()] == ["acme.com/b"]
        assert http_a.registry.get_sample_value("devplugin_registered", {"resource": RESOURCE}) == 1
        assert (
            http_a.registry.get_sample_value("devplugin_registered", {"resource": "acme.com/b"})
            is None
        )
        assert (
            http_b.registry.get_sample_value("devplugin_registered", {"resource": "acme.com/b"})
            == 1
        )


class _FakeServer:
    """Records the grace the servicer gives ``grpc.aio.Server.stop``."""

    grace: float | None = None

    async def stop(self, grace: float) -> None:
        self.grace = grace


async def test_stopping_with_a_call_in_flight_takes_one_grace_not_two() -> None:
    """In-flight calls get ``stop_grace``; the server's own stop gets only what is left of it."""
    plugin: DevicePlugin = StaticPlugin(RESOURCE, widgets(1))
    state = DeviceState(RESOURCE)
    servicer = DevicePluginServicer(
        plugin,
        state,
        Streams(RESOURCE, lambda: None),
        Events(None),
        hook_timeout=8,
        prestart_timeout=20,
    )
    never = anyio.Event()

    async def hang() -> None:
        await never.wait()

    server = _FakeServer()
    serving = servicer.serving()
    async with anyio.create_task_group() as tg:
        tg.start_soon(run_hook, hang(), 8.0, RESOURCE, "allocate", serving)  # suspended in a call
        await anyio.wait_all_tasks_blocked()
        started = anyio.current_time()
        await servicer.stop(server, serving, 0.2)  # type: ignore[arg-type]
        elapsed = anyio.current_time() - started
        tg.cancel_scope.cancel()
    assert server.grace is not None
    assert server.grace < 0.05  # what was left of the 0.2 s after waiting for the call
    assert elapsed >= 0.2
    assert serving.ended  # its streams end; the next server's are not this one's


async def test_on_stop_runs_after_a_failed_first_discovery(kubelet: FakeKubelet) -> None:
    """What a backend opened before discovery failed (an NVML handle) is released."""
    stopped: list[str] = []

    class Opened(_Failing):
        async def on_stop(self) -> None:
            stopped.append(self.resource_name)

    async with anyio.create_task_group() as tg:
        with pytest.raises(OSError, match="no sysfs"):
            await tg.start(
                partial(serve, Opened(RESOURCE, OSError("no sysfs")), settings=kubelet.settings())
            )
    assert stopped == [RESOURCE]
