"""Integration tests start one real local Ray cluster for the session and end it by handle."""

from __future__ import annotations

import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="session")
def ray_cluster():
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import ray

    here = os.path.dirname(os.path.abspath(__file__))
    # tests reference rewards_for_tests.py by import string: workers must import it too
    pythonpath = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH", "")) if p)
    env = {"env_vars": {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
                        "PYTHONPATH": pythonpath}}
    ray.init(num_cpus=6, include_dashboard=False, runtime_env=env, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """Each run in its own working dir: its .rlflow/ checkpoints and sqlite MLflow store stay apart."""
    monkeypatch.chdir(tmp_path)
    return tmp_path
