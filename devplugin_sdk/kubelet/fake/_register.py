"""The kubelet's Registration service on ``kubelet.sock`` (the handler and the socket's server),
and the record both registration paths (this one and the plugin watcher's) keep.

Register validates with the kubelet's error strings and dials back synchronously, calling
GetDevicePluginOptions inside Register (protocol reference, section 2); as in v1.32 a client
that gives up does not stop the kubelet from connecting.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import anyio
import grpc

from devplugin_sdk import _names
from devplugin_sdk._wire import registration as _registration
from devplugin_sdk.api import constants
from devplugin_sdk.kubelet.fake._device_manager import DeviceManager, Spawn
from devplugin_sdk.kubelet.fake._records import Registration, with_error

__all__ = ["KubeletSocket", "RegisterService", "RegistrationLog"]


class RegistrationLog:
    """Every registration the kubelet answered, the calls it got, and the rejection it is
    told to answer with (``FakeKubelet.reject``)."""

    def __init__(self) -> None:
        self.records: list[Registration] = []
        self.calls = 0
        self._rejection: tuple[str, int | None] | None = None

    def reject(self, reason: str | None, times: int | None) -> None:
        """Answer with ``reason`` (``times`` times, or until cleared); see FakeKubelet."""
        if reason is not None and times is not None and times < 1:
            raise ValueError(f"times must be at least 1, got {times}")
        self._rejection = None if reason is None else (reason, times)

    def take_rejection(self) -> str | None:
        """The error to answer the registration at hand with, if any (counted down)."""
        if self._rejection is None:
            return None
        reason, times = self._rejection
        if times is not None:
            self._rejection = (reason, times - 1) if times > 1 else None
        return reason


class _Knobs(Protocol):
    """What Register reads from FakeKubelet at each call (tests turn ``register_delay``)."""

    register_delay: float

    @property
    def directory(self) -> Path: ...


class RegisterService:
    """The handler of Register calls.

    Args:
        knobs: FakeKubelet, read at each call (its directory, the extra delay).
        devices: The device manager, which dials the plugin back.
        registrations: Where the call and its answer are recorded.
        spawn: Starts a task in the kubelet's task group (the connection outlives the call).
        notify: Wakes the kubelet's waiters on every change.
    """

    def __init__(
        self,
        knobs: _Knobs,
        devices: DeviceManager,
        registrations: RegistrationLog,
        *,
        spawn: Spawn,
        notify: Callable[[], None],
    ) -> None:
        self._knobs = knobs
        self._devices = devices
        self._log = registrations
        self._spawn = spawn
        self._notify = notify

    async def register(self, request: _registration.RegisterCall) -> str | None:
        """Register: None accepts it; an error message is the kubelet's answer."""
        self._log.calls += 1
        self._notify()  # tests may wait for a call to arrive (wait_for)
        record = Registration(
            resource_name=request.resource_name,
            endpoint=request.endpoint,
            version=request.version,
            pre_start_required=request.pre_start_required,
            preferred_allocation=request.preferred_allocation,
            at=time.monotonic(),
        )
        done = anyio.Event()
        outcome: list[str | None] = []

        async def connect() -> None:
            try:
                error = await self._connect(request)
                self._log.records.append(record if error is None else with_error(record, error))
                outcome.append(error)
                self._notify()
            finally:
                done.set()  # also when the kubelet stops first: this call must not wait on

        # v1.32 ignores the request's context: a client that gives up does not stop the
        # kubelet from dialing back, fetching options and opening ListAndWatch.
        self._spawn(connect)
        await done.wait()
        return outcome[0] if outcome else "the kubelet stopped before the registration completed"

    async def _connect(self, request: _registration.RegisterCall) -> str | None:
        rejection = self._log.take_rejection()
        if rejection is not None:
            return rejection
        if request.version not in constants.SUPPORTED_VERSIONS:
            return (
                f'requested API version "{request.version}" is not supported by kubelet. '
                f'Supported version is ["{constants.VERSION}"]'
            )
        if not _names.is_extended_resource_name(request.resource_name):
            return f'the ResourceName "{request.resource_name}" is invalid'
        if self._knobs.register_delay:
            await anyio.sleep(self._knobs.register_delay)
        return await self._devices.connect(
            request.resource_name, _join_endpoint(self._knobs.directory, request.endpoint)
        )


class KubeletSocket:
    """``kubelet.sock``: the gRPC server of the Registration service, one per kubelet run.

    Args:
        path: Where ``kubelet.sock`` is now (FakeKubelet's directory is chosen on entry).
        register: The handler of Register calls.
    """

    def __init__(self, path: Callable[[], Path], register: RegisterService) -> None:
        self._path = path
        self._register = register
        self._server: grpc.aio.Server | None = None

    @property
    def serving(self) -> bool:
        return self._server is not None

    async def serve(self) -> None:
        """Create ``kubelet.sock`` and answer Register calls on it."""
        server = grpc.aio.server()
        server.add_generic_rpc_handlers(
            [_registration.registration_server(self._register.register)]
        )
        server.add_insecure_port(f"unix:{self._path()}")
        with anyio.CancelScope(shield=True):  # never leave a half-started server behind
            await server.start()
        self._server = server

    async def close(self) -> bool:
        """Stop answering at once (a Register in flight fails); False if it was not serving."""
        server, self._server = self._server, None
        if server is None:
            return False
        await server.stop(0)
        return True

    def remove(self) -> None:
        """Remove the socket file."""
        # Go's unix listener removes its socket on Close (grpcio does too; make it certain).
        self._path().unlink(missing_ok=True)

    def leave_stale(self) -> None:
        """Leave a stale ``kubelet.sock``, as a crashed kubelet does: connections are refused."""
        stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        stale.bind(str(self._path()))
        stale.close()  # bound, never listening


def _join_endpoint(directory: Path, endpoint: str) -> Path:
    # The kubelet joins the endpoint onto its directory with no other check (filepath.Join).
    return Path(os.path.normpath(directory / endpoint))
