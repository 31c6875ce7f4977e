"""`ruff check` is clean with the rules in pyproject.toml ([tool.ruff]); CI runs it here, as part of the suite."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


def test_ruff_check_is_clean():
    ruff = shutil.which("ruff") or str(Path(sys.executable).with_name("ruff"))
    if not Path(ruff).exists():
        pytest.skip("ruff is not installed: pip install -e '.[dev]'")
    out = subprocess.run([ruff, "check", "--no-cache", "."], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"ruff check found problems (fix them, or `ruff check --fix .`):\n{out.stdout}{out.stderr}"
