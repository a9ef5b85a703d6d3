"""The names of a claim from outside (the kubelet's namespace, name and UID; the API's request
names), checked as the API server validates them before any file, path or API call is named
after one: an API server that does not validate, or a kubelet that relays what it is sent, must
not make a claim's files reach outside the driver's directories. Per-claim paths are keyed by the
UID and built with ``_files.inside``.
"""

from __future__ import annotations

import re

from devplugin_sdk._logging import printable
from devplugin_sdk._wire.dra_model import ClaimRef

__all__ = ["UID", "ref_problem", "request_problem"]

# Kubernetes object UIDs are UUIDs; the UID names the claim's CDI spec file, its CDI devices and
# its metadata directory.
UID = re.compile(r"[0-9A-Za-z-]{1,64}")
# RFC 1123 as k8s.io/apimachinery validation has them: a namespace and a request name are DNS
# labels (63 characters at most), an object's name a DNS subdomain (253).
_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS_LABEL = re.compile(_LABEL)
_DNS_SUBDOMAIN = re.compile(rf"{_LABEL}(\.{_LABEL})*")


def ref_problem(ref: ClaimRef) -> str | None:
    """Why the kubelet's ``ref`` cannot be a claim (a message naming the part), or None."""
    if not (ref.uid and ref.namespace and ref.name):
        return "the request names it without namespace, name or UID"
    if not UID.fullmatch(ref.uid):
        return "the UID is not a Kubernetes UID"
    if len(ref.namespace) > 63 or not _DNS_LABEL.fullmatch(ref.namespace):
        return f"{printable(ref.namespace)!r} is not a valid namespace (a DNS label)"
    if len(ref.name) > 253 or not _DNS_SUBDOMAIN.fullmatch(ref.name):
        return f"{printable(ref.name)!r} is not a valid claim name (a DNS subdomain)"
    return None


def request_problem(request: str) -> str | None:
    """Why ``request`` (``<request>`` or ``<request>/<subrequest>``) is not a valid request name
    of a claim's allocation result, or None."""
    parts = request.split("/")
    if len(parts) > 2 or not all(len(p) <= 63 and _DNS_LABEL.fullmatch(p) for p in parts):
        return f"{printable(request)!r} is not a valid request name (DNS labels)"
    return None
