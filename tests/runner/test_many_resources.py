"""Several resources in one process: concurrent, independent, recovered together."""

from __future__ import annotations

import pytest
from sdk_helpers import ROOT, widgets

from devplugin_sdk import Health
from devplugin_sdk.testing import FakeKubelet, StaticPlugin, serving

README = ROOT / "README.md"


async def test_serves_several_resources_at_once(kubelet: FakeKubelet) -> None:
    plugins = [StaticPlugin(f"acme.com/pool{i}", widgets(i + 1)) for i in range(3)]
    async with serving(*plugins, settings=kubelet.settings()):
        for i in range(3):
            await kubelet.wait_for_allocatable(f"acme.com/pool{i}", i + 1)
        plugins[1].set_health("w0", Health.UNHEALTHY)
        await kubelet.wait_for_allocatable("acme.com/pool1", 1)
        assert kubelet.allocatable("acme.com/pool0") == 1
        assert kubelet.allocatable("acme.com/pool2") == 3
        await kubelet.restart()
        for i, expected in enumerate((1, 1, 3)):
            await kubelet.wait_for_allocatable(f"acme.com/pool{i}", expected)
            assert kubelet.connections(f"acme.com/pool{i}") == 1


async def test_two_plugins_for_one_resource_are_refused(kubelet: FakeKubelet) -> None:
    with pytest.raises(ValueError, match=r"share the resource name acme\.com/x"):
        async with serving(
            StaticPlugin("acme.com/x", widgets(1)),
            StaticPlugin("acme.com/x", widgets(1), socket_name="other.sock"),
            settings=kubelet.settings(),
        ):
            pass


async def test_readme_plugin_runs(kubelet: FakeKubelet) -> None:
    """The 30-line plugin in the README is real code that registers."""
    import re

    readme = README.read_text()
    code = re.search(r"```python\n(.*?)```", readme, re.S)
    assert code is not None
    assert len(code.group(1).splitlines()) <= 30
    namespace: dict[str, object] = {"__name__": "readme_plugin"}
    exec(compile(code.group(1), "README.md", "exec"), namespace)
    plugin = namespace["AcmePlugin"]()  # type: ignore[operator]
    async with serving(plugin, settings=kubelet.settings()):
        await kubelet.wait_for_registrations("acme.com/widget", 1)
        await kubelet.wait_for(
            lambda: kubelet.messages("acme.com/widget") >= 1, what="a first list"
        )
