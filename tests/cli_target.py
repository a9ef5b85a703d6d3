"""Targets for `devplugin run MODULE:ATTR` in tests/cli/test_cli.py."""

from __future__ import annotations

from sdk_helpers import widgets

from devplugin_sdk.testing import StaticPlugin


class TwoWidgets(StaticPlugin):
    def __init__(self) -> None:
        super().__init__("acme.com/widget", widgets(2))


def not_a_plugin() -> list[str]:
    return ["nope"]


def needs_arguments(count: int) -> StaticPlugin:
    return StaticPlugin("acme.com/widget", widgets(count))


class NoFromConfig(StaticPlugin):
    """A plugin class without ``from_config``: a file may still set the SDK's keys."""

    def __init__(self) -> None:
        super().__init__("acme.com/plain", widgets(1))
