"""Fixtures of the examples' tests."""

from __future__ import annotations

from types import ModuleType

import pytest
from sdk_helpers import load_example


@pytest.fixture
def example(request: pytest.FixtureRequest) -> ModuleType:
    """The ``plugin.py`` beside the test (the examples are not a package: loaded by path)."""
    return load_example(request.path.parent.name)
