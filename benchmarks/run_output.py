"""What a benchmark reads back from an `rlflow run` it started in a scratch directory."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def run_summary(workdir: Path, what: str = "rlflow run") -> dict:
    """The summary of the newest run under `workdir`: `rlflow run` writes <run dir>/summary.json
    (rlflow/runtime/run_summary.py) in <workdir>/.rlflow/runs/<pipeline>/<run>/."""
    found = sorted(Path(workdir).glob(".rlflow/runs/*/*/summary.json"), key=lambda p: p.stat().st_mtime)
    if not found:
        sys.exit(f"{what}: no summary.json under {workdir}/.rlflow/runs (did the run end?)")
    return json.loads(found[-1].read_text())
