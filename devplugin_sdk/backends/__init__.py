"""Built-in backends. Importing this package imports nothing heavy (no NVML).

``BUILTIN`` maps the names ``devplugin run NAME --config FILE`` accepts to backend modules; each
module has ``from_config(mapping) -> list[DevicePlugin]``.
"""

from __future__ import annotations

__all__ = ["BUILTIN"]

BUILTIN: dict[str, str] = {
    "generic": "devplugin_sdk.backends.generic",
    "nvidia": "devplugin_sdk.backends.nvidia",
    "fpga": "devplugin_sdk.backends.fpga",
    "rdma": "devplugin_sdk.backends.rdma",
}
