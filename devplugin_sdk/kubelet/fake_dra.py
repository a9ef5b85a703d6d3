"""FakeKubelet's DRA side: the kubelet's DRA manager (pkg/kubelet/cm/dra), run against real drivers.

It registers DRA plugins that the plugin watcher finds (GetInfo type ``DRAPlugin``), choosing the
first gRPC service in the plugin's list that it speaks, keeps the claim information of prepared
claims (its ``dra_manager_state`` checkpoint survives a kubelet restart), and prepares and
unprepares a pod's claims as the kubelet does: per pod, synchronously, one call per driver with
all of the pod's claims for that driver, each call bounded by 45 s; a claim's error, a missing
answer or an unknown UID fails the pod's preparation. With an API (``MemoryApi``) it reads the
claims there, checks the pod is in ``reservedFor``, deletes every ResourceSlice of its node when
it starts, and a driver's slices 30 s after the driver's last plugin went away. A plugin that
lists a ``DRAResourceHealth`` service gets its health stream followed (``health``,
``kubelet._dra_health``). It speaks through ``_wire``'s clients and never sees protobuf.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import anyio
import anyio.abc
import grpc

from devplugin_sdk import _names
from devplugin_sdk._wire.client import call
from devplugin_sdk._wire.dra_model import ClaimRef, PreparedDevice
from devplugin_sdk._wire.dra_service import DraClient
from devplugin_sdk._wire.watcher_registration import PluginInfo
from devplugin_sdk.api import constants
from devplugin_sdk.errors import KubeApiError
from devplugin_sdk.kubelet._dra_health import HEALTH_SERVICES, HealthCache, pick_health_service
from devplugin_sdk.kubelet.memory_api import MemoryApi

__all__ = ["DraPod", "DraRegistration", "FakeDra", "PodPreparationError", "PreparedPod"]

log = logging.getLogger("devplugin_sdk.fake_kubelet")

T = TypeVar("T")

#: What a kubelet of 1.37 speaks, most recent first (servicesSupportedByKubelet), with the health
#: streams; a 1.34-1.36 kubelet has only v1alpha1 of those, a 1.32 one only v1beta1.DRAPlugin.
KUBELET_SERVICES = (constants.DRA_SERVICE_V1, constants.DRA_SERVICE_V1BETA1, *HEALTH_SERVICES)


class PodPreparationError(Exception):
    """The kubelet could not prepare (or unprepare) a pod's claims; the pod does not start."""


@dataclass(frozen=True, slots=True)
class DraPod:
    """A pod that uses ResourceClaims (by claim name, in its namespace)."""

    namespace: str
    name: str
    claims: tuple[str, ...]
    uid: str = field(default_factory=lambda: str(uuid.uuid4()))


@dataclass(frozen=True, slots=True)
class DraRegistration:
    """One DRA plugin registration as the kubelet saw it."""

    driver: str
    endpoint: str
    service: str
    socket: str
    at: float
    error: str | None = None
    #: The services the plugin listed in GetInfo (its "supported versions").
    versions: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class PreparedPod:
    """What the kubelet holds for a pod after preparing it: the devices of each claim."""

    pod: DraPod
    claims: dict[str, tuple[PreparedDevice, ...]]

    def cdi_ids(self, claim: str, request: str | None = None) -> list[str]:
        """The CDI device IDs a container referencing ``claim`` (and ``request``) gets, as the
        kubelet collects them (claimInfo.cdiDevicesAsList)."""
        ids: dict[str, None] = {}
        for device in self.claims[claim]:
            if request is None or not device.request_names or request in device.request_names:
                ids.update(dict.fromkeys(device.cdi_ids))
        return list(ids)


@dataclass(eq=False)
class _Plugin:
    registration: DraRegistration
    channel: grpc.aio.Channel
    client: DraClient
    #: Why the kubelet closed the connection (a call in flight then fails with it).
    gone: str | None = None
    #: Ends the plugin's health stream.
    health: anyio.CancelScope | None = None

    def connected(self) -> bool:
        """Whether the connection is up (the kubelet follows it through gRPC's stats handler)."""
        return self.channel.get_state(try_to_connect=True) is grpc.ChannelConnectivity.READY

    async def close(self, why: str) -> None:
        self.gone = why
        if self.health is not None:
            self.health.cancel()
        await self.channel.close()

    async def call(self, method: str, awaitable: Awaitable[T]) -> T:
        """Await a call to the plugin; a failure is the pod's ``PodPreparationError``."""
        try:
            return await call(awaitable)
        except grpc.aio.AioRpcError as exc:
            if self.gone is not None:
                raise PodPreparationError(
                    f"{method} failed: {self.gone} while the call was in flight"
                ) from None
            raise PodPreparationError(
                f"{method} failed: rpc error: code = {exc.code().name} desc = {exc.details()}"
            ) from None


@dataclass(eq=False)
class _ClaimInfo:
    claim: ClaimRef
    drivers: tuple[str, ...]
    pods: set[str] = field(default_factory=set)
    devices: dict[str, tuple[PreparedDevice, ...]] = field(default_factory=dict)
    prepared: bool = False


class FakeDra:
    """The kubelet's DRA manager; ``FakeKubelet.dra`` (see ``FakeKubelet``'s ``dra_api``).

    Args:
        api: The API holding claims and slices; None: claims cannot be read (only
            registration works).
        node_name: The kubelet's node.
        services: The DRA services this kubelet speaks, most recent first, health streams
            included (a 1.32 kubelet: ``("v1beta1.DRAPlugin",)``).
        call_timeout: The deadline of NodePrepareResources/NodeUnprepareResources.
        wiping_delay: How long after a driver's last plugin went away its slices are deleted.
        plugins_per_driver: 1.33+ (pkg/kubelet/cm/dra/plugin/dra_plugin_manager.go): every
            plugin of a driver is kept, calls go to the most recent connected one (else the most
            recent), a plugin goes when its own socket does. False is 1.32: one plugin per
            driver name, replaced by a new registration and forgotten by name when any
            registration socket of the driver goes (a rolling update loses the new instance).
        notify: Called on every change (wakes FakeKubelet's waiters).
    """

    def __init__(
        self,
        api: MemoryApi | None,
        *,
        node_name: str,
        services: Sequence[str] = KUBELET_SERVICES,
        call_timeout: float = constants.DRA_CALL_TIMEOUT_S,
        wiping_delay: float = constants.DRA_WIPING_DELAY_S,
        plugins_per_driver: bool = True,
        notify: Callable[[], None] = lambda: None,
    ) -> None:
        self.api = api
        self.node_name = node_name
        self.services = tuple(services)
        self.call_timeout = call_timeout
        self.wiping_delay = wiping_delay
        self.plugins_per_driver = plugins_per_driver
        self.registrations: list[DraRegistration] = []
        #: Device health as the kubelet holds it (``health.health(driver, pool, device)``).
        self.health = HealthCache(notify)
        self.calls: list[tuple[str, str, tuple[str, ...]]] = []
        self._plugins: dict[str, list[_Plugin]] = {}
        self._claims: dict[tuple[str, str], _ClaimInfo] = {}
        self._wipes: dict[str, anyio.CancelScope] = {}
        self._tg: anyio.abc.TaskGroup | None = None
        self._notify = notify

    # ------------------------------------------------------------------ kubelet start / stop

    def start(self, tg: anyio.abc.TaskGroup) -> None:
        """The kubelet starts: no driver is registered yet, so every slice of the node goes."""
        self._tg = tg
        if self.api is not None:
            wiped = self.api.wipe_slices(self.node_name)
            if wiped:
                log.info(
                    "kubelet start: deleted %d ResourceSlices of node %s", wiped, self.node_name
                )

    async def stop(self) -> None:
        """The kubelet stops: connections close; claim information is kept (checkpointed)."""
        for driver, plugins in self._plugins.items():
            for plugin in plugins:
                await plugin.close("the kubelet stopped")
            self.health.clear(driver)
        self._plugins.clear()
        for scope in self._wipes.values():
            scope.cancel()
        self._wipes.clear()
        self._notify()

    # ------------------------------------------------------------------ registration

    async def register(self, socket: Path, info: PluginInfo) -> str | None:
        """RegisterPlugin for a DRA plugin; None on success, else the kubelet's error."""
        record = DraRegistration(
            info.name,
            info.endpoint,
            "",
            str(socket),
            time.monotonic(),
            versions=tuple(info.supported_versions),
        )
        error: str | None = None
        chosen = next(
            (s for s in info.supported_versions if s in self.services and s not in HEALTH_SERVICES),
            None,
        )
        if not info.supported_versions:
            error = "empty list of supported gRPC services (aka supported versions)"
        elif chosen is None:
            error = (
                f"none of services supported by the plugin ({list(info.supported_versions)}) "
                f"are supported by the kubelet ({list(self.services)})"
            )
        elif _names.driver_name_problem(info.name) is not None:
            error = f"invalid DRA driver name {info.name!r}"
        elif not info.endpoint.startswith("/"):
            error = f"endpoint {info.endpoint!r} is not an absolute socket path"
        elif self.plugins_per_driver and any(
            p.registration.endpoint == info.endpoint for p in self._plugins.get(info.name, [])
        ):
            error = f"endpoint {info.endpoint} already registered for DRA driver plugin {info.name}"
        if error is not None:
            error = (
                f"invalid supported gRPC versions of DRA driver plugin {info.name} at endpoint "
                f"{info.endpoint}: {error}"
                if chosen is None
                else error
            )
            self.registrations.append(_with_error(record, error))
            self._notify()
            return error
        assert chosen is not None
        record = dataclasses.replace(record, service=chosen)
        # Its own connection, as the kubelet's (see DeviceManager.connect).
        channel = grpc.aio.insecure_channel(
            f"unix:{info.endpoint}", options=[("grpc.use_local_subchannel_pool", 1)]
        )
        plugin = _Plugin(record, channel, DraClient(channel, chosen))
        plugin.connected()  # connects now, as the kubelet's conn.Connect() does
        if not self.plugins_per_driver:
            # 1.32: the new registration replaces the driver's plugin (its connection is left).
            for replaced in self._plugins.pop(info.name, []):
                if replaced.health is not None:
                    replaced.health.cancel()
        self._plugins.setdefault(info.name, []).append(plugin)
        health = pick_health_service(self.services, info.supported_versions)
        if health is not None and self._tg is not None:
            plugin.health = self._follow_health(info.name, channel, health)
        # A plugin of the driver is back: a pending wipe of its slices is cancelled.
        pending = self._wipes.pop(info.name, None)
        if pending is not None:
            pending.cancel()
        self.registrations.append(record)
        self._notify()
        return None

    async def deregister(self, socket: Path) -> None:
        """The registration socket is gone: DeRegisterPlugin."""
        if not self.plugins_per_driver:
            await self._deregister_by_name(socket)
            return
        for driver, plugins in list(self._plugins.items()):
            for plugin in list(plugins):
                if plugin.registration.socket != str(socket):
                    continue
                plugins.remove(plugin)
                await plugin.close(f"DRA driver {driver} deregistered")
                if not plugins:
                    del self._plugins[driver]
                    self.health.clear(driver)
                    self._schedule_wipe(driver)
        self._notify()

    async def _deregister_by_name(self, socket: Path) -> None:
        """1.32's DeRegisterPlugin: the driver whose socket went is forgotten by name, whichever
        of its plugins registered last."""
        driver = next(
            (r.driver for r in reversed(self.registrations) if r.socket == str(socket)), None
        )
        for plugin in self._plugins.pop(driver, []) if driver is not None else []:
            await plugin.close(f"DRA driver {driver} deregistered")
        if driver is not None:
            self.health.clear(driver)
            self._schedule_wipe(driver)
        self._notify()

    def _follow_health(
        self, driver: str, channel: grpc.aio.Channel, service: str
    ) -> anyio.CancelScope:
        scope = anyio.CancelScope()

        async def follow() -> None:
            try:
                with scope:
                    await self.health.follow(driver, channel, service)
            except anyio.get_cancelled_exc_class():
                if not scope.cancel_called:
                    raise
                # The plugin went: grpc.aio ends the stream on the closed channel with a
                # CancelledError of its own, which the scope does not take for its own (left to
                # escape, it would stop the whole kubelet, every other plugin with it).

        assert self._tg is not None
        self._tg.start_soon(follow)
        return scope

    def _schedule_wipe(self, driver: str) -> None:
        if self.api is None or self._tg is None or driver in self._wipes:
            return
        scope = anyio.CancelScope()
        self._wipes[driver] = scope
        api = self.api

        async def wipe() -> None:
            with scope:
                await anyio.sleep(self.wiping_delay)
                api.wipe_slices(self.node_name, driver)
                log.info("deleted the ResourceSlices of DRA driver %s (gone)", driver)
            if self._wipes.get(driver) is scope:
                del self._wipes[driver]

        self._tg.start_soon(wipe)

    def is_registered(self, driver: str) -> bool:
        """Whether a plugin of ``driver`` is registered."""
        return bool(self._plugins.get(driver))

    def endpoint(self, driver: str) -> str | None:
        """The endpoint the next call for ``driver`` goes to, if any plugin is registered."""
        plugins = self._plugins.get(driver)
        return self._plugin(driver).registration.endpoint if plugins else None

    def successful_registrations(self, driver: str) -> list[DraRegistration]:
        return [r for r in self.registrations if r.driver == driver and r.error is None]

    def _plugin(self, driver: str) -> _Plugin:
        plugins = self._plugins.get(driver)
        if not plugins:
            raise PodPreparationError(f"DRA driver {driver} is not registered")
        # The most recent connected plugin, else the most recent one (DRAPluginManager.get).
        for plugin in reversed(plugins):
            if plugin.connected():
                return plugin
        return plugins[-1]

    # ------------------------------------------------------------------ pods

    def pod(
        self, namespace: str, name: str, claims: Sequence[str], *, uid: str | None = None
    ) -> DraPod:
        """A pod using ``claims`` (names of ResourceClaims in ``namespace``).

        Args:
            namespace: The pod's namespace, and its claims'.
            name: The pod's name.
            claims: The names of the ResourceClaims it uses.
            uid: Its UID (the same pod seen again, or two pods of one UID); None: a new one.

        Returns:
            The pod, to reserve claims for (``MemoryApi.allocate(pods=[pod.uid])``) and prepare.
        """
        if uid is None:
            return DraPod(namespace, name, tuple(claims))
        return DraPod(namespace, name, tuple(claims), uid)

    async def prepare(self, pod: DraPod) -> PreparedPod:
        """PrepareResources for ``pod``, as the kubelet does before its containers start.

        Raises:
            PodPreparationError: with the kubelet's message; the pod does not start.
        """
        batches: dict[str, list[ClaimRef]] = {}
        infos: dict[str, _ClaimInfo] = {}
        for name in pod.claims:
            info = await self._claim_info(pod, name)
            info.pods.add(pod.uid)
            if info.prepared:
                continue
            infos[info.claim.uid] = info
            for driver in info.drivers:
                batches.setdefault(driver, []).append(info.claim)
        for driver, refs in batches.items():
            self._record_call("NodePrepareResources", driver, refs)
            plugin = self._plugin(driver)
            results = await plugin.call(
                "NodePrepareResources", plugin.client.prepare(refs, self.call_timeout)
            )
            errors = {uid: result.error for uid, result in results.items()}
            for uid, info_for in _answered("NodePrepareResources", refs, infos, errors):
                info_for.devices[driver] = results[uid].devices
        for info in infos.values():
            info.prepared = True
        self._notify()
        return PreparedPod(
            pod,
            {
                name: tuple(
                    d
                    for devices in self._claims[(pod.namespace, name)].devices.values()
                    for d in devices
                )
                for name in pod.claims
            },
        )

    async def _claim_info(self, pod: DraPod, name: str) -> _ClaimInfo:
        info = self._claims.get((pod.namespace, name))
        if self.api is None:
            if info is None:
                raise PodPreparationError(f"no API to read ResourceClaim {name} of pod {pod.name}")
            return info
        try:
            claim = await self.api.read_claim(pod.namespace, name)
        except KubeApiError as exc:
            raise PodPreparationError(
                f"failed to fetch ResourceClaim {name} referenced by pod {pod.name}: {exc.reason}"
            ) from None
        if pod.uid not in claim.reserved_for:
            raise PodPreparationError(
                f"pod {pod.name}({pod.uid}) is not allowed to use resource claim "
                f"{name}({claim.uid})"
            )
        if info is None or info.claim.uid != claim.uid:
            drivers = tuple(dict.fromkeys(r.driver for r in claim.results))
            info = _ClaimInfo(ClaimRef(claim.namespace, claim.uid, claim.name), drivers)
            self._claims[(pod.namespace, name)] = info
        return info

    async def unprepare(self, pod: DraPod) -> None:
        """UnprepareResources for ``pod`` (it ended): claims no other pod uses are unprepared.

        Raises:
            PodPreparationError: with the kubelet's message; it tries again later.
        """
        batches: dict[str, list[ClaimRef]] = {}
        infos: dict[str, _ClaimInfo] = {}
        for name in pod.claims:
            info = self._claims.get((pod.namespace, name))
            if info is None:
                continue
            if info.pods - {pod.uid}:
                info.pods.discard(pod.uid)
                continue
            infos[info.claim.uid] = info
            for driver in info.drivers:
                batches.setdefault(driver, []).append(info.claim)
        for driver, refs in batches.items():
            self._record_call("NodeUnprepareResources", driver, refs)
            plugin = self._plugin(driver)
            errors = await plugin.call(
                "NodeUnprepareResources", plugin.client.unprepare(refs, self.call_timeout)
            )
            for _uid, info_for in _answered("NodeUnprepareResources", refs, infos, errors):
                del self._claims[(info_for.claim.namespace, info_for.claim.name)]
        self._notify()

    def _record_call(self, method: str, driver: str, refs: Sequence[ClaimRef]) -> None:
        self.calls.append((method, driver, tuple(r.uid for r in refs)))

    def prepared_claims(self) -> list[ClaimRef]:
        """The claims the kubelet holds as prepared."""
        return [info.claim for info in self._claims.values() if info.prepared]

    def forget_prepared(self) -> None:
        """Forget which claims are prepared, as a kubelet that lost its state before recording
        the drivers' answers: its next ``prepare`` of a pod asks the drivers again."""
        self._claims.clear()


def _answered(
    method: str,
    refs: Sequence[ClaimRef],
    infos: Mapping[str, _ClaimInfo],
    errors: Mapping[str, str],
) -> Iterator[tuple[str, _ClaimInfo]]:
    """Each claim a driver answered for, checked as the kubelet checks it: a result for a claim
    it did not ask about, a claim's error, or a claim left out fails the pod's call."""
    for uid, error in errors.items():
        info = infos.get(uid)
        if info is None:
            raise PodPreparationError(f"{method} returned result for unknown claim UID {uid}")
        if error:
            raise PodPreparationError(
                f"{method} failed for claim {info.claim.namespace}/{info.claim.name}: {error}"
            )
        yield uid, info
    unfinished = len(refs) - len(errors)
    if unfinished:
        raise PodPreparationError(f"{method} left out {unfinished} claims")


def _with_error(record: DraRegistration, error: str) -> DraRegistration:
    return dataclasses.replace(record, error=error)
