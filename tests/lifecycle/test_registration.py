"""Registration: served before Register, accepted, rejected for good, kubelet absent or slow."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import anyio
import anyio.lowlevel
import pytest
from sdk_helpers import RESOURCE, widgets

from devplugin_sdk import Device, DevicePlugin, RegistrationRejectedError
from devplugin_sdk.testing import FakeKubelet, StaticPlugin, serving


async def test_registers_and_advertises_every_device(kubelet: FakeKubelet) -> None:
    """A plugin registers with v1beta1 and its bare socket name; the kubelet sees its devices."""
    plugin = StaticPlugin(RESOURCE, widgets(4))
    async with serving(plugin, settings=kubelet.settings()):
        await kubelet.wait_for_allocatable(RESOURCE, 4)
        (registration,) = kubelet.successful_registrations(RESOURCE)
        assert registration.version == "v1beta1"
        assert registration.endpoint == "acme.com_widget.sock"
        assert (registration.pre_start_required, registration.preferred_allocation) == (
            False,
            False,
        )
        assert kubelet.capacity(RESOURCE) == 4
        assert set(kubelet.devices(RESOURCE)) == {"w0", "w1", "w2", "w3"}


async def test_options_follow_the_overridden_hooks(kubelet: FakeKubelet) -> None:
    """Overriding preferred_allocation and pre_start_container turns both options on."""

    class Hooked(StaticPlugin):
        async def preferred_allocation(
            self, available: Sequence[Device], must_include: Sequence[Device], size: int
        ) -> Sequence[str]:
            return [d.id for d in available][:size]

        async def pre_start_container(self, devices: Sequence[Device]) -> None:
            return None

    async with serving(Hooked(RESOURCE, widgets(2)), settings=kubelet.settings()):
        await kubelet.wait_for_allocatable(RESOURCE, 2)
        (registration,) = kubelet.successful_registrations(RESOURCE)
        assert (registration.pre_start_required, registration.preferred_allocation) == (True, True)


async def test_waits_for_an_absent_kubelet_then_registers(short_dir: Path) -> None:
    """With no kubelet.sock at start the plugin waits, and registers as soon as it appears."""
    kubelet = FakeKubelet(short_dir)
    plugin = StaticPlugin(RESOURCE, widgets(2))
    async with serving(plugin, settings=kubelet.settings()):
        await anyio.lowlevel.checkpoint()  # the plugin is now waiting for kubelet.sock
        assert not kubelet.socket_path.exists()
        async with kubelet:
            await kubelet.wait_for_allocatable(RESOURCE, 2)
            assert len(kubelet.successful_registrations(RESOURCE)) == 1


async def test_a_slow_kubelet_still_registers() -> None:
    """Register waits while the kubelet takes its time (the deadline is at least 15 s)."""
    kubelet = FakeKubelet(register_delay=0.5)
    async with kubelet, serving(StaticPlugin(RESOURCE, widgets(1)), settings=kubelet.settings()):
        await kubelet.wait_for_allocatable(RESOURCE, 1)
        assert len(kubelet.registrations) == 1


class _Registered:
    """An observer that counts the plugin's successful registrations as it sees them."""

    def __init__(self) -> None:
        self.count = 0
        self._changed = anyio.Event()

    def registered(self, resource: str, seconds: float) -> None:
        self.count += 1
        self._changed.set()
        self._changed = anyio.Event()

    async def wait_for(self, count: int, timeout: float = 5.0) -> None:
        with anyio.fail_after(timeout):
            while self.count < count:
                await self._changed.wait()


async def test_register_past_its_deadline_waits_for_the_kubelet_instead_of_duplicating() -> None:
    """A Register that times out may still complete on the kubelet: no second registration."""
    # The kubelet completes about 0.2 s after the client's deadline; the plugin waits one more
    # register_timeout (0.5 s) for a ListAndWatch stream before it would retry.
    registered = _Registered()
    async with FakeKubelet(register_delay=0.7) as kubelet:
        settings = kubelet.settings(register_timeout=0.5)
        plugin = StaticPlugin(RESOURCE, widgets(1))
        async with serving(plugin, settings=settings, observer=registered):
            await kubelet.wait_for_allocatable(RESOURCE, 1)
            # The plugin has taken the timed-out attempt for a success: it will not retry.
            await registered.wait_for(1)
            assert kubelet.register_calls == 1
            assert kubelet.connections(RESOURCE) == 1
            assert kubelet.is_registered(RESOURCE)


async def test_register_is_retried_when_a_timed_out_attempt_never_completes() -> None:
    """When the kubelet never finishes a timed-out Register, the plugin tries again."""
    async with FakeKubelet(register_delay=30) as kubelet:
        settings = kubelet.settings(register_timeout=0.1)
        async with serving(StaticPlugin(RESOURCE, widgets(1)), settings=settings):
            await kubelet.wait_for(lambda: kubelet.register_calls >= 2, 5, "a second Register")
            kubelet.register_delay = 0.0
            await kubelet.wait_for_allocatable(RESOURCE, 1)


async def test_permanent_rejection_stops_with_a_clear_error(kubelet: FakeKubelet) -> None:
    """A version rejection is not retried: serving stops with RegistrationRejectedError."""
    # A kubelet with a different API version.
    kubelet.reject(
        'requested API version "v1beta1" is not supported by kubelet. Supported version is ["v2"]'
    )
    with pytest.raises(RegistrationRejectedError, match="is not supported by kubelet"):
        async with serving(StaticPlugin(RESOURCE, widgets(1)), settings=kubelet.settings()):
            await anyio.sleep_forever()  # serving raises
    assert len(kubelet.registrations) == 1
    assert kubelet.registrations[0].error is not None
    assert kubelet.connections(RESOURCE) == 0  # rejected before any dial-back


async def test_a_transient_rejection_is_retried_until_the_kubelet_accepts(
    kubelet: FakeKubelet,
) -> None:
    """Any other Register error is retried with backoff; the plugin registers once it passes."""
    kubelet.reject("failed to dial device plugin: context deadline exceeded", times=2)
    async with serving(StaticPlugin(RESOURCE, widgets(1)), settings=kubelet.settings()):
        await kubelet.wait_for_allocatable(RESOURCE, 1)
    assert [r.error for r in kubelet.registrations] == [
        "failed to dial device plugin: context deadline exceeded",
        "failed to dial device plugin: context deadline exceeded",
        None,
    ]


async def test_kubelet_rejects_invalid_resource_names_with_its_message(
    kubelet: FakeKubelet,
) -> None:
    """FakeKubelet answers a bad resource name with the kubelet's error string (status UNKNOWN)."""
    import grpc

    from devplugin_sdk.api.deviceplugin.v1beta1 import deviceplugin_pb2 as pb
    from devplugin_sdk.api.deviceplugin.v1beta1 import deviceplugin_pb2_grpc as pb_grpc

    async with grpc.aio.insecure_channel(f"unix:{kubelet.socket_path}") as channel:
        stub = pb_grpc.RegistrationStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Register(
                pb.RegisterRequest(version="v1beta1", endpoint="x.sock", resource_name="gpu")
            )
        assert info.value.code() is grpc.StatusCode.UNKNOWN
        assert info.value.details() == 'the ResourceName "gpu" is invalid'
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Register(
                pb.RegisterRequest(version="v1", endpoint="x.sock", resource_name="a.com/b")
            )
        assert info.value.details() == (
            'requested API version "v1" is not supported by kubelet. Supported version is ["v1beta1"]'
        )


async def test_kubelet_reports_a_dial_failure(kubelet: FakeKubelet) -> None:
    """Registering an endpoint nobody serves fails with the kubelet's dial error."""
    import grpc

    from devplugin_sdk.api.deviceplugin.v1beta1 import deviceplugin_pb2 as pb
    from devplugin_sdk.api.deviceplugin.v1beta1 import deviceplugin_pb2_grpc as pb_grpc

    kubelet.dial_timeout = 0.2
    async with grpc.aio.insecure_channel(f"unix:{kubelet.socket_path}") as channel:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await pb_grpc.RegistrationStub(channel).Register(
                pb.RegisterRequest(
                    version="v1beta1", endpoint="nobody.sock", resource_name="a.com/b"
                )
            )
    assert info.value.details() == "failed to dial device plugin: context deadline exceeded"
    assert kubelet.registrations[-1].error is not None


async def test_discovery_failure_at_start_stops_serving(kubelet: FakeKubelet) -> None:
    """A plugin whose discover() fails at start does not register; the error surfaces."""

    class Broken(DevicePlugin):
        resource_name = RESOURCE

        async def discover(self) -> Sequence[Device]:
            raise RuntimeError("no driver loaded")

    with pytest.raises(RuntimeError, match="no driver loaded"):
        async with serving(Broken(), settings=kubelet.settings()):
            await anyio.sleep_forever()  # discover() fails: the block never runs
    assert kubelet.registrations == []


async def test_a_kubelet_restart_during_a_failed_register_retries_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A new kubelet.sock that appears while a Register fails wakes the retry (no backoff)."""
    from devplugin_sdk._wire import registration as _registration

    real = _registration.register_once
    calls = 0

    async with FakeKubelet() as kubelet:

        async def first_fails(*args, **kwargs):  # type: ignore[no-untyped-def]
            nonlocal calls
            calls += 1
            if calls == 1:
                await kubelet.restart()
                return _registration.Outcome.RETRY, "simulated"
            return await real(*args, **kwargs)

        monkeypatch.setattr(_registration, "register_once", first_fails)
        settings = kubelet.settings(register_backoff_initial=30.0, register_backoff_max=30.0)
        async with serving(StaticPlugin(RESOURCE, widgets(1)), settings=settings):
            await kubelet.wait_for_allocatable(RESOURCE, 1, timeout=5)
