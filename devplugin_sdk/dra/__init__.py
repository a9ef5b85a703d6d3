"""Dynamic Resource Allocation: serve the same plugins as a DRA driver's kubelet plugin.

``runner.serve(*plugins, api="dra", dra=Dra(driver="gpu.acme.com"))`` (``api: dra`` in
``devplugin run``'s file) publishes every plugin's devices, with their typed attributes and
capacities, in ResourceSlices of one pool named after the node, registers with the kubelet's
plugin watcher as a ``DRAPlugin`` and prepares the claims the scheduler allocated: the devices'
container edits come from each plugin's ``allocate()`` and go into one CDI spec per claim.
``api="both"`` keeps the device-plugin registration too, for a node in transition: ``Dra.devices``
says which devices DRA gets, and the device plugin never lists those. The engine modules of this
package are private; ``resources`` holds the API objects and the ``ResourceApi`` interface.
"""

from __future__ import annotations

import fnmatch
import hashlib
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from devplugin_sdk import _names
from devplugin_sdk.api import constants
from devplugin_sdk.cdi import DEFAULT_SPEC_DIR
from devplugin_sdk.dra.resources import (
    AllocatedDevice,
    ResourceApi,
    ResourceClaim,
    ResourceSlice,
    SliceDevice,
)
from devplugin_sdk.errors import MissingDependencyError
from devplugin_sdk.types import AttributeValue, Device, Version

__all__ = [
    "AllocatedDevice",
    "Api",
    "DeviceRule",
    "DeviceRules",
    "Dra",
    "ResourceApi",
    "ResourceClaim",
    "ResourceSlice",
    "SliceDevice",
    "device_name",
    "kube_api",
]

#: Which kubelet API the runner serves plugins through (``api:`` in ``devplugin run``'s file):
#: the device-plugin API (the default), DRA, or both at once for a node in transition.
Api = Literal["devicePlugin", "dra", "both"]

_NOT_IN_LABEL = re.compile(r"[^a-z0-9-]+")


@dataclass(frozen=True, slots=True)
class Dra:
    """The DRA driver that ``runner.serve(..., api="dra" | "both", dra=Dra(...))`` runs.

    Args:
        driver: The DRA driver name, a DNS subdomain of at most 63 characters
            (``gpu.acme.com``); DeviceClasses select its devices with ``device.driver``, and
            unqualified attribute names belong to this domain.
        node_name: The node the plugin runs on; None reads ``$NODE_NAME`` (set it from the
            downward API's ``spec.nodeName``). The pool is named after it.
        api: The Kubernetes API; None connects with ``kube_api(kubeconfig)`` (in-cluster
            configuration by default).
        kubeconfig: A kubeconfig file for development, instead of the in-cluster service
            account.
        plugin_dir: Where ``dra.sock`` and the prepared-claims checkpoint live; None is
            ``/var/lib/kubelet/plugins/<driver>``, as Kubernetes' kubeletplugin helper uses.
        cdi_dir: Where the per-claim CDI specs go (the container runtime reads it).
        devices: Which devices DRA gets, as ``(resource_name, device) -> bool``; None is all.
            With ``api="both"`` every other device stays with the device plugin, and no device
            is ever listed by both (see docs/dra.md); with ``api="dra"`` the others are unused.
        no_execute: Taint a device ``NoExecute`` (evicting the pods that use it) when its
            backend says a signal calls for it (``Effect.NO_EXECUTE``); False taints it
            ``NoSchedule`` (running pods keep it). Off by default: eviction is the operator's
            decision.
        health_timeout: How long the kubelet may trust a device's health on the
            ``DRAResourceHealth`` stream without a newer report, seconds
            (``health_check_timeout_seconds``); every device's health is sent at least three
            times within it.
        kubelet_root_dir: The kubelet's root directory (its ``--root-dir``); the DRA socket
            must be inside it. None derives it from the plugin-watcher directory's parent.
        cleanup_interval: How often prepared claims are checked against the API, seconds:
            a claim the API no longer has, whose UID changed or that is reserved for no pod
            on two consecutive checks is unprepared (at start, then every interval; NVIDIA's
            driver checks every 10 minutes). 0 turns the check off.
        lock_timeout: The longest wait for the lock the driver's instances share during a
            rolling upgrade (``Settings.pod_uid``), seconds: a prepare or unprepare that waits
            longer fails for each of its claims (the kubelet retries; its own deadline is 45 s),
            a start that waits longer refuses to serve. A wait past two seconds is logged,
            naming the lock file and, where it can be seen, the process holding it.

    Raises:
        ValueError: an invalid driver or node name.
    """

    driver: str
    node_name: str | None = None
    api: ResourceApi | None = None
    kubeconfig: Path | None = None
    plugin_dir: Path | None = None
    cdi_dir: Path = DEFAULT_SPEC_DIR
    devices: Callable[[str, Device], bool] | None = None
    no_execute: bool = False
    health_timeout: int = constants.DRA_HEALTH_TIMEOUT_S
    kubelet_root_dir: Path | None = None
    cleanup_interval: float = 600.0
    lock_timeout: float = 20.0

    def __post_init__(self) -> None:
        problem = _names.driver_name_problem(self.driver)
        if problem is not None:
            raise ValueError(f"invalid DRA driver name {self.driver!r}: {problem}")
        if self.node_name is not None:
            _check_node_name(self.node_name)
        if not isinstance(self.health_timeout, int) or self.health_timeout < 3:
            raise ValueError(
                f"Dra.health_timeout must be a whole number of seconds >= 3, got "
                f"{self.health_timeout!r}"
            )
        if not (isinstance(self.cleanup_interval, (int, float)) and self.cleanup_interval >= 0):
            raise ValueError(
                f"Dra.cleanup_interval must be a number of seconds >= 0, got "
                f"{self.cleanup_interval!r}"
            )
        if not (
            isinstance(self.lock_timeout, (int, float))
            and 0 < self.lock_timeout < constants.DRA_CALL_TIMEOUT_S
        ):
            raise ValueError(
                f"Dra.lock_timeout must be a number of seconds > 0 and under the kubelet's "
                f"{constants.DRA_CALL_TIMEOUT_S:g} s deadline, got {self.lock_timeout!r}"
            )
        for name in ("kubeconfig", "plugin_dir", "cdi_dir", "kubelet_root_dir"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, Path(value))

    def resolved_node_name(self) -> str:
        """``node_name``, or ``$NODE_NAME``.

        Raises:
            ValueError: neither is set, or the name is invalid.
        """
        name = self.node_name or os.environ.get("NODE_NAME", "")
        if not name:
            raise ValueError(
                "DRA needs the node's name: set Dra(node_name=...) or dra.nodeName, or $NODE_NAME "
                "(in a DaemonSet: env NODE_NAME from fieldRef spec.nodeName)"
            )
        return _check_node_name(name)

    @property
    def resolved_plugin_dir(self) -> Path:
        """``plugin_dir``, or ``/var/lib/kubelet/plugins/<driver>``."""
        return self.plugin_dir or Path(constants.DRA_PLUGINS_PATH) / self.driver

    def selects(self, resource: str, device: Device) -> bool:
        """Whether DRA gets ``device`` of ``resource`` (``devices``, or every device)."""
        return self.devices is None or bool(self.devices(resource, device))


@dataclass(frozen=True, slots=True)
class DeviceRule:
    """A rule matching devices (``dra.devices`` in the configuration file): every field given
    must hold.

    Args:
        resource: Only devices of this resource.
        ids: Device IDs, as shell-style globs (``GPU-4*``); any one matching is enough.
        attributes: For each attribute name, the values it may have (``{"index": (4, 5)}``).
    """

    resource: str | None = None
    ids: tuple[str, ...] = ()
    attributes: Mapping[str, tuple[AttributeValue, ...]] = field(default_factory=dict)

    def matches(self, resource: str, device: Device) -> bool:
        """Whether ``device`` of ``resource`` matches every field of the rule."""
        if self.resource is not None and resource != self.resource:
            return False
        if self.ids and not any(fnmatch.fnmatchcase(device.id, glob) for glob in self.ids):
            return False
        for name, values in self.attributes.items():
            value = device.attributes.get(name)
            if value is None or not any(_same(value, wanted) for wanted in values):
                return False
        return True


@dataclass(frozen=True, slots=True)
class DeviceRules:
    """``Dra.devices`` from rules: a device goes to DRA when any rule matches it."""

    rules: tuple[DeviceRule, ...]

    def __call__(self, resource: str, device: Device) -> bool:
        return any(rule.matches(resource, device) for rule in self.rules)


def _same(value: AttributeValue, wanted: AttributeValue) -> bool:
    if isinstance(value, Version) or isinstance(wanted, Version):
        return str(value) == str(wanted)
    # True is not 1 here: a boolean attribute matches only a boolean.
    return type(value) is type(wanted) and value == wanted


def _check_node_name(name: str) -> str:
    problem = _names.pool_name_problem(name)
    if problem is not None or "/" in name:
        raise ValueError(f"invalid node name {name!r}: it must be a DNS-1123 subdomain")
    return name


def device_name(device_id: str) -> str:
    """The name a device gets in the driver's ResourceSlices (a DNS label), from its ID.

    Lower case, with every run of characters a label cannot hold turned into ``-``; when that
    lost anything but case, or the name would be longer than 63 characters, a short hash of the
    ID keeps names of different IDs apart. The same ID always gives the same name, so prepared
    claims and allocations survive restarts: ``GPU-8ca8...`` is ``gpu-8ca8...``, ``ttyUSB0`` is
    ``ttyusb0``, ``GPU-1::2`` is ``gpu-1-2-<hash>``.
    """
    lowered = device_id.lower()
    name = _NOT_IN_LABEL.sub("-", lowered).strip("-")
    if name == lowered and 0 < len(name) <= _names.MAX_DEVICE_NAME:
        return name
    digest = hashlib.sha256(device_id.encode()).hexdigest()[:8]
    keep = _names.MAX_DEVICE_NAME - len(digest) - 1
    stem = name[:keep].rstrip("-")
    return f"{stem}-{digest}" if stem else f"d-{digest}"


def kube_api(kubeconfig: Path | None = None) -> ResourceApi:
    """The Kubernetes API through lightkube (``pip install 'devplugin-sdk[dra]'``).

    Args:
        kubeconfig: A kubeconfig file; None uses the pod's service account (in-cluster).

    Raises:
        MissingDependencyError: lightkube is not installed.
        ValueError: the configuration cannot be loaded.
    """
    try:
        from devplugin_sdk.dra import _kube  # noqa: PLC0415 - an optional extra
    except ImportError as exc:
        raise MissingDependencyError(
            f"DRA needs a Kubernetes client: pip install 'devplugin-sdk[dra]' ({exc})"
        ) from None
    return _kube.LightkubeApi.connect(kubeconfig)
