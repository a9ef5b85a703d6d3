"""The pytest plugin (issue 27, item 4): a plugin author's tests, run as they run them.

A project of its own in a temporary directory (no ``conftest.py``, no pytest configuration,
no ``anyio_mode``), and ``python -m pytest`` in it: the installed package's ``pytest11`` entry
point brings ``fake_kubelet``, ``served_plugin`` and the ``device_plugin`` fixture it serves.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

PLUGIN = """
from collections.abc import Sequence
from pathlib import Path

from devplugin_sdk import Device, DeviceNode, DevicePlugin


class AcmePlugin(DevicePlugin):
    resource_name = "acme.com/widget"

    def __init__(self, dev: Path) -> None:
        super().__init__()
        self.dev = dev

    async def discover(self) -> Sequence[Device]:
        return [Device(p.name, device_nodes=(DeviceNode(str(p)),)) for p in sorted(self.dev.glob("acme*"))]
"""

TESTS = """
import pytest

from acme_plugin import AcmePlugin
from devplugin_sdk.testing import FakeKubelet, serving


@pytest.fixture
def device_plugin(tmp_path):
    for name in ("acme0", "acme1"):
        (tmp_path / name).touch()
    return AcmePlugin(tmp_path)


async def test_served(fake_kubelet, served_plugin):
    await fake_kubelet.wait_for_allocatable("acme.com/widget", 2)
    got = await fake_kubelet.allocate("acme.com/widget", 1)
    assert got.allocation.device_nodes[0].host_path.endswith(got.device_ids[0])
    assert [s.resource for s in served_plugin.statuses()] == ["acme.com/widget"]


async def test_served_again_in_a_fresh_kubelet(fake_kubelet, served_plugin):
    await fake_kubelet.wait_for_allocatable("acme.com/widget", 2)
    await fake_kubelet.restart()
    await fake_kubelet.wait_for_allocatable("acme.com/widget", 2)


@pytest.mark.anyio
async def test_a_body_error_reaches_pytest_raises(tmp_path):
    with pytest.raises(KeyError):
        async with FakeKubelet() as kubelet, serving(AcmePlugin(tmp_path), settings=kubelet.settings()):
            kubelet.devices("acme.com/widget")["nope"]
"""


def _pytest(project: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTEST_ADDOPTS")}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )


def test_a_project_with_no_pytest_configuration_gets_the_fixtures(tmp_path: Path) -> None:
    (tmp_path / "acme_plugin.py").write_text(PLUGIN)
    (tmp_path / "test_acme.py").write_text(TESTS)
    result = _pytest(tmp_path)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "3 passed" in result.stdout


def test_served_plugin_without_a_device_plugin_fixture_says_what_to_define(
    tmp_path: Path,
) -> None:
    (tmp_path / "test_x.py").write_text("async def test_x(served_plugin):\n    pass\n")
    result = _pytest(tmp_path)
    assert result.returncode == 1
    assert (
        "served_plugin serves the plugin of a `device_plugin` fixture: define one that returns"
        in result.stdout
    )
