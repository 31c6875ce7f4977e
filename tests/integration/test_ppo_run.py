"""`algo: ppo` on the real stack: the critic trains on the trainer's ranks beside the policy, its metrics reach the
step rows and MLflow, and its checkpoint is the policy's tag; a resume restores it from there (slow)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from runs import plan_for

from rlflow.runtime.hooks import RunHooks

pytestmark = pytest.mark.integration

CRITIC = ("critic_loss", "value_mean", "value_clip_frac", "explained_variance", "critic_grad_norm")


class Crash(Exception):
    """The driver dies here (no checkpoint at exit), after the checkpoint of step 2."""


def crashed_ppo_run():
    """A PPO run whose driver dies after the checkpoint of step 2, checked: the critic trained and was saved with the
    policy. Returns its plan and run directory."""
    from rlflow.runtime.driver import Run

    def dies_after_step_2(run, _event):
        if run.step >= 2:
            raise Crash(f"the driver dies at step {run.step}")

    # the tiny model never earns exact_match's reward: DAPO's overlong shaping gives completions past 1 of their 8
    # tokens a negative one, so the returns vary and the critic has something to learn from step 1 on
    plan = plan_for("one_step", "stages.train.algo=ppo", "stages.train.ppo.critic_lr=1e-3",
                    "stages.train.overlong.cache_tokens=7", "stages.train.checkpoint_every=1")
    out = Path(".rlflow/runs/ppo")
    first = Run(plan, out_dir=out, log=lambda *a: None, hooks=RunHooks(on_event=dies_after_step_2))
    with pytest.raises(Crash):
        first.run()
    rows = {h["step"]: h for h in first.history}
    assert set(rows) == {1, 2} and all(set(CRITIC) <= set(h) for h in rows.values())
    assert rows[1]["value_mean"] == 0.0 and rows[2]["value_mean"] != 0.0  # a zero value head, then a trained one

    published = json.loads((out / "state.json").read_text())["checkpoint"]["tag"]
    assert published == "step-2"
    tag = out / "checkpoint" / published
    manifest = json.loads((tag / "rlflow_manifest.json").read_text())["files"]
    assert any(name.startswith("critic/") for name in manifest)  # one tag, one manifest: policy and critic
    saved = torch.load(tag / "critic" / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)["module"]
    assert saved["value_head.weight"].abs().sum() > 0
    return plan, out, first


def test_a_ppo_run_trains_its_critic_and_checkpoints_it_with_the_policy(ray_cluster, workdir):
    import mlflow

    _, _, first = crashed_ppo_run()
    data = mlflow.get_run(first.tracker.run_id).data
    assert {"train/critic/loss", "train/critic/value_mean", "train/critic/explained_variance"} <= set(data.metrics)


# the trainer's load of the critic and its optimizer state: tests/unit/stages/test_critic.py::
# test_a_checkpoint_restores_the_critic; a resume's load of the checkpoint on the real stack (the same
# load_checkpoint call): tests/integration/test_run.py::test_buffered_groups_are_restored_not_generated_again
@pytest.mark.slow
def test_a_ppo_resume_restores_its_critic(ray_cluster, workdir):
    import mlflow

    from rlflow.runtime.driver import Run

    plan, out, _ = crashed_ppo_run()
    resumed = Run(plan, out_dir=out, resume=True, log=lambda *a: None)
    resumed.run()
    step3 = {h["step"]: h for h in resumed.history}[3]
    # a fresh critic's first values are exactly 0 (zero head): the resumed step's are the restored critic's
    assert step3["value_mean"] != 0.0 and step3["critic_loss"] > 0
    data = mlflow.get_run(resumed.tracker.run_id).data
    assert {"train/critic/loss", "train/critic/value_mean", "train/critic/explained_variance"} <= set(data.metrics)
