"""The ``devplugin dra`` command group: tools for a DRA driver (``check``, ``simulate``).

Each subcommand lives in a module of its own and joins the group through its ``register``.
"""

from __future__ import annotations

from typing import Any

from devplugin_sdk.cli import dra_check

__all__ = ["register"]


def register(sub: Any) -> None:
    """Add ``devplugin dra`` and its subcommands to the top-level subparsers."""
    group = sub.add_parser("dra", help="tools for a DRA driver: check slices, simulate claims")
    commands = group.add_subparsers(dest="dra_command", required=True)
    dra_check.register(commands)
