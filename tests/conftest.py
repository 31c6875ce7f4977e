"""Shared test setup: unit tests must not start Ray (ARCHITECTURE.md tests/unit rule)."""

from __future__ import annotations

import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def _no_ray_in_unit_tests(request, monkeypatch):
    """In tests/unit and tests/compile, any call to ray.init fails the test."""
    path = str(request.node.fspath)
    if os.sep + "integration" + os.sep in path or os.sep + "gpu" + os.sep in path:
        yield
        return
    try:
        import ray
    except ImportError:
        yield
        return

    def forbidden(*args, **kwargs):
        raise AssertionError("unit tests must not start Ray; move this test to tests/integration")

    monkeypatch.setattr(ray, "init", forbidden)
    yield
