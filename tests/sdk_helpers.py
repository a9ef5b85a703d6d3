"""Small helpers shared by the SDK's own tests (importable thanks to pytest's pythonpath)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import anyio

from devplugin_sdk import Device, DeviceNode, HealthEvent
from devplugin_sdk.testing import WatchedEvents

RESOURCE = "acme.com/widget"
ROOT = Path(__file__).resolve().parents[1]  # the checkout
EXAMPLES = ROOT / "examples"


def widgets(count: int = 4, **kwargs: object) -> list[Device]:
    """``count`` devices w0..wN, each with its own device node."""
    return [
        Device(f"w{i}", device_nodes=(DeviceNode(f"/dev/widget{i}"),), **kwargs)  # type: ignore[arg-type]
        for i in range(count)
    ]


async def first_rescan(events: WatchedEvents, count: int) -> None:
    """Take the ``count`` health statements of a watch's first rescan; return once the watch
    waits for the next change."""
    for event in await events.take(count):
        assert isinstance(event, HealthEvent), event
    await anyio.wait_all_tasks_blocked()


def load_example(name: str) -> ModuleType:
    """``examples/NAME/plugin.py``, loaded once by path (the examples are not a package and
    pytest runs with --import-mode=importlib); the examples' ``example`` fixture gives it."""
    module_name = f"{name}_example_plugin"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, EXAMPLES / name / "plugin.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # before running it: its dataclasses look themselves up
    spec.loader.exec_module(module)
    return module


def sdk_modules() -> list[str]:
    """Every module and package of ``devplugin_sdk`` by dotted name, read from the files (nothing is
    imported); ``__main__`` modules aside, generated ``api/`` code included."""
    package = ROOT / "devplugin_sdk"
    names = set()
    for path in package.rglob("*.py"):
        parts = ("devplugin_sdk", *path.relative_to(package).with_suffix("").parts)
        if parts[-1] == "__main__":
            continue
        names.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return sorted(names)


def is_private(module: str) -> bool:
    """Whether a dotted module name is private: any part below the package starts with ``_``
    (the modules of a private package are private, whatever their own names)."""
    return any(part.startswith("_") for part in module.split(".")[1:])


def figures(row: str, **values: Any) -> None:
    """One line of measured figures for docs/reliability.md (``pytest -s`` shows them)."""
    shown = ", ".join(
        f"{key}={value:.3f}" if isinstance(value, float) else f"{key}={value}"
        for key, value in values.items()
    )
    print(f"figures {row}: {shown}")
