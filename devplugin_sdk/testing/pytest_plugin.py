"""The pytest plugin of ``devplugin-sdk[test]``: fixtures that serve a plugin to a fake kubelet.

Registered through the ``pytest11`` entry point, so installing the package is enough (no
``conftest.py``, no ``anyio_mode``). Fixtures:

* ``fake_kubelet``: a running ``FakeKubelet`` on a temporary directory;
* ``served_plugin``: the plugin of your ``device_plugin`` fixture, served to ``fake_kubelet``
  (``devplugin_sdk.testing.serving``); it yields ``runner.Running``;
* ``served_driver``: the same plugin served as the DRA driver of your ``dra_driver`` fixture on a
  ``devplugin_sdk.testing.DraNode`` of its own (kubelet, in-memory API), which it yields ready.

An ``async def`` test that asks for one of them runs on anyio's asyncio backend (``grpc.aio``
needs asyncio) without a marker; any other async test needs ``@pytest.mark.anyio`` as usual.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Generator, Sequence
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:  # imported by the fixtures: pytest loads this module in every session
    from devplugin_sdk.kubelet.fake import FakeKubelet
    from devplugin_sdk.plugin import DevicePlugin
    from devplugin_sdk.runner import Running
    from devplugin_sdk.testing import DraNode

__all__ = ["device_plugin", "dra_driver", "fake_kubelet", "served_driver", "served_plugin"]

_OURS = frozenset({"fake_kubelet", "served_driver", "served_plugin"})


@pytest.hookimpl(hookwrapper=True)
def pytest_pycollect_makeitem(
    collector: pytest.Module | pytest.Class, name: str, obj: object
) -> Generator[None, Any, None]:
    """Mark ``async def`` tests that take our fixtures for anyio, before anyio's own hook looks
    for the marker."""
    if (
        inspect.iscoroutinefunction(obj)
        and collector.istestfunction(obj, name)
        and _OURS & inspect.signature(obj).parameters.keys()
    ):
        pytest.mark.anyio(obj)
    yield


def _asyncio_only(anyio_backend: object) -> None:
    name = anyio_backend if isinstance(anyio_backend, str) else anyio_backend[0]  # type: ignore[index]
    if name != "asyncio":
        # Not pytest.skip: its BaseException would end anyio's test runner.
        raise RuntimeError(
            f"devplugin-sdk's fixtures need anyio's asyncio backend (grpc.aio), not {name}: "
            "make the anyio_backend fixture return 'asyncio'"
        )


@pytest.fixture
async def fake_kubelet(anyio_backend: object) -> AsyncIterator[FakeKubelet]:
    """A ``FakeKubelet`` serving on a temporary directory for the test; removed after it.

    ``fake_kubelet.settings()`` gives plugin settings pointing at it, with fast test timings.
    """
    from devplugin_sdk.kubelet.fake import FakeKubelet  # noqa: PLC0415

    _asyncio_only(anyio_backend)
    async with FakeKubelet() as kubelet:
        yield kubelet


@pytest.fixture
def device_plugin() -> DevicePlugin | Sequence[DevicePlugin]:
    """What ``served_plugin`` serves: define this fixture in your tests or ``conftest.py``."""
    pytest.fail(
        "served_plugin serves the plugin of a `device_plugin` fixture: define one that returns "
        "your plugin (or a list of plugins), e.g. `return AcmePlugin(dev=tmp_path)`",
        pytrace=False,
    )


@pytest.fixture
async def served_plugin(
    fake_kubelet: FakeKubelet,
    device_plugin: DevicePlugin | Sequence[DevicePlugin],
    anyio_backend: object,
) -> AsyncIterator[Running]:
    """The ``device_plugin`` fixture's plugin(s) served to ``fake_kubelet`` for the test.

    Yields once every plugin has discovered its devices (wait for the kubelet's view with
    ``fake_kubelet.wait_for_allocatable``); stops them as SIGTERM does after the test.
    """
    from devplugin_sdk.plugin import DevicePlugin  # noqa: PLC0415
    from devplugin_sdk.testing import serving  # noqa: PLC0415

    plugins = (device_plugin,) if isinstance(device_plugin, DevicePlugin) else device_plugin
    async with serving(*plugins, settings=fake_kubelet.settings()) as running:
        yield running


@pytest.fixture
def dra_driver() -> str:
    """The DRA driver's name ``served_driver`` serves as: define this fixture in your tests or
    ``conftest.py``."""
    pytest.fail(
        "served_driver serves the `device_plugin` fixture's plugin as a DRA driver: define a "
        "`dra_driver` fixture that returns the driver's name, e.g. `return 'widget.acme.com'`",
        pytrace=False,
    )


@pytest.fixture
async def served_driver(
    device_plugin: DevicePlugin | Sequence[DevicePlugin],
    dra_driver: str,
    anyio_backend: object,
) -> AsyncIterator[DraNode]:
    """The ``device_plugin`` fixture's plugin(s) served as the DRA driver ``dra_driver`` on a
    ``DraNode`` of their own for the test.

    Yields the node once the driver's pool is published and the kubelet has registered it
    (``node.published()``, ``node.claim(...)``, ``node.prepare(pod)``, ``node.spec(claim)``);
    stops the driver as SIGTERM does, then the kubelet, after the test.
    """
    from devplugin_sdk.plugin import DevicePlugin  # noqa: PLC0415
    from devplugin_sdk.testing import DraNode  # noqa: PLC0415

    _asyncio_only(anyio_backend)
    plugins = (device_plugin,) if isinstance(device_plugin, DevicePlugin) else device_plugin
    async with DraNode(*plugins, driver=dra_driver) as node:
        yield node
