"""Fixtures of the position-scheme tests."""

from __future__ import annotations

import pytest

import vitrel.pos.registry as registry


@pytest.fixture
def unregister():
    """Names registered by a test are removed after it (the registry is global: other tests list every scheme)."""
    before = set(registry._REGISTRY)
    yield
    for name in set(registry._REGISTRY) - before:
        del registry._REGISTRY[name]
