"""Shared set-up for tests/unit, whose folders mirror the code (runtime/, stages/, operators/, sim/, compiler/ for
rlflow's top-level modules, repo/ for checks over the whole repository).

Being a conftest.py in a folder without __init__.py, it also puts tests/unit on sys.path (pytest's default
"prepend" import mode), so tests in any subfolder import the helpers beside it (`from engine_helpers import ...`);
tests/conftest.py does the same for tests/ (trainer_batches.py, checkpoint_drill.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def repo() -> Path:
    """The repository's root."""
    return REPO


@pytest.fixture(scope="session")
def repeat_model_dir():
    """The default warm-started tiny Llama on the `repeat` task (rlflow.stages.tiny_model; its cache is shared across
    runs on a machine): what the engine, episode and weight-checksum tests generate with."""
    from rlflow.stages.tiny_model import build_tiny_llama

    return build_tiny_llama("repeat", progress=lambda line: None)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> str:
    """A randomly initialised 2-layer Llama (tests/trainer_batches.py, seed 0): what the trainer tests train."""
    from trainer_batches import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture
def quickstart_plan() -> dict:
    """A minimal pipeline, compiled: pipelines/quickstart.yaml, the plan most unit tests of the compiler start from."""
    from rlflow.compiler import compile_pipeline

    return compile_pipeline(REPO / "pipelines" / "quickstart.yaml")
