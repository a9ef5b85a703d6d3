"""Typed opaque claim configuration: the kinds a backend declares, decoded and applied per request.

A claim (or its DeviceClass) may carry ``opaque: {driver, parameters}`` entries for this driver;
the scheduler copies them into ``status.allocation.devices.config``, the classes' first
(k8s.io/dynamic-resource-allocation ``structured`` allocator). A plugin that takes configuration
mixes in ``Configurable`` and lists its ``ConfigKind``s: each names a kind and a version (the
``apiVersion`` group is the driver's name) and reads its typed fields through the same
``ConfigReader`` as configuration files, so errors name the dotted key. ``resolve`` decodes every
entry of the driver for the claim's requests, applies a class's entry then the claim's (the last
of a kind wins, as in NVIDIA's and the example DRA drivers) and fails the claim with a message
naming the claim, the request and the key.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, TypeVar

from devplugin_sdk._names import label_value_problem
from devplugin_sdk.config import ConfigReader, shown
from devplugin_sdk.dra.resources import DeviceConfig, ResourceClaim
from devplugin_sdk.errors import ConfigError
from devplugin_sdk.types import Allocation, Device

__all__ = ["ClaimConfigError", "ConfigKind", "Configurable", "RequestConfig", "resolve"]

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class ConfigKind(Generic[T]):
    """A kind of opaque configuration a plugin accepts in claims.

    Args:
        kind: The ``kind`` (``GpuConfig``), an upper-case CamelCase name.
        version: The version of the kind (``v1alpha1``); the ``apiVersion`` is
            ``<driver>/<version>``: the driver's name is a DNS subdomain its operator owns, so no
            other driver's kind can take the name, and one file can hold configuration of two
            drivers without doubt about which reads what.
        read: Reads the typed fields from the parameters (``apiVersion`` and ``kind`` removed)
            and returns the value plugins get; raises ``ConfigError`` naming the key. Unread
            keys are refused (a typo never passes silently).
        group: The ``apiVersion`` group when it is not the driver's name: a kind another
            driver defined (NVIDIA's ``resource.nvidia.com``), read so that its users' claims
            need no edit. Two kinds of one name (the driver's and the foreign group's) are one
            kind to ``RequestConfig``: the last entry of either wins.

    Raises:
        ValueError: an empty kind or a version that is not a Kubernetes version name.
    """

    kind: str
    version: str
    read: Callable[[ConfigReader], T]
    group: str | None = None

    def __post_init__(self) -> None:
        if not self.kind[:1].isupper() or not self.kind.isalnum():
            raise ValueError(f"ConfigKind.kind must be a CamelCase name, got {self.kind!r}")
        if label_value_problem(self.version) is not None or not self.version.startswith("v"):
            raise ValueError(f"ConfigKind.version must look like v1alpha1, got {self.version!r}")

    def api_version(self, driver: str) -> str:
        """``<driver>/<version>``, or ``<group>/<version>`` for a kind of another group."""
        return f"{self.group or driver}/{self.version}"


class Configurable(abc.ABC):
    """A plugin whose claims may carry typed configuration; mix it in beside ``DevicePlugin``.

    The DRA preparer calls ``allocate_configured`` instead of ``allocate`` for the devices of a
    request, with the configuration that applies to the request (possibly none). The
    device-plugin API knows no claim configuration and keeps calling ``allocate``.
    """

    #: The kinds this plugin accepts.
    config_kinds: ClassVar[tuple[ConfigKind[Any], ...]] = ()

    @abc.abstractmethod
    async def allocate_configured(
        self, devices: Sequence[Device], config: RequestConfig
    ) -> Allocation:
        """The container edits of one request's devices under its configuration.

        Args:
            devices: The request's devices served by this plugin.
            config: The decoded configuration of the request (``config.get(KIND)``).

        Raises:
            AllocationError: the configuration cannot be applied to these devices; the message
                fails the claim.
        """

    async def release_configured(  # noqa: B027 (optional hook: most kinds leave nothing behind)
        self, devices: Sequence[Device], others: Sequence[Device]
    ) -> None:
        """Undo what ``allocate_configured`` did to the hardware when a claim is unprepared.

        Args:
            devices: The unprepared claim's devices served by this plugin.
            others: This plugin's devices that other prepared claims still hold (a setting of a
                device they share stays theirs).

        Errors are logged by the driver; the claim is unprepared whatever this does.
        """


@dataclass(frozen=True, slots=True)
class RequestConfig:
    """The configuration that applies to one request: per kind, the value of the last entry.

    Attributes:
        request: The request (``name`` or ``name/subrequest``).
        values: Decoded values by kind name.
        sources: Where each came from (``claim config[2]``), for messages.
        general: The kinds whose entry named no requests (a plugin may skip such an entry for
            devices it does not fit, as NVIDIA's driver skips a request-less ``GpuConfig`` for
            MIG devices, where an entry naming the request is an error).
    """

    request: str
    values: Mapping[str, Any] = field(default_factory=dict)
    sources: Mapping[str, str] = field(default_factory=dict)
    general: frozenset[str] = frozenset()

    def get(self, kind: ConfigKind[T]) -> T | None:
        """The value of ``kind`` for this request, or None when no entry sets it."""
        value: T | None = self.values.get(kind.kind)
        return value


class ClaimConfigError(ValueError):
    """A claim's configuration cannot be used; the message names the claim, request and key."""


def _applies(entry: DeviceConfig, request: str) -> bool:
    """Whether ``entry`` applies to ``request``: no requests named means all; naming the main
    request covers its subrequests (resource/v1 ``DeviceAllocationConfiguration.requests``)."""
    if not entry.requests:
        return True
    main = request.split("/", 1)[0]
    return request in entry.requests or main in entry.requests


def resolve(
    claim: ResourceClaim,
    driver: str,
    requests: Mapping[str, Collection[ConfigKind[Any]]],
) -> dict[str, RequestConfig]:
    """Decode the claim's configuration entries of ``driver`` for each of ``requests``.

    Args:
        claim: The allocated claim.
        driver: This driver: entries of other drivers are left to them.
        requests: This driver's requests of the claim, each with the kinds its devices' plugins
            accept.

    Returns:
        Per request, the configuration that applies: a DeviceClass's entries first, then the
        claim's; of one kind, the last entry wins.

    Raises:
        ClaimConfigError: an entry is not a mapping, is of a kind no plugin of the request
            accepts, or a parameter is invalid; naming the claim, the request and the key.
    """
    ours = [(i, c) for i, c in enumerate(claim.config) if c.driver == driver]
    # Classes' entries first whatever the order read (the scheduler writes them first).
    ours.sort(key=lambda item: 0 if item[1].source == "FromClass" else 1)
    decoded: dict[int, tuple[str, Any]] = {}
    out: dict[str, RequestConfig] = {}
    shown_claim = f"{claim.namespace}/{claim.name}"
    for request, kinds in requests.items():
        by_name = {k.api_version(driver) + "/" + k.kind: k for k in kinds}
        values: dict[str, Any] = {}
        sources: dict[str, str] = {}
        general: set[str] = set()
        for index, entry in ours:
            if not _applies(entry, request):
                continue
            where = f"{'class' if entry.source == 'FromClass' else 'claim'} config[{index}]"
            try:
                name, value = decoded.get(index) or _decode(entry, driver, by_name)
            except ConfigError as exc:
                key = "" if exc.key == "<root>" else f".{exc.key}"
                raise ClaimConfigError(
                    f"claim {shown_claim}, request {request}: {where} "
                    f"opaque.parameters{key}: {exc.reason}"
                ) from None
            if name not in {k.kind for k in kinds}:
                raise ClaimConfigError(
                    f"claim {shown_claim}, request {request}: {where} "
                    f"opaque.parameters.kind: {name} does not apply to this request's devices"
                )
            decoded[index] = (name, value)
            values[name] = value
            sources[name] = where
            (general.add if not entry.requests else general.discard)(name)
        out[request] = RequestConfig(request, values, sources, frozenset(general))
    return out


def _decode(
    entry: DeviceConfig, driver: str, kinds: Mapping[str, ConfigKind[Any]]
) -> tuple[str, Any]:
    """One entry's kind name and decoded value.

    Raises:
        ConfigError: keyed below ``opaque.parameters``.
    """
    raw = entry.parameters
    if not isinstance(raw, Mapping):
        raise ConfigError("<root>", f"must be an object with apiVersion and kind, got {shown(raw)}")
    reader = ConfigReader(raw, "")
    api_version = reader.string("apiVersion")
    kind_name = reader.string("kind")
    kind = kinds.get(f"{api_version}/{kind_name}")
    if kind is None:
        known = ", ".join(sorted(f"{k.api_version(driver)} {k.kind}" for k in kinds.values()))
        raise ConfigError(
            "kind",
            f"{shown(api_version)} {shown(kind_name)} is not a kind this driver reads"
            + (f" (it reads {known})" if known else " (it reads no configuration)"),
        )
    with reader:
        value = kind.read(reader)
    return kind.kind, value
