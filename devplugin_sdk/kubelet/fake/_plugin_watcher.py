"""The kubelet's plugin watcher: discovery of plugin sockets in ``plugins_registry`` and their
registration (GetInfo, validation, NotifyRegistrationStatus), for device plugins and DRA drivers.

Unlike the device-plugin directory, ``plugins_registry`` is not cleaned at kubelet start: the
sockets already there are found by a scan and registered again (protocol reference, section 6).
"""

from __future__ import annotations

import logging
import os
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import anyio
import grpc

from devplugin_sdk import _names, fswatch
from devplugin_sdk._wire import watcher_registration
from devplugin_sdk.api import constants
from devplugin_sdk.kubelet.fake._device_manager import DeviceManager, Endpoint, Spawn
from devplugin_sdk.kubelet.fake._records import Registration, with_error
from devplugin_sdk.kubelet.fake._register import RegistrationLog
from devplugin_sdk.kubelet.fake_dra import FakeDra

__all__ = ["PluginWatcher"]

log = logging.getLogger("devplugin_sdk.fake_kubelet")


class _Knobs(Protocol):
    """What the watcher reads from FakeKubelet at each use."""

    dial_timeout: float

    @property
    def registry_directory(self) -> Path: ...

    @property
    def running(self) -> bool: ...


class PluginWatcher:
    """Watches ``plugins_registry`` and registers what appears there, deregisters what goes.

    Args:
        knobs: FakeKubelet, read at each use (its registry directory, dial timeout, running).
        devices: The device manager, which connects device plugins.
        dra: The DRA manager, which registers DRA drivers.
        registrations: Where each device plugin's registration is recorded.
        spawn: Starts a task in the kubelet's task group.
        notify: Wakes the kubelet's waiters on every change.
    """

    def __init__(
        self,
        knobs: _Knobs,
        devices: DeviceManager,
        dra: FakeDra,
        registrations: RegistrationLog,
        *,
        spawn: Spawn,
        notify: Callable[[], None],
    ) -> None:
        self._knobs = knobs
        self._devices = devices
        self._dra = dra
        self._log = registrations
        self._spawn = spawn
        self._notify = notify
        self._watched: dict[Path, Endpoint | None] = {}
        self._scope: anyio.CancelScope | None = None

    def start(self) -> None:
        """Watch the registry directory (created if missing) until ``stop``."""
        self._knobs.registry_directory.mkdir(parents=True, exist_ok=True)
        self._scope = anyio.CancelScope()
        self._spawn(self._run, self._scope)

    def stop(self) -> None:
        """Stop watching and forget every socket seen (the kubelet stops)."""
        if self._scope is not None:
            self._scope.cancel()
            self._scope = None
        self._watched.clear()

    async def _run(self, scope: anyio.CancelScope) -> None:
        with scope:
            self._scan()
            async for _changed in fswatch.watch(
                [self._knobs.registry_directory], poll_interval=1.0
            ):
                self._scan()

    def _scan(self) -> None:
        present: set[Path] = set()
        for entry in os.scandir(self._knobs.registry_directory):
            # Only sockets whose name does not start with "." count.
            if entry.name.startswith(".") or not stat.S_ISSOCK(
                entry.stat(follow_symlinks=False).st_mode
            ):
                continue
            path = Path(entry.path)
            present.add(path)
            if path not in self._watched:
                self._watched[path] = None
                self._spawn(self._register, path)
        for path in set(self._watched) - present:
            # Deleting the socket deregisters the plugin.
            client = self._watched.pop(path)
            if client is not None:
                self._spawn(self._devices.deregister_plugin, client)
            else:
                self._spawn(self._dra.deregister, path)

    async def _register(self, path: Path) -> None:
        """The reconciler's registration of one socket, retried with backoff until recorded."""
        backoff = 0.05
        while path in self._watched and self._knobs.running:
            error, info = await self._validate(path)
            if info is not None and error is None:
                break
            if info is not None:
                await self._notify_status(path, False, f"RegisterPlugin error -- {error}")
            await anyio.sleep(backoff)
            # The kubelet retries from 0.5 s up to about 2 minutes; scaled down here.
            backoff = min(backoff * 2, 2.0)
        else:
            return
        if info.type == constants.PLUGIN_TYPE_DRA_PLUGIN:
            error = self._log.take_rejection() or await self._dra.register(path, info)
        else:
            error = await self._register_device_plugin(path, info)
        # Failures after the plugin is recorded are not retried (v1.32): the plugin is told.
        await self._notify_status(
            path, error is None, "" if error is None else f"RegisterPlugin error -- {error}"
        )

    async def _register_device_plugin(
        self, path: Path, info: watcher_registration.PluginInfo
    ) -> str | None:
        """Connect a validated device plugin and record it; None, or the kubelet's error."""
        record = Registration(
            resource_name=info.name,
            endpoint=str(path),
            version=constants.VERSION,
            pre_start_required=False,
            preferred_allocation=False,
            at=time.monotonic(),
        )
        endpoint = Path(info.endpoint) if info.endpoint else path
        self._log.calls += 1
        error = self._log.take_rejection()
        if error is None:
            error = await self._devices.connect(info.name, endpoint)
        books = self._devices.books(info.name) if error is None else None
        client = books.endpoint if books is not None else None
        if client is not None:
            self._watched[path] = client
            record = Registration(
                resource_name=record.resource_name,
                endpoint=record.endpoint,
                version=record.version,
                pre_start_required=client.options.pre_start_required,
                preferred_allocation=client.options.preferred_allocation,
                at=record.at,
            )
        self._log.records.append(record if error is None else with_error(record, error))
        self._notify()
        return error

    async def _validate(
        self, path: Path
    ) -> tuple[str | None, watcher_registration.PluginInfo | None]:
        try:
            info = await watcher_registration.get_info(path, dial_timeout=self._knobs.dial_timeout)
        except (TimeoutError, grpc.aio.AioRpcError) as exc:
            return f"failed to get plugin info: {exc}", None
        if info.type == constants.PLUGIN_TYPE_DRA_PLUGIN:
            return None, info  # the DRA manager validates it (FakeDra.register)
        if info.type != constants.PLUGIN_TYPE_DEVICE_PLUGIN:
            return f"plugin type {info.type!r} is not handled here", info
        if constants.VERSION not in info.supported_versions:
            return (
                "plugin validation failed with err: manager version, v1beta1, is not among plugin "
                f"supported versions {list(info.supported_versions)}",
                info,
            )
        if not _names.is_extended_resource_name(info.name):
            return (
                "plugin validation failed with err: invalid name of device plugin socket: "
                f'the ResourceName "{info.name}" is invalid',
                info,
            )
        return None, info

    async def _notify_status(self, path: Path, registered: bool, error: str) -> None:
        try:
            await watcher_registration.notify_status(path, registered, error)
        except grpc.aio.AioRpcError as exc:
            log.info("NotifyRegistrationStatus to %s failed: %s", path, exc.code().name)
