"""The public face: a short, sorted, complete ``__all__`` at the top, each module's own ``__all__``,
and the import-linter contract that keeps the layers (run by ./scripts/test) covering every private
module."""

from __future__ import annotations

import importlib
import subprocess
import sys
import types

from sdk_helpers import ROOT, is_private, sdk_modules

import devplugin_sdk

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def test_top_level_all_is_short_sorted_and_complete() -> None:
    names = devplugin_sdk.__all__
    assert len(names) <= 20
    assert names == sorted(names, key=_isort_key)
    assert len(set(names)) == len(names)
    # Complete: every name the package loads on demand is exported, and once all are loaded
    # the package holds no other public object.
    assert set(devplugin_sdk._MODULE_OF) == set(names)
    for name in names:
        getattr(devplugin_sdk, name)
    public = {
        name
        for name, value in vars(devplugin_sdk).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    }
    assert public == set(names)


def test_importing_the_package_loads_nothing_else() -> None:
    """``import devplugin_sdk`` is free: names load from their modules on first use (the
    ``devplugin`` command pauses the garbage collector before loading the rest)."""
    code = (
        "import sys, devplugin_sdk\n"
        "before = sorted(m for m in sys.modules if m.startswith(('devplugin_sdk', 'grpc')))\n"
        "from devplugin_sdk import Device, run\n"
        "print(' '.join(before), '|', Device.__module__, run.__module__, dir(devplugin_sdk)[:1])\n"
        "devplugin_sdk.Nothing"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True
    )
    assert result.stdout.split() == [
        "devplugin_sdk",
        "|",
        "devplugin_sdk.types",
        "devplugin_sdk.runner",
        "['Allocation']",
    ]
    assert result.stderr.splitlines()[-1] == (
        "AttributeError: module 'devplugin_sdk' has no attribute 'Nothing'"
    )


def test_top_level_names_report_where_they_are_documented() -> None:
    for name in devplugin_sdk.__all__:
        value = getattr(devplugin_sdk, name)
        assert value.__module__.startswith("devplugin_sdk."), name


def test_no_cli_error_or_engine_type_at_the_top() -> None:
    assert "RegistrationError" not in devplugin_sdk.__all__  # the empty layer is gone
    assert "PluginEvent" not in devplugin_sdk.__all__
    assert not hasattr(devplugin_sdk.errors, "RegistrationError")


def _isort_key(name: str) -> tuple[int, str]:
    """The order ruff's RUF022 keeps ``__all__`` in: CONSTANTS, then Classes, then functions."""
    return (0 if name.isupper() else 1 if name[0].isupper() else 2, name)


def _public_modules() -> list[str]:
    """Every module and package with no private path part, the generated ``api/`` aside."""
    return [
        name
        for name in sdk_modules()
        if name != "devplugin_sdk" and not is_private(name) and name.split(".")[1] != "api"
    ]


def test_a_private_package_makes_its_modules_private() -> None:
    assert is_private("devplugin_sdk.dra._claims.preparer")
    assert is_private("devplugin_sdk._engine.state")
    assert not is_private("devplugin_sdk.dra.resources")
    assert not [m for m in _public_modules() if "._" in m]


def test_every_public_module_declares_a_sorted_all_of_names_it_defines() -> None:
    for name in _public_modules():
        module = importlib.import_module(name)
        declared = getattr(module, "__all__", None)
        assert declared is not None, f"{name} has no __all__"
        assert list(declared) == sorted(declared, key=_isort_key), f"{name}.__all__ unsorted"
        for item in declared:
            assert hasattr(module, item), f"{name}.__all__ names {item!r}, which it lacks"


def test_the_backend_contract_forbids_every_private_module() -> None:
    """A new private module cannot slip past the "backends use the public API" contract: each is
    forbidden itself or lies in a forbidden package."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    (contract,) = [c for c in config["contracts"] if c["name"].startswith("Backends use")]
    forbidden = set(contract["forbidden_modules"])
    # Any path part starting with "_" makes a module private: a private package's modules have
    # no underscore of their own (dra._claims.preparer). backends and testing own their private
    # modules; the contract forbids testing whole.
    private = {
        name
        for name in sdk_modules()
        if is_private(name) and name.split(".")[1] not in ("api", "backends", "testing")
    }
    unguarded = {
        name
        for name in private
        if not any(name == f or name.startswith(f + ".") for f in forbidden)
    }
    # Modules of a private package, with no underscore of their own, are among those checked.
    assert [name for name in private if not name.rsplit(".", 1)[1].startswith("_")]
    assert unguarded == set()


def test_the_plugin_event_alias_is_gone() -> None:
    """watch() is annotated with the two event types; there is no third name for their union."""
    import devplugin_sdk.plugin

    assert not hasattr(devplugin_sdk.plugin, "PluginEvent")
    annotation = devplugin_sdk.plugin.DevicePlugin.watch.__annotations__["return"]
    assert "HealthEvent | RescanEvent" in str(annotation)
