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
