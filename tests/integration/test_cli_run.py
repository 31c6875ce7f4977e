"""`rlflow run PIPELINE.yaml` from a shell (issue #32): the pipeline is compiled first where `rlflow compile` writes
its plan, and the overrides given to `run` apply to that run alone, recorded in its run directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from runs import REPO, SMALL

pytestmark = pytest.mark.integration
QUICKSTART = REPO / "pipelines" / "quickstart.yaml"


def test_rlflow_run_of_a_pipeline_file_compiles_it_and_runs_with_its_own_overrides(ray_cluster, workdir):
    # it joins the session's cluster (--address): a run starting its own is test_run_terminal.py's
    address = ray_cluster.get_runtime_context().gcs_address
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    small = [*SMALL, "stages.train.steps=1"]
    done = subprocess.run([sys.executable, "-m", "rlflow.cli", "run", "--address", address, str(QUICKSTART), *small],
                          cwd=workdir, env=env, capture_output=True, text=True, timeout=600)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-6000:]
    assert f"compiled {QUICKSTART} to .rlflow/plan.json" in done.stdout, out[-6000:]
    assert json.loads((workdir / ".rlflow" / "plan.json").read_text())["overrides"] == []  # the shared plan, as compiled
    (run_dir,) = (workdir / ".rlflow" / "runs" / "quickstart").iterdir()
    assert json.loads((run_dir / "run.json").read_text())["overrides"] == small
    ran = json.loads((run_dir / "plan.json").read_text())
    assert ran["pipeline"]["stages"]["train"]["steps"] == 1 and ran["overrides"] == small
