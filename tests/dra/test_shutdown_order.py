"""The order in which a DRA driver's plugins leave its pool: with the whole driver (SIGTERM
cancels every task at once, in no set order) only once the driver's sockets are down; alone (a
configuration reload) at once. Told by the driver's own pending cancellation, never by counting
the event loop's turns."""

from __future__ import annotations

import anyio
import pytest

from devplugin_sdk.dra._driver import _Going

pytestmark = pytest.mark.anyio


async def _stop(*, whole: bool, plugin_first: bool) -> tuple[bool, bool]:
    """Stop a plugin task (alone, or with the driver's task group); whether it saw the driver
    stopping, and whether it had to wait for the sockets."""
    going = _Going()
    seen: list[bool] = []
    waited: list[bool] = []

    async def driver(*, task_status: anyio.abc.TaskStatus[None]) -> None:
        async with anyio.create_task_group() as tg:
            await tg.start(going.watch)
            task_status.started()
            try:
                await anyio.sleep_forever()
            finally:
                with anyio.CancelScope(shield=True):
                    await anyio.sleep(0.05)  # the registrar stops its servers
                    going.sockets_down.set()

    async def plugin(scope: anyio.CancelScope) -> None:
        with scope:
            try:
                await anyio.sleep_forever()
            finally:
                seen.append(going.stopping())
                with anyio.CancelScope(shield=True), anyio.move_on_after(5):
                    await going.down()
                waited.append(going.sockets_down.is_set())

    async with anyio.create_task_group() as tg:
        scope = anyio.CancelScope()
        if plugin_first:
            tg.start_soon(plugin, scope)
        await tg.start(driver)
        if not plugin_first:
            tg.start_soon(plugin, scope)
        await anyio.sleep(0.01)
        if whole:
            tg.cancel_scope.cancel()
        else:
            scope.cancel()
            await anyio.sleep(0.01)
            assert waited == [False]
            tg.cancel_scope.cancel()
    return seen[0], waited[0]


@pytest.mark.parametrize("plugin_first", [True, False])
async def test_a_plugin_stopped_with_the_driver_leaves_once_its_sockets_are_down(
    plugin_first: bool,
) -> None:
    assert await _stop(whole=True, plugin_first=plugin_first) == (True, True)


@pytest.mark.parametrize("plugin_first", [True, False])
async def test_a_plugin_stopped_alone_leaves_at_once(plugin_first: bool) -> None:
    assert await _stop(whole=False, plugin_first=plugin_first) == (False, False)
