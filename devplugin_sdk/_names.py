"""Validation of resource names and socket names with the kubelet's own rules.

The resource-name rules are those of the kubelet's IsExtendedResourceName check; the socket-name
rules follow from how the kubelet joins the endpoint onto its directory and cleans that directory.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import os
import re
from pathlib import Path

from devplugin_sdk.api import constants

# Matched whole (``fullmatch``): with ``match``, ``$`` also matches before a final newline, and a
# name ending in one would pass.
_DNS1123_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS1123_SUBDOMAIN = re.compile(rf"^{_DNS1123_LABEL}(\.{_DNS1123_LABEL})*$")
_DNS1123_LABEL_RE = re.compile(rf"^{_DNS1123_LABEL}$")
_QUALIFIED_NAME_PART = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")


def is_dns_label(name: str) -> bool:
    """Whether ``name`` is a DNS-1123 label of at most 63 characters (a namespace, a request)."""
    return len(name) <= 63 and _DNS1123_LABEL_RE.fullmatch(name) is not None


def is_dns_subdomain(name: str) -> bool:
    """Whether ``name`` is a DNS-1123 subdomain of at most 253 characters (an object's name)."""
    return len(name) <= 253 and _DNS1123_SUBDOMAIN.fullmatch(name) is not None


def resource_name_problem(name: str) -> str | None:
    """Return why the kubelet would reject ``name`` as an extended resource name, or None."""
    if "/" not in name:
        return "it has no '/' (a name without a domain is a native resource)"
    if "kubernetes.io/" in name:
        return "the kubernetes.io/ domain is reserved"
    if name.startswith("requests."):
        return "it must not start with 'requests.'"
    # The kubelet validates "requests." + name as a qualified name.
    prefix, _, part = ("requests." + name).partition("/")
    if "/" in part:
        return "it has more than one '/'"
    if len(prefix) > 253 or not _DNS1123_SUBDOMAIN.fullmatch(prefix):
        return "the domain must be a lower-case DNS-1123 subdomain (at most 244 characters)"
    if not part:
        return "the name after '/' is empty"
    if len(part) > 63:
        return "the name after '/' is longer than 63 characters"
    if not _QUALIFIED_NAME_PART.fullmatch(part):
        return (
            "the name after '/' must use only [A-Za-z0-9._-] and start and end with an alphanumeric"
        )
    return None


def is_extended_resource_name(name: str) -> bool:
    """Whether the kubelet accepts ``name`` as an extended resource name."""
    return resource_name_problem(name) is None


def validate_resource_name(name: str) -> str:
    """Return ``name`` if the kubelet accepts it, else raise ``ValueError`` saying why."""
    problem = resource_name_problem(name)
    if problem is not None:
        raise ValueError(f"invalid resource name {name!r}: {problem}")
    return name


def validate_socket_name(name: str) -> str:
    """Return ``name`` if it is a safe bare socket file name in the device-plugin directory.

    Raises:
        ValueError: naming the rule that ``name`` breaks.
    """
    if not name or "/" in name or name in (".", ".."):
        raise ValueError(f"invalid socket name {name!r}: must be a bare file name")
    if name.startswith("."):
        raise ValueError(f"invalid socket name {name!r}: must not start with '.'")
    if name in (
        constants.KUBELET_SOCKET_NAME,
        constants.CHECKPOINT_NAME,
        constants.DEPRECATION_NAME,
    ):
        raise ValueError(f"invalid socket name {name!r}: reserved by the kubelet")
    if "\0" in name or not name.isprintable():
        raise ValueError(f"invalid socket name {name!r}: must be printable")
    if len(name.encode()) > constants.MAX_SOCKET_PATH_BYTES:
        raise ValueError(f"invalid socket name {name!r}: too long for a unix socket path")
    return name


def default_socket_name(resource_name: str) -> str:
    """Socket name for a resource: ``vendor.com/gpu`` -> ``vendor.com_gpu.sock``."""
    return resource_name.replace("/", "_") + ".sock"


def instance_socket_name(
    name: str, pod_uid: str, directory: Path, *, prefix: str = "dp", key: str | None = None
) -> str:
    """The socket name of one instance (pod) of a plugin whose plain socket name is ``name``.

    Two instances side by side (a DaemonSet's ``maxSurge`` upgrade) need sockets of their own
    names. As the kubeletplugin helper's ``RollingUpdateRegistrarSocketFile`` does, the first
    of these that fits a unix socket path in ``directory`` is taken: ``<stem>-<pod UID><ext>``,
    ``<stem>-<base64(SHA-256(UID))[:8 bytes]><ext>``, ``<prefix>-<base64(SHA-256(name, NUL,
    UID))[:16 bytes]><ext>`` (``ext`` is ``-reg.sock`` or ``.sock``, as ``name`` ends; ``key``
    replaces ``name`` in the last hash: the helper hashes the driver name there).
    """
    ext = "-reg.sock" if name.endswith("-reg.sock") else ".sock" if name.endswith(".sock") else ""
    stem = name[: len(name) - len(ext)] if ext else name
    uid_hash = hashlib.sha256(pod_uid.encode()).digest()[:8]
    name_hash = hashlib.sha256(f"{key or name}\0{pod_uid}".encode()).digest()[:16]
    candidates = (
        f"{stem}-{pod_uid}{ext}",
        f"{stem}-{_b64(uid_hash)}{ext}",
        f"{prefix}-{_b64(name_hash)}{ext or '.sock'}",
    )
    for candidate in candidates:
        if len(os.fsencode(directory / candidate)) <= constants.MAX_SOCKET_PATH_BYTES:
            return candidate
    return candidates[-1]


def _b64(digest: bytes) -> str:
    return base64.urlsafe_b64encode(digest).decode().rstrip("=")


_POD_UID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def pod_uid_problem(uid: str) -> str | None:
    """Why ``uid`` cannot name an instance's sockets (a pod's ``metadata.uid`` always can)."""
    if _POD_UID.fullmatch(uid) is None:
        return "must be a pod UID (letters, digits, '-', '.', '_'; at most 128 characters)"
    return None


# ------------------------------------------------------------------ DRA (resource.k8s.io/v1)
# The rules of the API server's resource validation (pkg/apis/resource/validation): attribute
# and capacity names are C identifiers of at most 32 characters, optionally behind a DNS
# subdomain of at most 63 and a slash; driver names are DNS subdomains of at most 63 (the CSI
# driver name rules); device names are DNS labels.

_C_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
#: DeviceMaxIDLength: the name part of an attribute or capacity.
MAX_ATTRIBUTE_ID = 32
#: DeviceMaxDomainLength, and the length of a driver name.
MAX_DOMAIN = 63
#: A device name (a DNS label).
MAX_DEVICE_NAME = 63


@functools.lru_cache(maxsize=4096)  # pure; a slice write asks per device
def driver_name_problem(name: str) -> str | None:
    """Why the API server would reject ``name`` as a DRA driver name (or domain), or None."""
    if not name:
        return "it is empty"
    if len(name) > MAX_DOMAIN:
        return f"it is longer than {MAX_DOMAIN} characters"
    if not _DNS1123_SUBDOMAIN.fullmatch(name):
        return "it must be a lower-case DNS-1123 subdomain (a-z, 0-9, '-' and '.')"
    return None


@functools.lru_cache(maxsize=4096)  # pure; a slice write asks per device
def attribute_name_problem(name: str) -> str | None:
    """Why the API server would reject ``name`` as a device attribute or capacity name, or None.

    A C identifier of at most 32 characters (``productName``), optionally qualified by a domain
    (``resource.kubernetes.io/pcieRoot``); an unqualified name belongs to the driver's domain.
    """
    domain, slash, ident = name.rpartition("/")
    if slash:
        if "/" in domain:
            return "it has more than one '/'"
        problem = driver_name_problem(domain)
        if problem is not None:
            return f"its domain {domain!r} is invalid: {problem}"
    if not ident:
        return "the name is empty"
    if len(ident) > MAX_ATTRIBUTE_ID:
        return f"the name {ident!r} is longer than {MAX_ATTRIBUTE_ID} characters"
    if not _C_IDENTIFIER.fullmatch(ident):
        return f"the name {ident!r} must be a C identifier (letters, digits, '_'; no digit first)"
    return None


@functools.lru_cache(maxsize=4096)  # pure; a slice write asks per device
def device_name_problem(name: str) -> str | None:
    """Why the API server would reject ``name`` as a device name in a ResourceSlice, or None."""
    if not name:
        return "it is empty"
    if len(name) > MAX_DEVICE_NAME:
        return f"it is longer than {MAX_DEVICE_NAME} characters"
    if not _DNS1123_LABEL_RE.fullmatch(name):
        return "it must be a lower-case DNS-1123 label (a-z, 0-9 and '-')"
    return None


def pool_name_problem(name: str) -> str | None:
    """Why the API server would reject ``name`` as a pool name, or None."""
    if not name or len(name) > 253:
        return "it must have 1 to 253 characters"
    for part in name.split("/"):
        if not _DNS1123_SUBDOMAIN.fullmatch(part):
            return "each '/'-separated part must be a lower-case DNS-1123 subdomain"
    return None


#: A label value's longest (and a DRA taint value's, which is one).
MAX_LABEL_VALUE = 63
_NOT_IN_LABEL_VALUE = re.compile(r"[^A-Za-z0-9_.-]+")


def label_value(text: str, default: str) -> str:
    """``text`` as a valid label value (a DRA taint's value): every run of characters a label
    value cannot hold becomes ``-``, the ends are alphanumeric, at most 63 characters;
    ``default`` if nothing is left (``"Xid 79 (GPU has fallen off the bus)"`` is
    ``Xid-79-GPU-has-fallen-off-the-bus``)."""
    value = _NOT_IN_LABEL_VALUE.sub("-", text)[:MAX_LABEL_VALUE]
    value = re.sub(r"^[^A-Za-z0-9]+|[^A-Za-z0-9]+$", "", value)
    return value or default


def label_value_problem(value: str) -> str | None:
    """Why ``value`` is not a valid label value, or None."""
    if len(value) > MAX_LABEL_VALUE:
        return f"longer than {MAX_LABEL_VALUE} characters"
    if value and not _QUALIFIED_NAME_PART.fullmatch(value):
        return "not alphanumeric with '-', '_' or '.' inside"
    return None


def label_name_problem(name: str) -> str | None:
    """Why ``name`` is not a valid label name (``[prefix/]name``, the prefix a DNS subdomain),
    or None."""
    prefix, slash, ident = name.rpartition("/")
    if slash and (not prefix or len(prefix) > 253 or not _DNS1123_SUBDOMAIN.fullmatch(prefix)):
        return f"prefix {prefix!r} must be a DNS-1123 subdomain"
    if not ident or len(ident) > MAX_LABEL_VALUE or not _QUALIFIED_NAME_PART.fullmatch(ident):
        return f"name {ident!r} must be 1-63 alphanumeric characters with '-', '_' or '.' inside"
    return None


# sockaddr_un.sun_path is 108 bytes on Linux, the terminating NUL included.
MAX_SOCKET_PATH = 107


def socket_path_problem(path: object) -> str | None:
    """Why ``path`` cannot be a Unix socket address (too long for ``sun_path``), or None.

    gRPC's own refusal is a C-core log line and a traceback; a kubelet.sock path that can
    never be dialled is a silent wait.
    """
    size = len(os.fsencode(str(path)))
    if size > MAX_SOCKET_PATH:
        return f"{path} is {size} bytes long; a Unix socket path holds at most {MAX_SOCKET_PATH}"
    return None
