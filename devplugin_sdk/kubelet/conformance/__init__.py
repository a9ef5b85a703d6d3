"""``devplugin conformance``: named checks that judge a device plugin as the kubelet would.

Each check is a small async function that returns what it saw or raises ``CheckFailed`` (the
kubelet breaks or misbehaves: a pod fails admission, the resource drops out),
``CheckWarning`` (the kubelet copes, but what the plugin meant is lost) or ``Skip``; each
``Check`` cites the kubelet code its levels come from (``kubelet``, functions of
``pkg/kubelet/cm/devicemanager``). The suite talks to the plugin through ``probe.PluginClient``,
as the kubelet would. ``check_socket`` tests a plugin on its socket; ``check_register_dir``
plays the kubelet (``FakeKubelet``) on a directory, tests what registers, then restarts it.

The pieces: ``_report`` (verdicts, results, ``Check``), ``_subject`` (the plugin under test),
``_listing_checks`` and ``_allocation_checks`` (the device-plugin checks), ``_suite`` (``CHECKS``
and the two runs), ``_dra`` (the DRA suite).
"""

from __future__ import annotations

from devplugin_sdk._limits import Limits
from devplugin_sdk.kubelet.conformance._dra import DRA_CHECKS, check_dra_socket
from devplugin_sdk.kubelet.conformance._report import (
    Check,
    CheckFailed,
    CheckResult,
    CheckWarning,
    ConformanceError,
    ConformanceReport,
    Skip,
)
from devplugin_sdk.kubelet.conformance._suite import (
    CHECKS,
    RESTART_CHECK,
    RESTART_KUBELET,
    check_register_dir,
    check_socket,
)

__all__ = [
    "CHECKS",
    "DRA_CHECKS",
    "RESTART_CHECK",
    "RESTART_KUBELET",
    "Check",
    "CheckFailed",
    "CheckResult",
    "CheckWarning",
    "ConformanceError",
    "ConformanceReport",
    "Limits",
    "Skip",
    "check_dra_socket",
    "check_register_dir",
    "check_socket",
]
