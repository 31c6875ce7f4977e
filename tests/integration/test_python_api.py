"""The Python API from a script (issue #35): rlflow.compile and rlflow.run run a pipeline without the CLI, and the
result names the run directory, the MLflow run and the exported policy."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from runs import REPO, SMALL

pytestmark = pytest.mark.integration


def test_a_script_compiles_and_runs_a_pipeline(ray_cluster, workdir):
    # the script joins the session's cluster (`address`): a run starting its own is test_run_terminal.py's
    address = ray_cluster.get_runtime_context().gcs_address
    overrides = {kv.split("=", 1)[0]: kv.split("=", 1)[1] for kv in SMALL} | {"stages.train.steps": 2}
    script = workdir / "train.py"
    script.write_text(textwrap.dedent(f"""
        import json
        import rlflow

        plan = rlflow.compile({str(REPO / "pipelines" / "synchronous.yaml")!r}, overrides={overrides!r})
        lines = []
        result = rlflow.run(plan, address={address!r}, log=lines.append)
        print(json.dumps({{"steps": result.steps, "stopped": result.stopped, "run_dir": str(result.run_dir),
                          "mlflow_run_id": result.mlflow_run_id, "export_dir": str(result.export_dir),
                          "logged": len(lines)}}))
    """))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, str(script)], cwd=workdir, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["steps"] == 2 and not out["stopped"] and out["logged"] > 0  # progress went to the given log
    run_dir = workdir / ".rlflow" / "runs" / "synchronous"
    (only,) = run_dir.iterdir()
    assert out["run_dir"] == str(only) and json.loads((only / "summary.json").read_text())["steps"] == 2
    assert out["mlflow_run_id"] and (only / "export" / "config.json").exists() and out["export_dir"] == str(only / "export")
