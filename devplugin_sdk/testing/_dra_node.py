"""``DraNode``: one node for a DRA test: the fake kubelet with its DRA side, the in-memory API and
the running driver, ready when entered.

Every DRA test opened with the same ten lines (API, kubelet, the driver's directories, serving,
two waits) and then rebuilt claims, pods and CDI spec paths by hand; this holds them once, for
the SDK's tests and for authors' (the ``served_driver`` fixture yields one).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import anyio.abc

from devplugin_sdk.dra import Dra
from devplugin_sdk.dra._claims.files import claim_spec_name
from devplugin_sdk.dra.resources import DeviceConfig, ResourceClaim, SliceDevice
from devplugin_sdk.kubelet.fake import FakeKubelet
from devplugin_sdk.kubelet.fake_dra import DraPod, PreparedPod
from devplugin_sdk.kubelet.memory_api import MemoryApi
from devplugin_sdk.observe import DraStatus
from devplugin_sdk.plugin import DevicePlugin
from devplugin_sdk.runner import Running, raise_errors
from devplugin_sdk.testing._daemonset import DaemonSetPod
from devplugin_sdk.types import Quantity

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup  # type: ignore[import-not-found,unused-ignore]

__all__ = ["ClaimSpec", "DraNode"]

_DRA_FIELDS = frozenset(f.name for f in dataclasses.fields(Dra))


@dataclass(frozen=True, slots=True)
class ClaimSpec:
    """A prepared claim's CDI spec, as the driver wrote it for the container runtime.

    Attributes:
        path: The spec file (``k8s.<driver>-claim_<uid>.json`` in the driver's CDI directory).
        content: The spec, parsed (``cdiVersion``, ``kind``, ``devices``, ...).
    """

    path: Path
    content: dict[str, Any]

    @property
    def devices(self) -> list[dict[str, Any]]:
        """The spec's CDI devices, each with its ``name`` and ``containerEdits``."""
        devices: list[dict[str, Any]] = self.content["devices"]
        return devices


class DraNode:
    """A node for a DRA test: ``FakeKubelet`` with its DRA side, ``MemoryApi`` and the driver
    serving ``plugins``, as an ``async with``.

    Entered, the driver's pool is published and the kubelet has registered it; the driver stops
    (as on SIGTERM), then the kubelet, on exit. An error that stops serving is raised from the
    ``async with``, as ``serving`` raises it. Without plugins it holds the kubelet and the API
    only (serve instances yourself, e.g. ``DaemonSetPod(..., api="dra", dra=node.options)``).

    Args:
        *plugins: The plugins the driver serves.
        driver: The DRA driver's name (``Dra.driver``).
        memory: The in-memory API; None: a new one holding the kubelet's node.
        kubelet: A kubelet to use (entered by the caller, its ``dra_api`` set); None: a new one.
        kubelet_options: ``FakeKubelet``'s arguments for a new one (``dra_plugins_per_driver``,
            ``dra_services``, ...).
        settings: Overrides of ``kubelet.settings()`` for the driver's process.
        device_plugin_api: Serve the device-plugin API too (``serve(api="both")``).
        ready: Wait, on entering and after ``stopped()``, until the pool is published and the
            driver registered; False: only until the plugins have discovered their devices.
        timeout: How long each wait of the node waits.
        **options: ``Dra``'s fields (``cleanup_interval=``, ``devices=``, ``api=`` for another
            client of ``memory``, ...) over the node's defaults (its node, ``memory``, a plugin
            and a CDI directory beside the kubelet's), and ``serve``'s other arguments
            (``observer=``, ``http=``, ``reload=``).

    Attributes:
        kubelet: The fake kubelet (``kubelet.dra``: its DRA manager).
        api: The in-memory API, where claims and slices live.
        options: The driver's ``Dra`` (set once entered).
        running: ``serve``'s ``Running`` of the driver (set while it runs).

    Example::

        async with DraNode(StaticPlugin("acme.com/widget", widgets), driver=DRIVER) as node:
            pod = node.pod("gpus")
            claim = node.claim("gpus", {"widgets": ["w0"]}, pods=[pod])
            await node.prepare(pod)
            assert node.spec(claim).devices[0]["containerEdits"]["deviceNodes"]
    """

    def __init__(
        self,
        *plugins: DevicePlugin,
        driver: str,
        memory: MemoryApi | None = None,
        kubelet: FakeKubelet | None = None,
        kubelet_options: Mapping[str, Any] | None = None,
        settings: Mapping[str, Any] | None = None,
        device_plugin_api: bool = False,
        ready: bool = True,
        timeout: float = 10.0,
        **options: Any,
    ) -> None:
        self.plugins = plugins
        self.driver = driver
        self._own_kubelet = kubelet is None
        if kubelet is None:
            node_name = (kubelet_options or {}).get("node_name", "node-1")
            memory = memory if memory is not None else MemoryApi(nodes=[node_name])
            kubelet = FakeKubelet(dra_api=memory, **(kubelet_options or {}))
        elif memory is None:
            memory = kubelet.dra.api
        if memory is None:
            raise ValueError("DraNode needs a MemoryApi: pass memory=, or a kubelet with dra_api=")
        self.kubelet = kubelet
        self.api = memory
        self._settings = dict(settings or {})
        self._api_kind = "both" if device_plugin_api else "dra"
        self._wait = ready
        self.timeout = timeout
        self._dra_options = {k: v for k, v in options.items() if k in _DRA_FIELDS}
        self._serve_options = {k: v for k, v in options.items() if k not in _DRA_FIELDS}
        self._options: Dra | None = None
        self._running: Running | None = None
        self._pod: DaemonSetPod | None = None
        self._tg: anyio.abc.TaskGroup | None = None

    # ------------------------------------------------------------------ the node's life

    async def __aenter__(self) -> DraNode:
        self._cm = self._serve()
        return await self._cm.__aenter__()

    async def __aexit__(self, *exc_info: Any) -> bool | None:
        return await self._cm.__aexit__(*exc_info)

    @asynccontextmanager
    async def _serve(self) -> AsyncIterator[DraNode]:
        try:
            async with AsyncExitStack() as stack:
                if self._own_kubelet:
                    await stack.enter_async_context(self.kubelet)
                self._options = self._dra(self._dra_options)
                async with anyio.create_task_group() as tg:
                    self._tg = tg
                    try:
                        if self.plugins:
                            await self._start()
                        yield self
                    finally:
                        tg.cancel_scope.cancel()
                        self._running = None
        except BaseExceptionGroup as group:
            raise_errors(group)

    def _dra(self, overrides: Mapping[str, Any]) -> Dra:
        root = self.kubelet.directory.parent
        values: dict[str, Any] = {
            "driver": self.driver,
            "node_name": self.kubelet.node_name,
            "api": self.api,
            "plugin_dir": root / "plugins" / self.driver,
            "cdi_dir": root / "cdi",
            **overrides,
        }
        return Dra(**values)

    async def _start(self) -> None:
        assert self._tg is not None
        settings = {"pod_uid": "", **self._settings}
        self._pod = DaemonSetPod(
            *self.plugins,
            settings=self.kubelet.settings(**settings),
            api=self._api_kind,
            dra=self.options,
            **self._serve_options,
        )
        self._running = await self._pod.start(self._tg)
        if self._wait:
            await self.ready()

    @asynccontextmanager
    async def stopped(self, *plugins: DevicePlugin) -> AsyncIterator[None]:
        """Stop the driver (SIGTERM) for the body of an ``async with`` and start it again after
        it, ready: a driver restart, the kubelet and the API kept.

        Args:
            *plugins: What the restarted driver serves (new objects, as a new process has);
                none: the same plugin objects again.
        """
        assert self._pod is not None, "DraNode.stopped: no driver is running"
        await self._pod.stop()
        self._running = None
        yield
        if plugins:
            self.plugins = plugins
        await self._start()

    async def ready(self) -> None:
        """Wait until the driver's pool is published and the kubelet has registered the driver
        (and, for the node's own driver, until its status says so too).

        Raises:
            TimeoutError: naming what was missing, after the node's ``timeout``.
        """
        node = self.node_name
        await self.kubelet.wait_for(
            lambda: self.api.pool_complete(self.driver, node),
            timeout=self.timeout,
            what=f"the pool of {self.driver} on {node} published",
        )
        await self.kubelet.wait_for(
            lambda: self.kubelet.dra.is_registered(self.driver),
            timeout=self.timeout,
            what=f"DRA driver {self.driver} registered",
        )
        if self._running is not None:
            running = self._running
            # The driver's own view (its /healthz) follows the kubelet's GetInfo a moment later.
            await self.kubelet.wait_for(
                lambda: running.dra is not None and running.dra.registered,
                timeout=self.timeout,
                what=f"DRA driver {self.driver} reporting itself registered",
            )

    # ------------------------------------------------------------------ what tests read

    @property
    def node_name(self) -> str:
        """The kubelet's node (and the driver's pool)."""
        return self.kubelet.node_name

    @property
    def options(self) -> Dra:
        """The driver's ``Dra`` (its directories: ``options.cdi_dir``, ``resolved_plugin_dir``)."""
        if self._options is None:
            raise RuntimeError("DraNode.options: enter the node first (async with)")
        return self._options

    @property
    def running(self) -> Running:
        """``serve``'s ``Running`` of the driver.

        Raises:
            RuntimeError: while no driver runs (no plugins, or inside ``stopped()``).
        """
        if self._running is None:
            raise RuntimeError("DraNode.running: no driver is running")
        return self._running

    @property
    def status(self) -> DraStatus:
        """The driver's ``DraStatus`` (``running.dra``), as its /healthz reports it."""
        status = self.running.dra
        assert status is not None
        return status

    def published(self) -> dict[str, SliceDevice]:
        """The devices of the driver's pool in the API, by name, over every slice."""
        return {d.name: d for s in self.api.pool(self.driver, self.node_name) for d in s.devices}

    # ------------------------------------------------------------------ claims and pods

    def pod(
        self,
        *claims: str,
        name: str | None = None,
        namespace: str = "default",
        uid: str | None = None,
    ) -> DraPod:
        """A pod using ``claims`` (``FakeDra.pod``).

        Args:
            *claims: The names of the ResourceClaims it uses.
            name: The pod's name; None: ``pod-`` and its claims' names.
            namespace: The pod's namespace, and its claims'.
            uid: Its UID; None: a new one.

        Returns:
            The pod, to reserve claims for (``claim(pods=[pod])``) and prepare.
        """
        pod_name = name if name is not None else "pod-" + "-".join(claims)
        return self.kubelet.dra.pod(namespace, pod_name, claims, uid=uid)

    def claim(
        self,
        name: str,
        devices: Mapping[str, Sequence[str]] | Sequence[str],
        *,
        pods: Sequence[DraPod | str] = (),
        namespace: str = "default",
        request: str = "devices",
        config: Sequence[DeviceConfig] = (),
        capacity: Mapping[str, Mapping[str, Quantity]] | None = None,
        admin_access: bool = False,
        check: bool = True,
    ) -> ResourceClaim:
        """A ResourceClaim allocated on the driver's pool and reserved for ``pods``, as the
        scheduler leaves it (``MemoryApi.allocate``).

        Args:
            name: The claim's name (created if it does not exist).
            devices: Device names by request name; a list: all for one request, ``request``.
            pods: The pods (or their UIDs) it is reserved for.
            namespace: The claim's namespace.
            request: The request's name when ``devices`` is a list.
            config: The allocation's opaque configuration entries (classes' first).
            capacity: The amounts each request asks (shares), by request name.
            admin_access: Allocate for admin access.
            check: Refuse what the scheduler would not allocate; False allocates anyway.

        Returns:
            The allocated claim (its ``uid`` names its CDI spec: ``spec(claim)``).

        Raises:
            KubeApiError: what the scheduler would refuse (a device in use, capacity or
                counters exhausted), with ``check``.
        """
        requests = devices if isinstance(devices, Mapping) else {request: list(devices)}
        return self.api.allocate(
            namespace,
            name,
            requests,
            driver=self.driver,
            pool=self.node_name,
            pods=[p if isinstance(p, str) else p.uid for p in pods],
            config=config,
            capacity=capacity,
            admin_access=admin_access,
            check=check,
        )

    async def prepare(self, pod: DraPod) -> PreparedPod:
        """NodePrepareResources for ``pod``'s claims, as the kubelet calls it before the pod starts.

        Returns:
            What the kubelet holds for the pod (``cdi_ids(claim)``: its containers' CDI devices).

        Raises:
            PodPreparationError: with the kubelet's message; the pod does not start.
        """
        return await self.kubelet.dra.prepare(pod)

    async def unprepare(self, pod: DraPod) -> None:
        """NodeUnprepareResources for ``pod``'s claims that no other pod uses (the pod ended).

        Raises:
            PodPreparationError: with the kubelet's message.
        """
        await self.kubelet.dra.unprepare(pod)

    def spec_path(self, claim: ResourceClaim | str) -> Path:
        """Where the driver writes the CDI spec of ``claim`` (a claim or its UID); the file
        exists while the claim is prepared."""
        uid = claim if isinstance(claim, str) else claim.uid
        return self.options.cdi_dir / claim_spec_name(self.driver, uid)

    def spec(self, claim: ResourceClaim | str) -> ClaimSpec:
        """The CDI spec of a prepared ``claim`` (a claim or its UID): its path and content.

        Raises:
            FileNotFoundError: the claim is not prepared (or has no devices of this driver).
        """
        path = self.spec_path(claim)
        return ClaimSpec(path, json.loads(path.read_text()))
