"""FakeKubelet: the kubelet's side of the device-plugin protocol, run against real plugins.

Shipped, not only for tests: ``devplugin conformance --register-dir`` and ``devplugin demo`` run
it, and ``devplugin_sdk.testing`` re-exports it for plugin authors' tests. ``FakeKubelet`` is
the kubelet process: it starts (reading the checkpoint, cleaning the directory, serving
``kubelet.sock``), stops, crashes and restarts, offers the fault hooks and the views tests wait
on, and hands each part of the device manager its work:

- ``_directories``: the device-plugin directory and ``plugins_registry`` (given or temporary),
  cleaned at start as the kubelet cleans it;
- ``_register``: the Registration service on ``kubelet.sock`` (its server, validation, dial-back);
- ``_plugin_watcher``: discovery in ``plugins_registry`` (device plugins and DRA drivers);
- ``_device_manager``: each resource's endpoint, its ListAndWatch follower and the capacity;
- ``_admission``: choosing devices, Allocate, PreStartContainer, the allocations held;
- ``_checkpoint``: the checkpoint file, read at start and written after each change;
- ``_tasks``: the work of one run (dial-backs, followers), which ``stop`` ends before it closes
  any connection that work uses, as a kubelet's work ends with its process;
- ``_waiting``: the change signal every part raises and the waits of ``wait_for``.

Its DRA side (``dra``, ``kubelet.fake_dra``) registers DRA drivers found by the plugin watcher and
prepares pods' ResourceClaims as the kubelet's DRA manager does.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import anyio
import anyio.abc

from devplugin_sdk.api import constants
from devplugin_sdk.kubelet.fake._admission import Admission
from devplugin_sdk.kubelet.fake._checkpoint import CheckpointWriter, checkpoint_text, read_resources
from devplugin_sdk.kubelet.fake._device_manager import DeviceManager
from devplugin_sdk.kubelet.fake._directories import Directories
from devplugin_sdk.kubelet.fake._plugin_watcher import PluginWatcher
from devplugin_sdk.kubelet.fake._records import ContainerAllocation, KubeletDevice, Registration
from devplugin_sdk.kubelet.fake._register import KubeletSocket, RegisterService, RegistrationLog
from devplugin_sdk.kubelet.fake._tasks import RunTasks
from devplugin_sdk.kubelet.fake._waiting import Changes
from devplugin_sdk.kubelet.fake_dra import KUBELET_SERVICES, FakeDra
from devplugin_sdk.kubelet.memory_api import MemoryApi
from devplugin_sdk.settings import Settings
from devplugin_sdk.types import Allocation

__all__ = ["FakeKubelet"]

#: The plugin timings ``FakeKubelet.settings`` gives: quick retries and short waits for tests.
if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup  # type: ignore[import-not-found,unused-ignore]

_TEST_TIMINGS: dict[str, Any] = {
    "register_timeout": 15.0,
    "register_backoff_initial": 0.02,
    "register_backoff_max": 0.5,
    "restart_poll_interval": 0.5,
    "stream_lost_grace": 1.0,
    "reregister_delay": 0.2,
    "health_interval": 0.5,
    "stop_grace": 0.5,
}


class FakeKubelet:
    """A kubelet for tests: a real Registration server on ``kubelet.sock`` in a temporary dir.

    Use as an async context manager; ``settings()`` gives plugin settings pointing at it.

    Args:
        directory: The device-plugin directory; a short new temporary one by default (unix
            socket paths are limited to 107 bytes).
        grace_period: Seconds a disconnected plugin's resource keeps its capacity (5 min real).
        dial_timeout: How long Register waits for the plugin's socket to accept (10 s real).
        register_delay: Extra seconds Register takes before dialing (a slow kubelet).
        per_socket_clients: Track clients per (resource, socket) as kubelet v1.37 does (the
            default: two instances with sockets of their own names overlap cleanly); False is
            v1.32 to v1.36, per resource, with its duplicate-registration bug (#121994).
        seed: Seed of the random order in which the kubelet iterates its sets.
        plugin_watcher: Also run the plugin watcher on ``registry_directory`` (plugins put a
            socket there instead of calling Register).
        registry_directory: The plugins_registry directory; by default ``plugins_registry``
            beside ``directory``.
        on_list: Called with the resource name and the devices as each ListAndWatch message
            arrives, before the kubelet's own bookkeeping (a benchmark's clock, say); it must
            not block.
        dra_api: The API (``testing.MemoryApi``) where the DRA side reads ResourceClaims and
            deletes ResourceSlices. With it, the plugin watcher runs even without
            ``plugin_watcher`` (DRA drivers always register there).
        node_name: The node this kubelet runs on (DRA pools are named after it).
        dra_services: The DRA gRPC services this kubelet speaks, most recent first; a 1.32
            kubelet is ``("v1beta1.DRAPlugin",)``.
        dra_call_timeout: The deadline of the DRA calls (45 s real).
        dra_wiping_delay: How long after a DRA driver went away its slices are deleted (30 s).
        dra_plugins_per_driver: Keep every registered plugin of a DRA driver and call the most
            recent connected one, as from 1.33 (the default; rolling updates); False is 1.32:
            one plugin per driver name, replaced by the next registration, and forgotten when
            any of the driver's registration sockets goes.

    Fault hooks, for what a real kubelet does on its own: ``drop_streams()`` ends ListAndWatch
    streams while the kubelet stays up, ``reject(reason)`` answers registrations with an error,
    ``crash()`` leaves a stale ``kubelet.sock``, ``restart()`` wipes the directory. Its parts
    read the knobs above from it at each use: a test may change ``register_delay``,
    ``dial_timeout`` or ``grace_period`` while it runs.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str] | None = None,
        *,
        grace_period: float = constants.ENDPOINT_STOP_GRACE_PERIOD_S,
        dial_timeout: float = constants.KUBELET_DIAL_TIMEOUT_S,
        register_delay: float = 0.0,
        per_socket_clients: bool = True,
        seed: int = 0,
        plugin_watcher: bool = False,
        registry_directory: str | os.PathLike[str] | None = None,
        on_list: Callable[[str, tuple[KubeletDevice, ...]], None] | None = None,
        dra_api: MemoryApi | None = None,
        node_name: str = "node-1",
        dra_services: Sequence[str] = KUBELET_SERVICES,
        dra_call_timeout: float = constants.DRA_CALL_TIMEOUT_S,
        dra_wiping_delay: float = constants.DRA_WIPING_DELAY_S,
        dra_plugins_per_driver: bool = True,
    ) -> None:
        self._dirs = Directories(directory, registry_directory)
        self.plugin_watcher = plugin_watcher
        self.node_name = node_name
        self.grace_period = grace_period
        self.dial_timeout = dial_timeout
        self.register_delay = register_delay
        self.per_socket_clients = per_socket_clients
        self.restarts = 0
        self.on_list = on_list
        self._tg: anyio.abc.TaskGroup | None = None
        self._tasks = RunTasks(lambda: self._tg)  # the work of each run, ended by stop()
        self._changes = Changes()
        self.dra = FakeDra(
            dra_api,
            node_name=node_name,
            services=dra_services,
            call_timeout=dra_call_timeout,
            wiping_delay=dra_wiping_delay,
            plugins_per_driver=dra_plugins_per_driver,
            notify=self._notify,
        )
        self._checkpoint = CheckpointWriter(
            lambda: self.checkpoint_path,
            lambda: checkpoint_text(self._admission.entries(), self._devices.registered_devices()),
        )
        self._devices = DeviceManager(
            self, spawn=self._tasks.spawn, checkpoint=self._checkpoint.schedule, notify=self._notify
        )
        self._admission = Admission(
            self._devices, seed=seed, checkpoint=self._checkpoint.schedule, notify=self._notify
        )
        self._log = RegistrationLog()
        #: Every registration answered (on either path), in order, with the kubelet's error.
        self.registrations: list[Registration] = self._log.records
        register = RegisterService(
            self, self._devices, self._log, spawn=self._tasks.spawn, notify=self._notify
        )
        self._sock = KubeletSocket(lambda: self.socket_path, register)
        self._watcher = PluginWatcher(
            self, self._devices, self.dra, self._log, spawn=self._tasks.spawn, notify=self._notify
        )

    # ------------------------------------------------------------------ context management

    async def __aenter__(self) -> FakeKubelet:
        self._dirs.make()
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        self._tg.start_soon(self._checkpoint.run)
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        with anyio.CancelScope(shield=True):
            await self.stop()
        assert self._tg is not None
        self._tg.cancel_scope.cancel()
        try:
            return await self._tg.__aexit__(exc_type, exc, tb)
        except BaseExceptionGroup as group:
            # The task group wraps the body's own error; a test's pytest.raises and its report
            # want that error as itself (the kubelet's tasks were only cancelled).
            if exc is not None and _only(group, exc):
                return False
            raise
        finally:
            self._dirs.remove()

    @property
    def directory(self) -> Path:
        """The device-plugin directory (``kubelet.sock``, the plugins' sockets, the checkpoint)."""
        return self._dirs.device_plugins

    @property
    def registry_directory(self) -> Path:
        """The ``plugins_registry`` directory the plugin watcher watches."""
        return self._dirs.registry

    @property
    def socket_path(self) -> Path:
        """Path of ``kubelet.sock``."""
        return self.directory / constants.KUBELET_SOCKET_NAME

    @property
    def checkpoint_path(self) -> Path:
        return self.directory / constants.CHECKPOINT_NAME

    @property
    def running(self) -> bool:
        return self._sock.serving

    def settings(self, **overrides: Any) -> Settings:
        """Plugin settings for this kubelet, with test-friendly timings."""
        values: dict[str, Any] = {
            **_TEST_TIMINGS,
            "device_plugin_dir": self.directory,
            "plugins_registry_dir": self.registry_directory,
            "registration": "watcher" if self.plugin_watcher else "kubelet",
        }
        values.update(overrides)
        return Settings(**values)

    @property
    def register_calls(self) -> int:
        """How many registrations arrived (Register calls and plugin-watcher connections)."""
        return self._log.calls

    # ------------------------------------------------------------------ kubelet start / stop

    async def start(self) -> None:
        """Start as the kubelet does: read the checkpoint, clean the directory, serve."""
        if self.running:
            raise RuntimeError("FakeKubelet is already running")
        self._dirs.create()
        async with self._checkpoint.lock:
            self._devices.restore(read_resources(self.checkpoint_path))
            self._dirs.clean()
        await self._sock.serve()
        assert self._tg is not None
        self.dra.start(self._tg)
        if self.plugin_watcher or self.dra.api is not None:
            # Unlike device-plugins, plugins_registry is not cleaned at start: existing sockets
            # are found by a scan and registered again.
            self._watcher.start()
        self._notify()

    async def stop(self) -> None:
        """Stop gracefully: end the kubelet's work (a Register in flight fails), then disconnect
        every plugin and remove ``kubelet.sock``."""
        if not await self._sock.close():  # first: no Register may start work outliving this run
            return
        self._watcher.stop()
        await self._tasks.end()
        await self.dra.stop()
        await self._devices.disconnect_all()
        self._sock.remove()
        async with self._checkpoint.lock:
            self._checkpoint.flush()
        self._notify()

    async def crash(self) -> None:
        """Stop without cleanup: plugins' streams break and a stale ``kubelet.sock`` stays."""
        await self.stop()
        self._sock.leave_stale()
        self._notify()

    async def restart(self) -> None:
        """Stop, then start again (wiping every non-directory file but the checkpoint).

        There is no variant that keeps the plugins' sockets: a kubelet removes every entry
        directly in its directory but the checkpoint and subdirectories *before* it creates the
        new ``kubelet.sock``, and does not start at all if a removal fails (protocol reference,
        7.1). What a restart keeps is what a real one keeps: sockets in subdirectories (where no
        plugin should put one) and, with ``plugin_watcher``, the ``plugins_registry`` directory,
        whose sockets the watcher finds and registers again.
        """
        await self.stop()
        self.restarts += 1
        await self.start()

    # ------------------------------------------------------------------ fault hooks

    def reject(self, reason: str | None, *, times: int | None = None) -> None:
        """Answer registrations with the error ``reason`` until cleared with ``reject(None)``.

        On the ``kubelet.sock`` path Register fails with ``reason`` (status UNKNOWN, as the
        kubelet's errors are) before any check or dial-back; e.g. the kubelet's version
        rejection, ``requested API version "v1beta1" is not supported by kubelet. Supported
        version is ["v2"]``. On the plugin-watcher path the connection that follows a valid
        GetInfo fails with ``reason`` and the plugin is told so through
        NotifyRegistrationStatus. Each rejection is recorded in ``registrations``.

        Args:
            reason: The kubelet's error message, or None to accept registrations again.
            times: Reject only the next ``times`` registrations, then accept again.
        """
        self._log.reject(reason, times)

    async def drop_streams(self, resource: str | None = None) -> int:
        """End ListAndWatch streams from the kubelet's side while the kubelet stays up.

        The kubelet does this on its own errors (a message over 4 MiB) and, in v1.32, when an
        old registration's stream ends (issue #121994). Each end is processed as the kubelet
        does: the plugin is disconnected (its healthy devices become unhealthy and the grace
        period starts) and never redialled; only a new registration brings the resource back.
        Returns once every end has been processed.

        Args:
            resource: Only the streams of this resource; every stream by default.

        Returns:
            How many streams were ended.
        """
        return await self._devices.drop_streams(resource)

    # ------------------------------------------------------------------ views

    def capacity(self, resource: str) -> int:
        """Node capacity for ``resource`` (healthy plus unhealthy devices)."""
        return self._devices.capacity(resource)

    def allocatable(self, resource: str) -> int:
        """Node allocatable for ``resource`` (healthy devices)."""
        return self._devices.allocatable(resource)

    def devices(self, resource: str) -> dict[str, KubeletDevice]:
        """Devices of ``resource`` from the latest ListAndWatch message."""
        return self._devices.devices(resource)

    def is_registered(self, resource: str) -> bool:
        """Whether ``resource`` has a live (not stopped) endpoint."""
        return self._devices.is_registered(resource)

    def connections(self, resource: str) -> int:
        """How many live client connections the kubelet holds for ``resource``."""
        return self._devices.connections(resource)

    def messages(self, resource: str) -> int:
        """How many ListAndWatch messages the kubelet processed for ``resource``."""
        return self._devices.messages(resource)

    def ended_streams(self, resource: str) -> int:
        """How many ListAndWatch streams of ``resource`` have ended, each end processed."""
        return self._devices.ended_streams(resource)

    def successful_registrations(self, resource: str) -> list[Registration]:
        return [r for r in self.registrations if r.resource_name == resource and r.error is None]

    # ------------------------------------------------------------------ waiting

    def _notify(self) -> None:
        self._changes.notify()

    async def wait_for(
        self, predicate: Callable[[], bool], timeout: float = 5.0, what: str = "condition"
    ) -> None:
        """Wait until ``predicate()`` holds, re-checking on every kubelet state change.

        Raises:
            TimeoutError: naming ``what`` and the kubelet's view, after ``timeout`` seconds.
        """
        await self._changes.until(predicate, timeout, what, self.describe)

    async def wait_for_allocatable(self, resource: str, count: int, timeout: float = 5.0) -> None:
        """Wait until ``allocatable(resource) == count``."""
        await self.wait_for(
            lambda: self.allocatable(resource) == count,
            timeout,
            f"allocatable {resource} == {count}",
        )

    async def wait_for_health(
        self, resource: str, device_id: str, health: str, timeout: float = 5.0
    ) -> None:
        """Wait until the kubelet sees ``device_id`` with ``health``."""

        def check() -> bool:
            device = self.devices(resource).get(device_id)
            return device is not None and device.health == str(health)

        await self.wait_for(check, timeout, f"{resource} device {device_id} {health}")

    async def wait_for_registrations(self, resource: str, count: int, timeout: float = 5.0) -> None:
        """Wait until ``resource`` has registered successfully ``count`` times in total."""
        await self.wait_for(
            lambda: len(self.successful_registrations(resource)) >= count,
            timeout,
            f"{count} registrations of {resource}",
        )

    def describe(self) -> str:
        """A one-line summary of what the kubelet sees, for failure messages."""
        parts = [f"kubelet {'running' if self.running else 'stopped'}"]
        parts += self._devices.describe()
        parts.append(f"{len(self.registrations)} Register calls")
        return "; ".join(parts)

    # ------------------------------------------------------------------ allocation

    async def allocate(
        self,
        resource: str,
        count: int,
        *,
        pod: str | None = None,
        container: str = "main",
        start: bool = True,
    ) -> ContainerAllocation:
        """Admit a container asking for ``count`` devices, as the kubelet does.

        Chooses devices (GetPreferredAllocation when offered), calls Allocate, records the
        result, then, with ``start``, calls PreStartContainer when the plugin requires it.

        Raises:
            AdmissionError: with the kubelet's reason (no healthy devices, unavailable, RPC error).
            ContainerStartError: PreStartContainer failed.
        """
        return await self._admission.allocate(
            resource, count, pod=pod, container=container, start=start
        )

    async def start_container(self, allocation: ContainerAllocation) -> None:
        """Start (or restart) a container: PreStartContainer when the plugin requires it.

        Raises:
            ContainerStartError: the plugin's endpoint is gone or PreStartContainer failed.
        """
        await self._admission.start_container(allocation)

    def release(self, allocation: ContainerAllocation) -> None:
        """The pod ended: its devices are free again (the plugin is never told)."""
        self._admission.release(allocation)

    def allocated(self, resource: str) -> set[str]:
        """IDs of ``resource`` held by containers."""
        return self._admission.allocated(resource)

    async def call_allocate(self, resource: str, device_ids: Iterable[str]) -> Allocation:
        """Call the plugin's Allocate directly with ``device_ids`` (no admission checks).

        Raises:
            grpc.aio.AioRpcError: the plugin's error status.
            AdmissionError: the plugin answered no container response.
        """
        return await self._admission.call_allocate(resource, device_ids)


def _only(group: BaseExceptionGroup[BaseException], exc: BaseException) -> bool:
    """Whether ``group`` holds ``exc`` and nothing else but cancellations."""

    def leaves(error: BaseException) -> list[BaseException]:
        if error is exc or not isinstance(error, BaseExceptionGroup):
            return [error]
        return [leaf for inner in error.exceptions for leaf in leaves(inner)]

    cancelled = anyio.get_cancelled_exc_class()
    return [e for e in leaves(group) if not isinstance(e, cancelled)] == [exc]
