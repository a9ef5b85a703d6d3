"""What the body of ``async with FakeKubelet()`` / ``serving(...)`` raises comes out as itself.

A test's own assertion or lookup error must reach ``pytest.raises`` (and pytest's report)
unwrapped, not inside the task groups' nested ``ExceptionGroup``s (issue 27, item 4).
"""

from __future__ import annotations

import pytest

from devplugin_sdk import Device
from devplugin_sdk.testing import FakeKubelet, StaticPlugin, serving

RESOURCE = "acme.com/widget"


async def test_an_error_in_the_body_of_both_comes_out_as_itself() -> None:
    plugin = StaticPlugin(RESOURCE, [Device("w0")])
    with pytest.raises(KeyError, match="w9"):  # noqa: PT012 - the body is the point
        async with FakeKubelet() as kubelet, serving(plugin, settings=kubelet.settings()):
            await kubelet.wait_for_allocatable(RESOURCE, 1)
            kubelet.devices(RESOURCE)["w9"]


async def test_an_error_in_the_body_of_the_kubelet_alone_comes_out_as_itself() -> None:
    with pytest.raises(KeyError, match="nothing"):
        async with FakeKubelet():
            raise KeyError("nothing")


async def test_an_error_in_the_body_of_serving_alone_comes_out_as_itself() -> None:
    async with FakeKubelet() as kubelet:
        with pytest.raises(AssertionError, match="not 2"):  # noqa: PT012 - as above
            async with serving(StaticPlugin(RESOURCE, [Device("w0")]), settings=kubelet.settings()):
                await kubelet.wait_for_allocatable(RESOURCE, 1)
                raise AssertionError("not 2")
        assert not kubelet.is_registered(RESOURCE) or kubelet.allocatable(RESOURCE) == 0
