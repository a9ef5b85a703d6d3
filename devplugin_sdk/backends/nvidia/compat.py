"""NVIDIA's own configuration file (k8s-device-plugin's ``version: v1``), read by this backend.

``flags:`` and ``sharing.timeSlicing.resources`` become the keys ``NvidiaConfig.from_mapping``
reads, so an operator's ConfigMap from NVIDIA's plugin works unchanged where the meaning is
the same; where it is not, the error names NVIDIA's key and says what to write instead.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from devplugin_sdk.config import ConfigReader, FileOptions, shown
from devplugin_sdk.errors import ConfigError

__all__ = ["translated"]

_SEE = "see docs/deployment.md, 'Coming from NVIDIA's plugin'"
# flags.<key> and flags.plugin.<key> that mean what this backend's top-level key of that name
# means.
_FLAGS = ("migStrategy",)
_PLUGIN_FLAGS = ("passDeviceSpecs", "deviceListStrategy")
# NVIDIA's flags accepted at the one value that is what this backend does anyway: a failed
# nvmlInit fails the start; device IDs are GPU and MIG UUIDs.
_SAME: dict[str, Any] = {"failOnInitError": True}
_SAME_PLUGIN: dict[str, Any] = {"deviceIDStrategy": "uuid"}


def translated(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """``config`` with NVIDIA's ``flags:`` and ``sharing.timeSlicing.resources`` in this
    backend's terms (``config`` itself when it has neither).

    Raises:
        ConfigError: naming NVIDIA's key, when it has no counterpart here or says something
            this backend's keys cannot (per-resource replica counts, renames, device subsets).
    """
    reader = ConfigReader(config)
    slicing = (
        reader.section("sharing").section("timeSlicing") if _mapping(config, "sharing") else None
    )
    has_resources = slicing is not None and slicing.has("resources")
    if not reader.has("flags") and not has_resources:
        return config
    out = FileOptions(config.items(), sdk_keys=getattr(config, "sdk_keys", ()))
    if reader.has("flags"):
        _flags(reader.section("flags"), out)
        del out["flags"]
    if slicing is not None and has_resources:
        out["sharing"] = {**config["sharing"], "timeSlicing": _time_slicing(slicing, config)}
    if isinstance(config, FileOptions):
        config.replaced_by(out)  # `devplugin run` checks what the backend reads: the translation
    return out


def _mapping(config: Mapping[str, Any], key: str) -> bool:
    return isinstance(config.get(key), Mapping)


def _flags(flags: ConfigReader, out: dict[str, Any]) -> None:
    plugin = flags.section("plugin")
    flags.known(*_FLAGS, *_SAME, "plugin", hint=_hints(flags))
    plugin.known(*_PLUGIN_FLAGS, *_SAME_PLUGIN, hint=_hints(plugin))
    for section, names in ((flags, _FLAGS), (plugin, _PLUGIN_FLAGS)):
        for name in names:
            if not section.has(name):
                continue
            if name in out:
                raise ConfigError(
                    section.key(name), f"is also given as {name}: keep one of the two"
                )
            out[name] = section.data[name]
    for section, same in ((flags, _SAME), (plugin, _SAME_PLUGIN)):
        for name, value in same.items():
            if section.has(name) and section.data[name] != value:
                got = section.data[name]
                raise ConfigError(
                    section.key(name),
                    f"only {json.dumps(value)} is supported here, got "
                    f"{json.dumps(got) if isinstance(got, (bool, str)) else shown(got)}; {_SEE}",
                )


# NVIDIA's other flags (v1 config, flags: and flags.plugin:): named as NVIDIA's when met, so
# that a typo of one of ours still gets its did-you-mean.
_NVIDIA_ONLY = (
    "mpsRoot",
    "nvidiaDriverRoot",
    "driverRoot",
    "nvidiaDevRoot",
    "gdsEnabled",
    "mofedEnabled",
    "useNodeFeatureAPI",
    "deviceDiscoveryStrategy",
    "gfd",
    "cdiAnnotationPrefix",
    "nvidiaCTKPath",
    "containerDriverRoot",
)


def _hints(section: ConfigReader) -> dict[str, str]:
    """The unknown-key message for each of NVIDIA's flags this backend has no use for."""
    return {
        name: f"NVIDIA's flag {section.key(name)} has no counterpart here; {_SEE}"
        for name in _NVIDIA_ONLY
    }


def _time_slicing(slicing: ConfigReader, config: Mapping[str, Any]) -> dict[str, Any]:
    """NVIDIA's ``resources: [{name, replicas}]``: one replica count for the GPUs' resources
    (this backend has one count for every resource)."""
    if slicing.has("replicas"):
        raise ConfigError(slicing.key("resources"), "cannot be combined with replicas: keep one")
    entries = slicing.data["resources"]
    if not isinstance(entries, list) or not entries:
        raise ConfigError(
            slicing.key("resources"),
            "must be a non-empty list of {name, replicas} (NVIDIA's form), or use "
            f"sharing.timeSlicing.replicas; got {shown(entries)}",
        )
    counts: dict[int, str] = {}
    for item in slicing.sections("resources"):
        item.known("name", "replicas", hint=_SLICING_HINTS)
        item.resource_name("name")
        counts.setdefault(item.integer("replicas", 1, minimum=1), item.key("replicas"))
    if len(counts) > 1:
        first, second = list(counts.values())[:2]
        raise ConfigError(
            second,
            f"differs from {first}: one replica count applies to every resource here "
            "(sharing.timeSlicing.replicas)",
        )
    (replicas,) = counts
    section = dict(config["sharing"]["timeSlicing"])
    del section["resources"]
    section["replicas"] = replicas
    return section


_SLICING_HINTS = {
    "rename": "use sharing.timeSlicing.renameByDefault (for every resource)",
    "devices": "time-slicing a subset of the GPUs is not supported; every GPU is shared",
}
