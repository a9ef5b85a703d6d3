"""JSON Schemas of ``devplugin run`` files, for editors and CI (schemas/*.json).

``run`` describes the SDK's keys (any backend's keys beside them); ``generic``, ``nvidia``,
``rdma`` and ``fpga`` describe a whole file for that backend: the SDK's keys and the backend's
``SCHEMA``, the definitions its reader takes each level's keys from. scripts/gen_schemas.py
writes them; tests/config/test_schemas.py checks that they are up to date and that the readers
agree with them.
"""

from __future__ import annotations

import importlib
from typing import Any

from devplugin_sdk import backends
from devplugin_sdk.cli.runfile import SDK_KEYS

__all__ = ["BASE_URI", "schemas"]

#: Where the files are published: the ``$id`` of each is relative to the repository.
BASE_URI = "schemas/"
_DRAFT = "https://json-schema.org/draft/2020-12/schema"
_PATH = {"type": "string", "pattern": "^/", "description": "an absolute path"}
_ATTRIBUTE_VALUE = {"type": ["string", "integer", "boolean"]}

#: The SDK's keys of a run file (``cli.runfile.parse_run_config`` reads them).
_SDK: dict[str, Any] = {
    "backend": {
        "type": "string",
        "minLength": 1,
        "description": f"built-in backend ({', '.join(sorted(backends.BUILTIN))}) or MODULE:ATTR",
    },
    "devicePluginDir": {**_PATH, "default": "/var/lib/kubelet/device-plugins"},
    "registration": {"enum": ["auto", "kubelet", "watcher"], "default": "auto"},
    "pluginsRegistryDir": {**_PATH, "default": "/var/lib/kubelet/plugins_registry"},
    "rescanInterval": {
        "type": "number",
        "minimum": 0,
        "default": 10,
        "description": "seconds between rediscoveries of every plugin's devices (0: never)",
    },
    "logging": {
        "type": ["object", "null"],
        "additionalProperties": False,
        "properties": {
            "level": {
                "type": "string",
                "minLength": 1,
                "default": "info",
                "description": "debug, info, warning or error, then optional LOGGER=LEVEL items",
            },
            "format": {"enum": ["text", "json"], "default": "text"},
        },
    },
    "metrics": {
        "type": ["object", "null"],
        "additionalProperties": False,
        "properties": {
            "port": {"type": "integer", "minimum": 0, "maximum": 65535},
            "host": {"type": "string", "minLength": 1},
            "stuckAfter": {"type": "number", "exclusiveMinimum": 0, "default": 30},
        },
    },
    "cdi": {
        "type": ["object", "null"],
        "additionalProperties": False,
        "properties": {"directory": {**_PATH, "default": "/var/run/cdi"}},
        "description": "serve every plugin through CDI, writing specs here",
    },
    "api": {"enum": ["devicePlugin", "dra", "both"], "default": "devicePlugin"},
    "dra": {
        "type": "object",
        "additionalProperties": False,
        "required": ["driver"],
        "properties": {
            "driver": {"type": "string", "minLength": 1, "description": "a DNS subdomain"},
            "nodeName": {"type": "string", "minLength": 1},
            "kubeconfig": _PATH,
            "pluginDir": _PATH,
            "cdiDir": {**_PATH, "default": "/var/run/cdi"},
            "noExecute": {
                "type": "boolean",
                "default": False,
                "description": "taint NoExecute when the backend says a signal calls for it",
            },
            "healthTimeout": {
                "type": "integer",
                "minimum": 3,
                "maximum": 3600,
                "default": 30,
                "description": "seconds the kubelet trusts a device's health on the stream",
            },
            "kubeletRootDir": {
                **_PATH,
                "description": "the kubelet's --root-dir (default: pluginsRegistryDir's parent)",
            },
            "cleanupInterval": {
                "type": "number",
                "minimum": 0,
                "default": 600,
                "description": "seconds between checks of prepared claims against the API (0: off)",
            },
            "devices": {
                "type": "array",
                "items": {
                    "type": "object",
                    "additionalProperties": False,
                    "minProperties": 1,
                    "properties": {
                        "resource": {"type": "string", "minLength": 1},
                        "ids": {"type": "array", "items": {"type": "string", "minLength": 1}},
                        "attributes": {
                            "type": "object",
                            "additionalProperties": {
                                "anyOf": [
                                    _ATTRIBUTE_VALUE,
                                    {"type": "array", "items": _ATTRIBUTE_VALUE},
                                ]
                            },
                        },
                    },
                },
            },
        },
    },
}
if tuple(_SDK) != SDK_KEYS:  # pragma: no cover - a key added to the run file, not here
    raise AssertionError(f"schemas: the SDK's keys are {SDK_KEYS}, described {tuple(_SDK)}")


def schemas() -> dict[str, dict[str, Any]]:
    """Every published schema by name: ``run`` and one per built-in backend."""
    found: dict[str, dict[str, Any]] = {
        "run": {
            "$schema": _DRAFT,
            "$id": f"{BASE_URI}run.json",
            "title": "devplugin run file (the SDK's keys; a backend's keys beside them)",
            "type": "object",
            "properties": _SDK,
        }
    }
    for name, module_name in sorted(backends.BUILTIN.items()):
        backend = importlib.import_module(f"{module_name}.config").SCHEMA
        overlap = set(backend["properties"]) & set(_SDK)
        if overlap:  # pragma: no cover - a backend key the SDK would take
            raise AssertionError(f"schemas: {name} reuses the SDK's keys {sorted(overlap)}")
        found[name] = {
            "$schema": _DRAFT,
            "$id": f"{BASE_URI}{name}.json",
            "title": f"devplugin run file for the {name} backend",
            **backend,
            "properties": {**_SDK, **backend["properties"]},
            "additionalProperties": False,
        }
    return found
