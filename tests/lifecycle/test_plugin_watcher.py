"""Registration through the kubelet's plugin watcher (plugins_registry), as an alternative path."""

from __future__ import annotations

import anyio
import anyio.lowlevel
from sdk_helpers import RESOURCE, widgets

from devplugin_sdk import Health
from devplugin_sdk._wire.server import file_id
from devplugin_sdk.testing import FakeKubelet, StaticPlugin, serving


async def test_registers_through_the_plugin_watcher() -> None:
    """The plugin serves GetInfo and DevicePlugin on one socket in plugins_registry."""
    async with FakeKubelet(plugin_watcher=True) as kubelet:
        plugin = StaticPlugin(RESOURCE, widgets(3))
        async with serving(plugin, settings=kubelet.settings()):
            await kubelet.wait_for_allocatable(RESOURCE, 3)
            (registration,) = kubelet.successful_registrations(RESOURCE)
            socket = kubelet.registry_directory / "acme.com_widget.sock"
            assert registration.endpoint == str(socket)
            # Nothing of ours in device-plugins: kubelet start would delete it.
            assert sorted(p.name for p in kubelet.directory.iterdir()) == ["kubelet.sock"]
            plugin.set_health("w2", Health.UNHEALTHY)
            await kubelet.wait_for_allocatable(RESOURCE, 2)
            got = await kubelet.allocate(RESOURCE, 1)
            assert got.allocation.device_nodes


async def test_kubelet_restart_needs_no_action_from_the_plugin() -> None:
    """The kubelet re-discovers the same socket after its own restart."""
    async with FakeKubelet(plugin_watcher=True) as kubelet:
        async with serving(StaticPlugin(RESOURCE, widgets(2)), settings=kubelet.settings()):
            await kubelet.wait_for_allocatable(RESOURCE, 2)
            socket = kubelet.registry_directory / "acme.com_widget.sock"
            before = file_id(socket)
            await kubelet.restart()
            await kubelet.wait_for_registrations(RESOURCE, 2)
            await kubelet.wait_for_allocatable(RESOURCE, 2)
            assert file_id(socket) == before  # same socket: the plugin did nothing
            assert kubelet.connections(RESOURCE) == 1


async def test_a_removed_socket_is_recreated_and_registered_again() -> None:
    """Deleting the socket deregisters the plugin; it serves again on a fresh one."""
    async with FakeKubelet(plugin_watcher=True) as kubelet:
        async with serving(StaticPlugin(RESOURCE, widgets(2)), settings=kubelet.settings()):
            await kubelet.wait_for_allocatable(RESOURCE, 2)
            (kubelet.registry_directory / "acme.com_widget.sock").unlink()
            await kubelet.wait_for_registrations(RESOURCE, 2)
            await kubelet.wait_for_allocatable(RESOURCE, 2)


async def test_a_failed_registration_makes_the_plugin_start_over() -> None:
    """v1.32 does not retry after recording the plugin: the plugin recreates its socket."""
    async with FakeKubelet(plugin_watcher=True) as kubelet:
        # The first connection after GetInfo fails: the kubelet says plugin_registered=false.
        kubelet.reject("failed to dial device plugin: context deadline exceeded", times=1)
        async with serving(StaticPlugin(RESOURCE, widgets(2)), settings=kubelet.settings()):
            await kubelet.wait_for_allocatable(RESOURCE, 2)
            assert [r.error is None for r in kubelet.registrations] == [False, True]


async def test_auto_picks_the_plugin_watcher_when_plugins_registry_exists() -> None:
    async with FakeKubelet(plugin_watcher=True) as kubelet:
        settings = kubelet.settings(registration="auto")
        async with serving(StaticPlugin(RESOURCE, widgets(1)), settings=settings):
            await kubelet.wait_for_allocatable(RESOURCE, 1)
            assert (kubelet.registry_directory / "acme.com_widget.sock").exists()
    async with FakeKubelet() as kubelet:  # no plugins_registry: classic registration
        settings = kubelet.settings(registration="auto")
        assert not kubelet.registry_directory.exists()
        async with serving(StaticPlugin(RESOURCE, widgets(1)), settings=settings):
            await kubelet.wait_for_allocatable(RESOURCE, 1)
            assert (kubelet.directory / "acme.com_widget.sock").exists()


async def test_socket_removed_on_shutdown() -> None:
    """On the plugin-watcher path removing the socket is the deregistration."""
    async with FakeKubelet(plugin_watcher=True) as kubelet:
        async with serving(StaticPlugin(RESOURCE, widgets(1)), settings=kubelet.settings()):
            await kubelet.wait_for_allocatable(RESOURCE, 1)
        assert not (kubelet.registry_directory / "acme.com_widget.sock").exists()
        await kubelet.wait_for_allocatable(RESOURCE, 0)
        await anyio.lowlevel.checkpoint()
