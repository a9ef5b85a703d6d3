"""CDI (Container Device Interface) support: spec files, qualified names, and ``use_cdi``.

Owns the JSON a container runtime reads from ``/var/run/cdi`` (written atomically, removed on
shutdown) and the wrapper that lets any ``DevicePlugin`` hand out CDI names instead of raw nodes,
mounts and env. Format, name rules and version features were learned from the CDI spec and its Go
producer (cncf-tags/container-device-interface: SPEC.md, specs-go/version.go,
api/producer/identifiers.go, validator-default.go, writer.go, pkg/cdi/spec-dirs.go).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread

from devplugin_sdk.errors import BackendError
from devplugin_sdk.plugin import DevicePlugin
from devplugin_sdk.types import Allocation, Device, Health, HealthEvent, RescanEvent

__all__ = [
    "DEFAULT_SPEC_DIR",
    "CdiPlugin",
    "CdiSpec",
    "cdi_name",
    "remove_spec",
    "spec_file_name",
    "use_cdi",
    "validate_device_name",
    "validate_kind",
    "write_spec",
]

log = logging.getLogger("devplugin_sdk")

#: Where generated (as opposed to installed) specs go; runtimes also read /etc/cdi.
DEFAULT_SPEC_DIR = Path("/var/run/cdi")

# Runtimes load only *.json and *.yaml files from a spec directory (pkg/cdi/spec-dirs.go), so a
# temporary file with another suffix is never read half-written.
_SPEC_SUFFIXES = (".json", ".yaml")
_TMP_SUFFIX = ".tmp"
_FILE_MODE = 0o644


# --------------------------------------------------------------------------------- names


def _is_alnum(c: str) -> bool:
    return c.isascii() and c.isalnum()


def _check_vendor_or_class(what: str, name: str, kind: str) -> None:
    # Vendor and class: start with a letter, end with a letter or digit, and in between
    # letters, digits, '_', '-' and '.' (api/producer/identifiers.go).
    if not name:
        raise ValueError(f"CDI kind {kind!r}: the {what} is empty")
    if not (name[0].isascii() and name[0].isalpha()):
        raise ValueError(f"CDI kind {kind!r}: the {what} {name!r} must start with a letter")
    if not _is_alnum(name[-1]):
        raise ValueError(f"CDI kind {kind!r}: the {what} {name!r} must end with a letter or digit")
    bad = sorted({c for c in name if not (_is_alnum(c) or c in "_-.")})
    if bad:
        raise ValueError(
            f"CDI kind {kind!r}: the {what} {name!r} may only contain letters, digits, "
            f"'_', '-' and '.', not {''.join(bad)!r}"
        )


def validate_kind(kind: str) -> tuple[str, str]:
    """Check a CDI kind (``vendor.com/class``) with the CDI rules.

    Returns:
        The vendor and the class.

    Raises:
        ValueError: naming the rule that is broken.
    """
    vendor, slash, klass = kind.partition("/")
    if not slash or not vendor or not klass:
        raise ValueError(f"CDI kind {kind!r} must look like 'vendor.com/class'")
    _check_vendor_or_class("vendor", vendor, kind)
    _check_vendor_or_class("class", klass, kind)
    return vendor, klass


def validate_device_name(name: str) -> None:
    """Check a CDI device name: letters, digits, ``_ - . :``, starting and ending alphanumeric.

    Raises:
        ValueError: naming the rule that is broken.
    """
    # Device names may start with a digit since CDI 0.5.0 (specs-go/version.go, requiresV050).
    if not name:
        raise ValueError("CDI device name must not be empty")
    if not (_is_alnum(name[0]) and _is_alnum(name[-1])):
        raise ValueError(f"CDI device name {name!r} must start and end with a letter or digit")
    bad = sorted({c for c in name if not (_is_alnum(c) or c in "_-.:")})
    if bad:
        raise ValueError(
            f"CDI device name {name!r} may only contain letters, digits, '_', '-', '.' and ':', "
            f"not {''.join(bad)!r}"
        )


def cdi_name(kind: str, device: str) -> str:
    """The fully qualified CDI name ``vendor.com/class=device`` that Allocate returns.

    Raises:
        ValueError: if the kind or the device name breaks the CDI rules.
    """
    validate_kind(kind)
    validate_device_name(device)
    return f"{kind}={device}"


def spec_file_name(kind: str) -> str:
    """The default spec file name for ``kind``: ``<vendor>-<class>.json``, as the CDI producer
    names them (api/producer/spec-names.go).

    Raises:
        ValueError: if the kind breaks the CDI rules.
    """
    vendor, klass = validate_kind(kind)
    return f"{vendor}-{klass}.json"


# --------------------------------------------------------------------------------- the spec


def _check_edits(where: str, edits: Allocation) -> None:
    if edits.annotations or edits.cdi_devices:
        raise ValueError(
            f"{where}: CDI container edits carry device nodes, mounts and env only; "
            "annotations and CDI names belong in the Allocate response"
        )
    for key in edits.env:
        # The runtime splits "K=V" at the first '=' (pkg/cdi/container-edits.go, ValidateEnv).
        if not key or "=" in key or "\0" in key:
            raise ValueError(f"{where}: invalid environment variable name {key!r}")
        if "\0" in edits.env[key]:
            raise ValueError(f"{where}: environment variable {key} contains a NUL byte")


def _edits_empty(edits: Allocation) -> bool:
    return not (edits.device_nodes or edits.mounts or edits.env)


def _edits_json(edits: Allocation, *, env: bool = True) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if env and edits.env:
        out["env"] = [f"{k}={v}" for k, v in edits.env.items()]
    if edits.device_nodes:
        nodes = []
        for node in edits.device_nodes:
            entry: dict[str, Any] = {"path": node.container_path}
            if node.host_path != node.container_path:
                entry["hostPath"] = node.host_path  # a CDI 0.5.0 field; "path" when absent
            # An empty permissions string would mean "rwm" to the runtime; always be explicit.
            entry["permissions"] = node.permissions
            nodes.append(entry)
        out["deviceNodes"] = nodes
    if edits.mounts:
        # Bind mounts need "bind" or "rbind" in the OCI options; rbind is what CRI mounts use.
        out["mounts"] = [
            {
                "hostPath": m.host_path,
                "containerPath": m.container_path,
                "options": ["rbind", "ro"] if m.read_only else ["rbind"],
            }
            for m in edits.mounts
        ]
    return out


@dataclass(frozen=True)
class CdiSpec:
    """One CDI spec: a kind and the container edits of each of its devices.

    Each device's edits are an ``Allocation`` holding device nodes, mounts and env (the runtime
    applies them when a container asks for that device by its CDI name). ``common`` edits are
    applied once whenever any device of the spec is used.

    ``cdi_version`` is the oldest CDI version that has every feature the spec uses, so that older
    runtimes (containerd 1.7 ships an older CDI library) accept it: 0.3.0 by default; 0.5.0 when a
    device node's host path differs from its container path (``hostPath``) or a device name
    starts with a digit; 0.6.0 when the class contains a dot (specs-go/version.go).

    Args:
        kind: ``vendor.com/class``.
        devices: Container edits by CDI device name, in the order to write them.
        common: Edits applied whenever any device of this spec is requested.

    Raises:
        ValueError: a bad kind or device name, a device with no edits (CDI rejects those), or
            edits with annotations or CDI names.
    """

    kind: str
    devices: Mapping[str, Allocation] = field(default_factory=dict)
    common: Allocation = field(default_factory=Allocation)

    def __post_init__(self) -> None:
        validate_kind(self.kind)
        for name, edits in self.devices.items():
            validate_device_name(name)
            if not isinstance(edits, Allocation):
                raise TypeError(f"CDI device {name!r}: edits must be an Allocation")
            if _edits_empty(edits):
                # The CDI validator rejects a device without edits ("empty container edits").
                raise ValueError(f"CDI device {name!r} has no device nodes, mounts or env")
            _check_edits(f"CDI device {name!r}", edits)
        _check_edits("CDI common edits", self.common)
        object.__setattr__(self, "devices", dict(self.devices))

    @classmethod
    def from_devices(
        cls,
        kind: str,
        devices: Iterable[Device],
        *,
        env: bool = True,
        common: Allocation | None = None,
    ) -> CdiSpec:
        """Build a spec from SDK devices: each device's nodes, mounts and env become its edits.

        The CDI device name is the device ID. Devices that declare no nodes, mounts or env (with
        ``env=False``: no nodes or mounts) are left out, as CDI forbids empty devices.

        Args:
            kind: ``vendor.com/class``.
            devices: The devices, e.g. what ``discover()`` returned.
            env: Put each device's env in the spec; False leaves env out of the spec.
            common: Edits applied whenever any device of the spec is requested.

        Raises:
            ValueError: a bad kind, or a device ID that is not a valid CDI device name.
        """
        edits: dict[str, Allocation] = {}
        for device in devices:
            one = Allocation(
                device_nodes=device.device_nodes,
                mounts=device.mounts,
                env=dict(device.env) if env else {},
            )
            if not _edits_empty(one):
                try:
                    validate_device_name(device.id)
                except ValueError as exc:
                    raise ValueError(
                        f"device {device.id!r} cannot be a CDI device: {exc}"
                    ) from None
                edits[device.id] = one
        return cls(kind, edits, common or Allocation())

    @property
    def cdi_version(self) -> str:
        """The oldest CDI version that supports everything this spec uses."""
        _, klass = validate_kind(self.kind)
        if "." in klass:
            return "0.6.0"
        edits = [*self.devices.values(), self.common]
        if any(not name[0].isalpha() for name in self.devices) or any(
            n.host_path != n.container_path for e in edits for n in e.device_nodes
        ):
            return "0.5.0"
        return "0.3.0"

    def qualified(self, name: str) -> str:
        """The fully qualified CDI name of device ``name``.

        Raises:
            KeyError: the spec has no such device.
        """
        if name not in self.devices:
            raise KeyError(f"CDI spec {self.kind} has no device {name!r}")
        return f"{self.kind}={name}"

    def to_dict(self) -> dict[str, Any]:
        """The spec as the JSON object runtimes read."""
        out: dict[str, Any] = {
            "cdiVersion": self.cdi_version,
            "kind": self.kind,
            "devices": [
                {"name": name, "containerEdits": _edits_json(edits)}
                for name, edits in self.devices.items()
            ],
        }
        common = _edits_json(self.common)
        if common:
            out["containerEdits"] = common
        return out

    def to_json(self) -> bytes:
        """The spec file's bytes (UTF-8 JSON, indented, newline-terminated)."""
        return (json.dumps(self.to_dict(), indent=2) + "\n").encode()


# --------------------------------------------------------------------------------- files


def _target(spec: CdiSpec, directory: Path, name: str | None) -> Path:
    if name is None:
        name = spec_file_name(spec.kind)
    elif not name.endswith(_SPEC_SUFFIXES):
        name += ".json"
    if name.endswith(".yaml"):
        raise ValueError(f"CDI spec file {name!r}: this module writes JSON; use a .json name")
    if "/" in name or name.startswith(".") or "\0" in name:
        # Runtimes skip subdirectories; a leading dot would hide it from people, not runtimes.
        raise ValueError(f"CDI spec file name {name!r} must be a bare name not starting with '.'")
    return Path(directory) / name


def _write_if_changed(data: bytes, path: Path) -> bool:
    """Atomically replace ``path`` with ``data`` unless it already holds exactly that."""
    with contextlib.suppress(OSError):
        if path.read_bytes() == data:
            return False
    path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=_TMP_SUFFIX)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fchmod(f.fileno(), _FILE_MODE)
            os.fsync(f.fileno())
        os.replace(tmp, path)  # atomic within one filesystem: readers see old or new, never half
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)
    return True


def write_spec(spec: CdiSpec, directory: Path = DEFAULT_SPEC_DIR, name: str | None = None) -> Path:
    """Write ``spec`` atomically into ``directory``; blocking (use a thread from async code).

    The bytes go to a temporary ``.<stem>.*.tmp`` file in the same directory (runtimes only
    read ``*.json`` and ``*.yaml``), are fsynced, then renamed over the target, so a runtime sees
    the old spec or the new one, never a partial file. An unchanged spec is not rewritten.

    Args:
        spec: The spec; it must have at least one device.
        directory: The CDI spec directory, created if missing.
        name: File name; ``<vendor>-<class>.json`` by default; ``.json`` is appended when the
            name has no ``.json`` suffix.

    Returns:
        The spec file's path.

    Raises:
        ValueError: an empty spec (CDI requires a device; use ``remove_spec``) or a bad name.
        OSError: the file could not be written; the previous file is left as it was.
    """
    if not spec.devices:
        raise ValueError(f"CDI spec {spec.kind} has no devices; remove the file instead")
    path = _target(spec, Path(directory), name)
    _write_if_changed(spec.to_json(), path)
    return path


def remove_spec(path: Path) -> bool:
    """Remove a spec file written by ``write_spec``.

    Returns:
        Whether a file was removed (False if it was already gone).
    """
    try:
        Path(path).unlink()
    except FileNotFoundError:
        return False
    return True


# --------------------------------------------------------------------------------- the wrapper


class CdiPlugin(DevicePlugin):
    """Serve another plugin through CDI: its devices' nodes, mounts and env go into a spec file,
    and Allocate answers with CDI names. Create it with ``use_cdi``.

    * ``discover()`` calls the wrapped plugin's and writes the spec before returning, so every
      device the kubelet can hand out already resolves (rewritten only when it changed, removed
      when no device has edits);
    * ``allocate()`` calls the wrapped plugin's and returns the allocated devices' CDI names, its
      annotations and whatever its allocation adds beyond the devices' declared nodes, mounts and
      env (an allocation-wide variable such as a joined device list);
    * health, preferred allocation and pre-start hooks are the wrapped plugin's; the kubelet
      options follow what it overrides;
    * when serving stops the spec file is removed (``remove_on_exit``).

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
        self.kind = kind if kind is not None else plugin.resource_name
        self.spec_path = _target(CdiSpec(self.kind), Path(directory), spec_name)
        # A plugin with its own allocate() may compute env over the whole allocation (a joined
        # device list), which per-device edits cannot express: its env then goes via Allocate.
        self.spec_env = not plugin.overrides("allocate") if spec_env is None else spec_env
        self.remove_on_exit = remove_on_exit
        self._names: dict[str, str] = {}
        self._warned: set[str] = set()
        self._lock = anyio.Lock()

    def overrides(self, hook: str) -> bool:
        """The wrapped plugin's hooks decide the kubelet options and what runs."""
        return self.plugin.overrides(hook)

    def fingerprint(self) -> str:
        """The wrapped plugin's fingerprint and the CDI settings: a configuration reload
        restarts the resource only when one of them changed."""
        cdi = f"{self.kind}|{self.spec_path}|{self.spec_env}|{self.remove_on_exit}"
        return f"cdi({cdi})|{self.plugin.fingerprint()}"

    @property
    def names(self) -> Mapping[str, str]:
        """CDI name by device ID for the devices in the current spec."""
        return dict(self._names)

    async def discover(self) -> Sequence[Device]:
        """Discover through the wrapped plugin, then publish the spec.

        Raises:
            BackendError: a device ID is not a valid CDI name, or the spec cannot be written
                (on a rescan the SDK keeps the previous devices, and the previous spec stays).
        """
        devices = await self.plugin.discover()
        try:
            spec = CdiSpec.from_devices(self.kind, devices, env=self.spec_env)
        except ValueError as exc:
            raise BackendError(f"{self.resource_name}: {exc}") from None
        async with self._lock:
            try:
                if spec.devices:
                    data = spec.to_json()
                    changed = await anyio.to_thread.run_sync(
                        _write_if_changed, data, self.spec_path
                    )
                else:
                    changed = await anyio.to_thread.run_sync(remove_spec, self.spec_path)
            except OSError as exc:
                raise BackendError(
                    f"{self.resource_name}: cannot write CDI spec {self.spec_path}: {exc}"
                ) from exc
            self._names = {name: spec.qualified(name) for name in spec.devices}
        if changed:
            log.info(
                "%s: CDI spec %s %s (%d devices)",
                self.resource_name,
                self.spec_path,
                "written" if spec.devices else "removed",
                len(spec.devices),
                extra={"resource": self.resource_name},
            )
        return devices

    async def check_health(self, devices: Sequence[Device]) -> Mapping[str, Health]:
        return await self.plugin.check_health(devices)

    def watch(self) -> AsyncIterator[HealthEvent | RescanEvent]:
        """The wrapped plugin's events."""
        return self.plugin.watch()

    async def on_stop(self) -> None:
        """Remove the spec (``remove_on_exit``), then let the wrapped plugin clean up."""
        try:
            if self.remove_on_exit:
                async with self._lock:
                    removed = await anyio.to_thread.run_sync(remove_spec, self.spec_path)
                if removed:
                    log.info(
                        "%s: CDI spec %s removed",
                        self.resource_name,
                        self.spec_path,
                        extra={"resource": self.resource_name},
                    )
        finally:
            await self.plugin.on_stop()

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
