"""Issue 49 on the real stack: a run whose train stage distils from a teacher (train.distill) in two epochs of two
mini-batches a batch: the teacher scores the samples on the trainer, the reverse KL to it and the optimizer steps
reach the step rows and MLflow, and the control plane's accounting holds."""

from __future__ import annotations

import pytest
from runs import plan_for, run_plan
from test_run import assert_accounted

pytestmark = pytest.mark.integration


def test_a_run_distils_from_a_teacher_in_epochs_of_mini_batches(ray_cluster, workdir):
    from mlflow.tracking import MlflowClient

    from rlflow.plan_model import Plan
    from rlflow.runtime.model import prepare_model

    # the teacher: the student's own starting weights (the same tokenizer); the student moves away as it trains on
    # the rewards, and the teacher's term pulls it back
    teacher = prepare_model(Plan.of(plan_for("one_step")), log=lambda *a: None)
    plan = plan_for("one_step", f"stages.train.distill.teacher={teacher}", "stages.train.epochs=2",
                    "stages.train.mini_batches=2")
    [trainer] = [a for a in plan["actors"] if a["role"] == "trainer"]
    assert trainer["trainer_kwargs"]["distill"]["teacher"] == str(teacher)
    run = run_plan(plan)
    assert [h["step"] for h in run.history] == [1, 2, 3]
    assert_accounted(run)
    assert all(h["optimizer_steps"] == 4 and "distill_reverse_kl" in h for h in run.history)
    assert run.history[0]["ratio_mean_first"] == pytest.approx(1.0, abs=1e-3)
    client = MlflowClient(tracking_uri=run.tracker.uri)
    kl = client.get_metric_history(run.tracker.run_id, "train/policy/distill_reverse_kl")
    assert [m.step for m in kl] == [1, 2, 3]
