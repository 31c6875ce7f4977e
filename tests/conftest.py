"""Shared test setup: unit tests must not start Ray (docs/internals/testing.md)."""

from __future__ import annotations

import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread():
    """PLATFORM-NOTES: one torch thread per process; two threads on shared cores run about 10x slower."""
    try:
        import torch
    except ImportError:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


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


def pytest_collection_modifyitems(config, items):
    """`@pytest.mark.gpu` tests run only where a CUDA GPU is present."""
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items:
        return
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except ImportError:
        has_gpu = False
    if not has_gpu:
        skip = pytest.mark.skip(reason="needs a CUDA GPU")
        for item in gpu_items:
            item.add_marker(skip)
