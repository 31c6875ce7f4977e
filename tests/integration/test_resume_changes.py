"""A real run resumed with changes (rlflow/runtime/run_fingerprint.py): harmless ones are applied and said, a changed
batch is refused before anything starts, and its way out (the checkpoint's weights exported, a new run's model.path)
is a model directory compile takes. The refusal of each kind: tests/unit/runtime/test_run_fingerprint.py."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
from runs import plan_for

from rlflow.cli import main
from rlflow.compiler import compile_pipeline
from rlflow.errors import PipelineInvalid

pytestmark = pytest.mark.integration


def test_a_resume_applies_more_steps_and_refuses_a_new_batch_with_a_way_out(ray_cluster, workdir, capsys):
    from rlflow.runtime.launch import launch

    first = launch(plan_for("quickstart", "stages.train.steps=1"), log=lambda *a: None)
    run_dir = Path(first["run_dir"])
    assert first["steps"] == 1 and (run_dir / "fingerprint.json").is_file()
    said = []
    resumed = launch(plan_for("quickstart", "stages.train.steps=2", "data.eval_size=64"), resume=True, log=said.append)
    assert resumed["run_dir"] == str(run_dir) and resumed["steps"] == 2
    assert [s for s in said if s.startswith("resume: ")] == [
        "resume: applied what changed since the run started: data.eval_size 128 -> 64; stages.train.steps 1 -> 2"]

    with pytest.raises(PipelineInvalid) as e:  # refused before anything starts
        launch(plan_for("quickstart", "stages.train.steps=3", "stages.buffer.batch_groups=4"), resume=True)
    (p,) = e.value.problems
    assert p.rule == "resume-changed-batch" and "groups per step 2 -> 4" in p.message
    export, new_run = p.fix.split(": ", 1)[1].split(" && ")
    assert main(shlex.split(export)[1:]) == 0  # rlflow export RUN -o DIR: the checkpoint's weights
    model_path = next(a for a in shlex.split(new_run) if a.startswith("model.path=")).split("=", 1)[1]
    plan = compile_pipeline(Path(__file__).resolve().parents[2] / "pipelines" / "quickstart.yaml", [f"model.path={model_path}"])
    assert Path(plan["pipeline"]["model"]["path"]) == Path(model_path).resolve()  # a new run from those weights compiles
    assert "Traceback" not in capsys.readouterr().err
