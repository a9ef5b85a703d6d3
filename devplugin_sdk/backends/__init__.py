"""Built-in backends. Importing this package imports nothing heavy (no NVML).

``BUILTIN`` maps the names ``devplugin run NAME`` accepts to ``module:Class`` paths.
"""

from __future__ import annotations

BUILTIN: dict[str, str] = {
    "generic": "devplugin_sdk.backends.generic:GenericPlugin",
}
