"""``DevicePlugin``: the abstract class a vendor subclasses.

The author supplies discovery, health and (optionally) allocation policy; the SDK owns the socket,
registration, kubelet-restart recovery, ListAndWatch and the RPC plumbing. ``runner.serve`` and
``runner.run`` (``devplugin_sdk.serve``/``run``) run plugins.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import PurePath

from devplugin_sdk import _names
from devplugin_sdk.types import (
    Allocation,
    Device,
    DeviceStatus,
    Health,
    HealthEvent,
    RescanEvent,
)

__all__ = ["DevicePlugin"]


class DevicePlugin(abc.ABC):
    """A device plugin for one extended resource.

    Subclass it, set ``resource_name`` and implement ``discover``. Everything else is optional:

    * health is *polled* by overriding ``check_health`` (every ``Settings.health_interval``) or
      *pushed* by overriding ``watch`` (an async generator of ``HealthEvent``/``RescanEvent``,
      delivered to the kubelet as soon as it is yielded), or both;
    * ``allocate`` merges the allocated devices' declared nodes, mounts, env, annotations and
      CDI names; override it when the container setup is more than that merge;
    * overriding ``preferred_allocation`` or ``pre_start_container`` turns on the matching
      kubelet option (``get_preferred_allocation_available`` / ``pre_start_required``).

    Hooks are ``async def`` and run on the event loop: run blocking work (NVML, sysfs) through
    ``anyio.to_thread.run_sync``. A hook that raises never stops the plugin: the error is logged
    and, in an RPC, returned to the kubelet as a gRPC status with its message.

    Health has one owner, the SDK. A device's health is the latest report about it or about
    its ``parent``: discovery's (when what ``discover`` says about the device changes),
    ``check_health``'s (when it changes) or a pushed ``HealthEvent``. Nothing is sticky: a
    device discovered Unhealthy is Healthy again after a later Healthy report, and a rescan that
    still sees a device as Healthy does not clear a fault pushed since. Report each signal one
    way (push or poll) and never keep a copy of the SDK's view.

    Attributes:
        resource_name: The extended resource name, e.g. ``"acme.com/widget"``; a class attribute
            or passed to ``__init__``.
        socket_name: Bare socket file name in the device-plugin directory; defaults to the
            resource name with ``/`` replaced by ``_`` plus ``.sock``.
        health_interval: Seconds between ``check_health`` polls for this plugin; None means
            ``Settings.health_interval``. Backends set it from their own configuration.
        rescan_interval: Seconds between calls of ``discover()`` after the first (a periodic
            rescan: devices that appear or go are seen); None means
            ``Settings.rescan_interval`` (10 s by default), 0 turns it off for this plugin
            (one whose ``watch()`` pushes a ``RescanEvent`` on every change needs none).
    """

    resource_name: str
    socket_name: str | None = None
    health_interval: float | None = None
    rescan_interval: float | None = None

    def __init__(self, *, resource_name: str | None = None, socket_name: str | None = None) -> None:
        """Validate the names with the kubelet's rules.

        Args:
            resource_name: Overrides the class attribute (one class, several resources).
            socket_name: Overrides the default socket name.

        Raises:
            ValueError: if the resource or socket name would be rejected by the kubelet.
        """
        if resource_name is not None:
            self.resource_name = resource_name
        if socket_name is not None:
            self.socket_name = socket_name
        self.validate_names()

    def validate_names(self) -> None:
        """Check ``resource_name`` and ``socket_name``; the SDK calls it again before serving.

        Raises:
            ValueError: naming the rule that is broken.
        """
        name = getattr(self, "resource_name", None)
        if not isinstance(name, str):
            raise TypeError(f"{type(self).__name__} must set resource_name to a string")
        _names.validate_resource_name(name)
        _names.validate_socket_name(self.effective_socket_name)

    @property
    def effective_socket_name(self) -> str:
        """The socket file name this plugin serves on."""
        return self.socket_name or _names.default_socket_name(self.resource_name)

    # ----------------------------------------------------------------------------- hooks

    @abc.abstractmethod
    async def discover(self) -> Sequence[Device]:
        """Return every device of the resource, healthy or not.

        Called at start, again every ``rescan_interval`` seconds (10 s by default) and for
        every ``RescanEvent``. IDs must be unique.

        Raises:
            BackendError: discovery failed; at start this stops the plugin, on a rescan the
                previous device list is kept.
        """

    async def check_health(self, devices: Sequence[Device]) -> Mapping[str, Health]:
        """Poll health (optional; overriding it turns polling on).

        Args:
            devices: The current devices.

        Returns:
            Health by device ID (or parent ID); IDs left out keep their current health. A
            ``types.HealthReport`` also says why, for the log and the observer.
        """
        raise NotImplementedError

    def watch(self) -> AsyncIterator[HealthEvent | RescanEvent]:
        """Push health and rescan events (optional; overriding it starts it at serve time).

        Write it as an async generator that runs for the plugin's whole life::

            async def watch(self):
                async for xid in self.xid_events():
                    yield HealthEvent(xid.uuid, Health.UNHEALTHY, reason=f"Xid {xid.code}")

        If it raises, the error is logged and it is started again after a short delay. The SDK
        closes the generator (``aclosing``) in the task that iterates it, on shutdown too.
        """
        raise NotImplementedError

    async def allocate(self, devices: Sequence[Device]) -> Allocation:
        """Build one container's allocation from its devices.

        The default merges every device's declared nodes, mounts, env, annotations and CDI
        names (``Allocation.merge``). The SDK has already rejected unknown IDs. Must be
        idempotent: the kubelet may send the same IDs again (init containers, re-allocation).

        Args:
            devices: The devices allocated to the container, in request order.

        Raises:
            AllocationError: the devices cannot be prepared; the message reaches the pod.
        """
        return Allocation.merge(devices)

    async def preferred_allocation(
        self, available: Sequence[Device], must_include: Sequence[Device], size: int
    ) -> Sequence[str]:
        """Choose ``size`` device IDs (optional; overriding it advertises the RPC).

        The SDK makes the answer valid whatever this returns or raises: must-include devices
        first, then this hook's choice among ``available``, then any other available devices;
        an error is logged and answered with that fallback, because the kubelet fails the pod
        on any GetPreferredAllocation error. ``devplugin_sdk.allocation`` has topology scorers.

        Args:
            available: Devices the kubelet may allocate (includes ``must_include``).
            must_include: Devices that must be part of the answer.
            size: How many devices the container gets in total.
        """
        raise NotImplementedError

    async def pre_start_container(self, devices: Sequence[Device]) -> None:
        """Prepare devices before each container start (optional; overriding it makes the
        kubelet call it before every start, restarts included).

        Bounded by ``Settings.prestart_timeout`` (the kubelet gives up at 30 s).

        Raises:
            AllocationError: the container must not start; the kubelet retries with backoff.
        """
        raise NotImplementedError

    async def device_status(self, device: Device) -> DeviceStatus | None:
        """What a DRA driver reports about ``device`` once prepared (optional; DRA only).

        Called after ``allocate()`` for each device of a claim the DRA driver prepares; the
        answer goes into the ResourceClaim's ``status.devices[]`` (server-side apply, the
        driver as field manager) and, with ``network_data``, into the request's
        ``metadata.json``. Out-of-limit answers are dropped with a warning; an error or None
        writes nothing. The device-plugin API has no place for it.

        Returns:
            The device's conditions, data and network data, or None.
        """
        return None

    async def on_stop(self) -> None:  # noqa: B027 - an optional hook, a no-op by default
        """Clean up when serving this plugin ends (optional).

        Called once, after its ListAndWatch streams ended and its server stopped: on shutdown,
        when a configuration reload removes or replaces the plugin, and after a first
        ``discover()`` that failed. Shielded from cancellation and bounded by
        ``Settings.stop_timeout``; an error is logged.
        """

    # ----------------------------------------------------------------------------- introspection

    def overrides(self, hook: str) -> bool:
        """Whether this plugin's class overrides the optional hook ``hook``."""
        return getattr(type(self), hook) is not getattr(DevicePlugin, hook)

    @property
    def allocate_is_merge(self) -> bool:
        """Whether ``allocate`` answers ``Allocation.merge(devices)`` and does nothing else.

        When it does, the SDK answers Allocate without calling it: the merge of a set of
        devices is encoded once and kept until the devices change. True when the class keeps
        the default ``allocate``; a wrapper whose ``overrides`` reports another plugin's hooks
        (``cdi.CdiPlugin``) declares its own.
        """
        return type(self).allocate is DevicePlugin.allocate

    def fingerprint(self) -> str:
        """What identifies this plugin's configuration.

        On a configuration reload a resource is restarted only when its new plugin's
        fingerprint differs from the running one's. The default is the class and a canonical
        form of every public instance attribute (backends keep their configuration there: sets
        are sorted, mappings ordered by key, dataclasses taken field by field, so equal
        configurations always give equal fingerprints); override it when the configuration
        lives elsewhere.
        """
        public = {k: v for k, v in vars(self).items() if not k.startswith("_")}
        return f"{type(self).__module__}.{type(self).__qualname__}{_canonical(public)}"


def _canonical(value: object) -> str:
    """A text form of ``value`` that is equal for equal values (set order never shows)."""
    if isinstance(value, Mapping):
        items = sorted((_canonical(k), _canonical(v)) for k, v in value.items())
        return "{" + ", ".join(f"{k}: {v}" for k, v in items) + "}"
    if isinstance(value, (set, frozenset)):
        return "{" + ", ".join(sorted(_canonical(v) for v in value)) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_canonical(v) for v in value) + "]"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
        return f"{type(value).__qualname__}{_canonical(fields)}"
    if isinstance(value, (enum.Enum, PurePath)):
        return repr(str(value.value if isinstance(value, enum.Enum) else value))
    return repr(value)
