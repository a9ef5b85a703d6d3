"""Helpers of the DRA tests: the driver name most of them serve as."""

from __future__ import annotations

DRIVER = "widget.acme.com"
