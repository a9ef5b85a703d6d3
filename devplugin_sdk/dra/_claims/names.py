"""The names of a claim from outside (the kubelet's namespace, name and UID; the API's request
names), checked as the API server validates them before any file, path or API call is named
after one: an API server that does not validate, or a kubelet that relays what it is sent, must
not make a claim's files reach outside the driver's directories. Per-claim paths are keyed by the
UID and built with ``_files.inside``.
"""

from __future__ import annotations

import re

from devplugin_sdk import _names
from devplugin_sdk._logging import printable
from devplugin_sdk._wire.dra_model import ClaimRef

__all__ = ["UID", "ref_problem", "request_problem"]

# Kubernetes object UIDs are UUIDs; the UID names the claim's CDI spec file, its CDI devices and
# its metadata directory.
UID = re.compile(r"[0-9A-Za-z-]{1,64}")
# As k8s.io/apimachinery validates them: a namespace and a request name are DNS labels, an
# object's name a DNS subdomain (``_names``).


def ref_problem(ref: ClaimRef) -> str | None:
    """Why the kubelet's ``ref`` cannot be a claim (a message naming the part), or None."""
    if not (ref.uid and ref.namespace and ref.name):
        return "the request names it without namespace, name or UID"
    if not UID.fullmatch(ref.uid):
        return "the UID is not a Kubernetes UID"
    if not _names.is_dns_label(ref.namespace):
        return f"{printable(ref.namespace)!r} is not a valid namespace (a DNS label)"
    if not _names.is_dns_subdomain(ref.name):
        return f"{printable(ref.name)!r} is not a valid claim name (a DNS subdomain)"
    return None


def request_problem(request: str) -> str | None:
    """Why ``request`` (``<request>`` or ``<request>/<subrequest>``) is not a valid request name
    of a claim's allocation result, or None."""
    parts = request.split("/")
    if len(parts) > 2 or not all(_names.is_dns_label(p) for p in parts):
        return f"{printable(request)!r} is not a valid request name (DNS labels)"
    return None
