"""CDI (Container Device Interface) support: spec files, qualified names, and ``use_cdi``.

Owns the JSON a container runtime reads from ``/var/run/cdi`` (written atomically, owned by one
live plugin through a lock beside it, removed on shutdown only by the plugin that wrote it) and
the wrapper that lets any ``DevicePlugin`` hand out CDI names instead of raw nodes, mounts and env,
advertising a device only once its name resolves. Format, name rules and version features were
learned from the CDI spec and its Go producer (cncf-tags/container-device-interface: SPEC.md,
specs-go/version.go, api/producer/identifiers.go, validator-default.go, writer.go,
pkg/cdi/spec-dirs.go).

The modules, one piece each: ``names`` (kinds, device names, qualified names), ``spec`` (a spec
in memory and its JSON), ``files`` (atomic writes and the lock that makes one plugin the owner of a
spec path) and ``plugin`` (``use_cdi`` and the wrapper it returns).
"""

from __future__ import annotations

from devplugin_sdk.cdi.files import DEFAULT_SPEC_DIR, remove_spec, write_spec
from devplugin_sdk.cdi.names import cdi_name, spec_file_name, validate_device_name, validate_kind
from devplugin_sdk.cdi.plugin import CdiPlugin, use_cdi
from devplugin_sdk.cdi.spec import CdiSpec

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
