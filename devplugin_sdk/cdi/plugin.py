"""``use_cdi``: the wrapper that lets any ``DevicePlugin`` hand out CDI names instead of raw
nodes, mounts and env, advertising a device only once its name resolves, and retrying a spec
write that failed with backoff.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path

import anyio
import anyio.to_thread
from anyio.streams.memory import MemoryObjectSendStream

from devplugin_sdk._backoff import Backoff
from devplugin_sdk.cdi.files import DEFAULT_SPEC_DIR, _SpecFile, _target
from devplugin_sdk.cdi.spec import CdiSpec
from devplugin_sdk.errors import BackendError
from devplugin_sdk.plugin import DevicePlugin
from devplugin_sdk.types import Allocation, Device, Health, HealthEvent, RescanEvent

__all__ = ["CdiPlugin", "use_cdi"]

log = logging.getLogger("devplugin_sdk")

# A failed spec write is retried after 0.25 s, then twice as long each time, up to every 10 s:
# a small file, cheap to try, and the devices it covers wait for it.
_RETRY_FIRST = 0.25
_RETRY_MAX = 10.0
# The same failure is logged again after this many seconds (a new reason at once).
_LOG_AGAIN_AFTER = 60.0


class _Retry:
    """Backoff for a spec write that failed: what waits, when to try again, what to log."""

    def __init__(self) -> None:
        self.pending: CdiSpec | None = None
        self.attempts = 0  # failed attempts at the pending write
        self._since = 0.0
        self._backoff = Backoff(_RETRY_FIRST, _RETRY_MAX)
        self._reason = ""
        self._logged = 0.0
        self._wake: anyio.Event | None = None

    def failed(self, spec: CdiSpec, reason: str) -> bool:
        """Record a failed write of ``spec``; whether to log it (a new reason, or a while
        since the last log)."""
        now = time.monotonic()
        if self.pending is None:
            self.attempts, self._since, self._reason = 0, now, ""
            self._backoff.reset()
        self.pending = spec
        self.attempts += 1
        if self._wake is not None:
            self._wake.set()
        if reason != self._reason or now - self._logged >= _LOG_AGAIN_AFTER:
            self._reason, self._logged = reason, now
            return True
        return False

    def succeeded(self) -> tuple[int, float] | None:
        """Clear the pending write; the failed attempts and the seconds they took, if any."""
        if self.pending is None:
            return None
        self.pending = None
        return self.attempts, time.monotonic() - self._since

    def cancel(self) -> None:
        """Nothing to write any more (no device has edits, or serving stops)."""
        self.pending = None

    async def next_delay(self) -> float:
        """Wait until a write is pending; then the delay before the next attempt."""
        while self.pending is None:
            self._wake = anyio.Event()
            await self._wake.wait()
        return self._backoff.next()


class CdiPlugin(DevicePlugin):
    """Serve another plugin through CDI: its devices' nodes, mounts and env go into a spec file,
    and Allocate answers with CDI names. Create it with ``use_cdi``.

    * ``discover()`` calls the wrapped plugin's and writes the spec before returning, so every
      device the kubelet can hand out already resolves (rewritten only when it changed, removed
      when no device has edits);
    * a spec that cannot be written (a full disk, another live instance owning the file) does
      not fail discovery: the devices it would name are held back, the write is retried with
      backoff, and a rescan advertises them once it succeeds. The kubelet is never told of a
      device whose CDI name does not resolve to its edits;
    * ``allocate()`` calls the wrapped plugin's and returns the allocated devices' CDI names, its
      annotations and whatever its allocation adds beyond the devices' declared nodes, mounts and
      env (an allocation-wide variable such as a joined device list);
    * health, preferred allocation and pre-start hooks are the wrapped plugin's; the kubelet
      options follow what it overrides. ``watch()`` is the wrapped plugin's events plus the
      rescan that follows a retried write;
    * one live plugin owns a spec file (a lock beside it); it removes temporary files that a
      killed writer left, and when serving stops it removes the spec (``remove_on_exit``) only
      if the file there is still the one it wrote.

    Attributes:
        plugin: The wrapped plugin.
        kind: The CDI kind.
        spec_path: Where the spec is written.
        spec_env: Whether devices' env goes in the spec (else through Allocate).
    """

    def __init__(
        self,
        plugin: DevicePlugin,
        kind: str | None = None,
        *,
        directory: Path = DEFAULT_SPEC_DIR,
        spec_name: str | None = None,
        spec_env: bool | None = None,
        remove_on_exit: bool = True,
    ) -> None:
        """See ``use_cdi``."""
        if isinstance(plugin, CdiPlugin):
            raise TypeError(f"{plugin.resource_name}: the plugin already uses CDI")
        super().__init__(resource_name=plugin.resource_name, socket_name=plugin.socket_name)
        self.plugin = plugin
        self.health_interval = plugin.health_interval
        self.rescan_interval = plugin.rescan_interval
        self.kind = kind if kind is not None else plugin.resource_name
        self.spec_path = _target(CdiSpec(self.kind), Path(directory), spec_name)
        # A plugin with its own allocate() may compute env over the whole allocation (a joined
        # device list), which per-device edits cannot express: its env then goes via Allocate.
        self.spec_env = not plugin.overrides("allocate") if spec_env is None else spec_env
        self.remove_on_exit = remove_on_exit
        self._file = _SpecFile(self.spec_path)
        self._written: CdiSpec | None = None  # what the spec file holds, as this process wrote it
        self._names: dict[str, str] = {}
        self._warned: set[str] = set()
        self._lock = anyio.Lock()
        self._retry = _Retry()
        self._extra = {"resource": self.resource_name}

    def overrides(self, hook: str) -> bool:
        """The wrapped plugin's hooks decide the kubelet options and what runs; ``watch`` always
        runs (it retries failed spec writes)."""
        return hook == "watch" or self.plugin.overrides(hook)

    @property
    def allocate_is_merge(self) -> bool:
        """False: ``allocate`` answers CDI names, whatever the wrapped plugin's is."""
        return False

    def fingerprint(self) -> str:
        """The wrapped plugin's fingerprint and the CDI settings: a configuration reload
        restarts the resource only when one of them changed."""
        cdi = f"{self.kind}|{self.spec_path}|{self.spec_env}|{self.remove_on_exit}"
        return f"cdi({cdi})|{self.plugin.fingerprint()}"

    @property
    def names(self) -> Mapping[str, str]:
        """CDI name by device ID for the devices in the spec file this plugin wrote."""
        return dict(self._names)

    async def discover(self) -> Sequence[Device]:
        """Discover through the wrapped plugin, then publish the spec.

        Returns:
            The wrapped plugin's devices, less those whose edits are not in the spec file yet
            (its write failed: they are advertised after a retry succeeds).

        Raises:
            BackendError: a device ID is not a valid CDI name.
        """
        devices = await self.plugin.discover()
        try:
            spec = CdiSpec.from_devices(self.kind, devices, env=self.spec_env)
        except ValueError as exc:
            raise BackendError(f"{self.resource_name}: {exc}") from None
        async with self._lock:
            if spec.devices:
                await self._publish(spec)
            else:
                await self._withdraw()
            return self._resolvable(devices, spec)

    def _resolvable(self, devices: Sequence[Device], spec: CdiSpec) -> list[Device]:
        """The devices the kubelet may see: no CDI edits, or their edits are in the file."""
        written = self._written.devices if self._written is not None else {}
        shown = [d for d in devices if spec.devices.get(d.id) in (None, written.get(d.id))]
        if len(shown) < len(devices):
            log.warning(
                "%s: devices held back until the CDI spec %s is written: %d of %d",
                self.resource_name,
                self.spec_path,
                len(devices) - len(shown),
                len(devices),
                extra=self._extra,
            )
        return shown

    async def _publish(self, spec: CdiSpec) -> bool:
        """Write ``spec`` (holding ``_lock``); on failure schedule a retry. Whether it worked."""
        try:
            changed, stale = await anyio.to_thread.run_sync(self._file.publish, spec.to_json())
        except OSError as exc:
            self._failed(spec, exc)
            return False
        if stale:
            log.info(
                "%s: removed %d temporary files an interrupted write left beside %s",
                self.resource_name,
                stale,
                self.spec_path,
                extra=self._extra,
            )
        self._written = spec
        self._names = {name: spec.qualified(name) for name in spec.devices}
        recovered = self._retry.succeeded()
        if recovered is not None:
            attempts, seconds = recovered
            log.info(
                "%s: CDI spec %s written after %d failed attempts over %.1fs (%d devices)",
                self.resource_name,
                self.spec_path,
                attempts,
                seconds,
                len(spec.devices),
                extra=self._extra,
            )
        elif changed:
            log.info(
                "%s: CDI spec %s written (%d devices)",
                self.resource_name,
                self.spec_path,
                len(spec.devices),
                extra=self._extra,
            )
        return True

    def _failed(self, spec: CdiSpec, exc: OSError) -> None:
        if not self._file.written:
            # Not the file this process wrote any more (another writer's, or gone): its
            # names may not resolve, so no device with edits is advertised until a write.
            self._written = None
            self._names = {}
        written = self._written.devices if self._written is not None else {}
        waiting = sum(1 for name, edits in spec.devices.items() if written.get(name) != edits)
        # The temporary file's name changes with every attempt: keep it out of the message.
        reason = exc.strerror or str(exc)
        level = logging.ERROR if self._retry.failed(spec, reason) else logging.DEBUG
        log.log(
            level,
            "%s: cannot write CDI spec %s: %s (devices waiting for it: %d; attempt %d); retrying",
            self.resource_name,
            self.spec_path,
            reason,
            waiting,
            self._retry.attempts,
            extra=self._extra,
        )

    async def _withdraw(self) -> None:
        """No device has edits: remove the spec this process wrote (CDI forbids empty specs)."""
        self._retry.cancel()
        self._written = None
        self._names = {}
        try:
            outcome = await anyio.to_thread.run_sync(self._file.remove)
        except OSError as exc:
            log.warning(
                "%s: cannot remove CDI spec %s: %s",
                self.resource_name,
                self.spec_path,
                exc,
                extra=self._extra,
            )
            return
        if outcome == "removed":
            log.info(
                "%s: CDI spec %s removed (no device has container edits)",
                self.resource_name,
                self.spec_path,
                extra=self._extra,
            )

    async def check_health(self, devices: Sequence[Device]) -> Mapping[str, Health]:
        return await self.plugin.check_health(devices)

    async def watch(self) -> AsyncIterator[HealthEvent | RescanEvent]:
        """The wrapped plugin's events, and a rescan after a failed spec write succeeds."""
        send, receive = anyio.create_memory_object_stream[HealthEvent | RescanEvent | Exception]()
        # anyio forbids holding a task group across a yield in an async generator (the SDK
        # closes it inside a shielded scope of its own), so the two sources run in one task of
        # their own, created and awaited by this generator (the SDK runs on asyncio: grpc.aio).
        sources = asyncio.ensure_future(self._sources(send))
        error: BaseException | None = None
        try:
            async with receive:
                async for item in receive:
                    if isinstance(item, Exception):
                        raise item  # the wrapped watch() failed: the SDK restarts this one
                    yield item
        finally:
            sources.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.wait({sources})
            if not sources.cancelled():
                error = sources.exception()
        if error is not None:  # the stream only ends when the sources themselves failed
            raise error

    async def _sources(
        self, send: MemoryObjectSendStream[HealthEvent | RescanEvent | Exception]
    ) -> None:
        async with send, anyio.create_task_group() as tg:
            tg.start_soon(self._retry_writes, send.clone())
            if self.plugin.overrides("watch"):
                tg.start_soon(self._forward, send.clone())

    async def _forward(
        self, send: MemoryObjectSendStream[HealthEvent | RescanEvent | Exception]
    ) -> None:
        """The wrapped plugin's events, then its error if it fails."""
        async with send:
            try:
                events = self.plugin.watch()
                try:
                    async for event in events:
                        await send.send(event)
                finally:
                    aclose = getattr(events, "aclose", None)
                    if aclose is not None:
                        with anyio.CancelScope(shield=True):
                            await aclose()
            except anyio.BrokenResourceError:
                pass
            except Exception as exc:  # reported through watch(), where the SDK logs it
                with contextlib.suppress(anyio.BrokenResourceError):
                    await send.send(exc)

    async def _retry_writes(
        self, send: MemoryObjectSendStream[HealthEvent | RescanEvent | Exception]
    ) -> None:
        """Retry a failed spec write with backoff; ask for a rescan once it is written."""
        async with send:
            while True:
                delay = await self._retry.next_delay()
                await anyio.sleep(delay)
                async with self._lock:
                    spec = self._retry.pending
                    done = spec is not None and await self._publish(spec)
                if done:
                    reason = f"CDI spec {self.spec_path} written: advertising its devices"
                    with contextlib.suppress(anyio.BrokenResourceError):
                        await send.send(RescanEvent(reason))

    async def on_stop(self) -> None:
        """Remove the spec if still ours (``remove_on_exit``), release it, then let the
        wrapped plugin clean up."""
        try:
            async with self._lock:
                self._retry.cancel()
                outcome = await anyio.to_thread.run_sync(self._stop_blocking)
            if outcome == "removed":
                log.info(
                    "%s: CDI spec %s removed", self.resource_name, self.spec_path, extra=self._extra
                )
            elif outcome == "replaced":
                log.info(
                    "%s: CDI spec %s was replaced by another writer; left in place",
                    self.resource_name,
                    self.spec_path,
                    extra=self._extra,
                )
        finally:
            await self.plugin.on_stop()

    def _stop_blocking(self) -> str:
        try:
            return self._file.remove() if self.remove_on_exit else "kept"
        except OSError as exc:
            log.warning(
                "%s: cannot remove CDI spec %s: %s",
                self.resource_name,
                self.spec_path,
                exc,
                extra=self._extra,
            )
            return "failed"
        finally:
            self._file.release()

    async def allocate(self, devices: Sequence[Device]) -> Allocation:
        """CDI names for the devices, plus what the wrapped allocation adds beyond the spec.

        Raises:
            AllocationError: from the wrapped plugin.
        """
        inner = await self.plugin.allocate(devices)
        named = [d for d in devices if d.id in self._names]
        nodes = {n.container_path for d in named for n in d.device_nodes}
        mounts = {m.container_path for d in named for m in d.mounts}
        declared: dict[str, str] = {}
        if self.spec_env:
            for d in named:
                declared.update(d.env)
        env: dict[str, str] = {}
        for key, value in inner.env.items():
            if key not in declared:
                env[key] = value
            elif declared[key] != value and key not in self._warned:
                self._warned.add(key)
                log.warning(
                    "%s: allocate() sets %s to a value that differs from the devices' env in the "
                    "CDI spec; the spec's value is used. Use use_cdi(..., spec_env=False) for "
                    "variables computed over the whole allocation",
                    self.resource_name,
                    key,
                    extra={"resource": self.resource_name},
                )
        cdi = [self._names[d.id] for d in named]
        return Allocation(
            device_nodes=tuple(n for n in inner.device_nodes if n.container_path not in nodes),
            mounts=tuple(m for m in inner.mounts if m.container_path not in mounts),
            env=env,
            annotations=dict(inner.annotations),
            cdi_devices=tuple(dict.fromkeys([*cdi, *inner.cdi_devices])),
        )

    async def preferred_allocation(
        self, available: Sequence[Device], must_include: Sequence[Device], size: int
    ) -> Sequence[str]:
        return await self.plugin.preferred_allocation(available, must_include, size)

    async def pre_start_container(self, devices: Sequence[Device]) -> None:
        await self.plugin.pre_start_container(devices)


def use_cdi(
    plugin: DevicePlugin,
    kind: str | None = None,
    *,
    directory: Path = DEFAULT_SPEC_DIR,
    spec_name: str | None = None,
    spec_env: bool | None = None,
    remove_on_exit: bool = True,
) -> CdiPlugin:
    """Serve ``plugin`` through CDI (see ``CdiPlugin``)::

        plugins = [use_cdi(p) for p in generic.from_config(config)]
        devplugin_sdk.run(*plugins)

    Args:
        plugin: Any plugin, e.g. one a backend's ``from_config`` returned.
        kind: The CDI kind ``vendor.com/class``; the resource name by default.
        directory: The CDI spec directory the container runtime reads.
        spec_name: The spec file name; ``<vendor>-<class>.json`` by default. Give each plugin
            its own kind or file name: one file is one spec.
        spec_env: True puts each device's env in the spec; False leaves env out of the spec
            and returns the plugin's allocation env from Allocate instead, which is right when
            ``allocate()`` computes variables over all the allocated devices (the nvidia and
            rdma backends do). None (the default): False when the plugin overrides
            ``allocate()``, True otherwise.
        remove_on_exit: Remove the spec when serving stops. Running containers are not affected
            (the runtime resolves CDI names when it creates a container), but a container that
            restarts while no plugin serves cannot resolve its names until the spec is back.

    Returns:
        The wrapping plugin, to serve in place of ``plugin``.

    Raises:
        ValueError: a bad kind or file name.
        TypeError: ``plugin`` is already a ``CdiPlugin``.
    """
    return CdiPlugin(
        plugin,
        kind,
        directory=directory,
        spec_name=spec_name,
        spec_env=spec_env,
        remove_on_exit=remove_on_exit,
    )
