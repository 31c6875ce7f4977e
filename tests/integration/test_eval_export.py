"""Evaluation during training and export, on the real stack: one small quickstart run, then the two commands."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import numpy as np
import pytest
from runs import plan_for

pytestmark = pytest.mark.integration


def test_eval_and_export_during_a_run_then_the_commands(ray_cluster, workdir, capsys):
    import mlflow

    from rlflow.cli import main
    from rlflow.runtime import export
    from rlflow.runtime.driver import Run
    from rlflow.runtime.evaluation import held_out
    from rlflow.runtime.hooks import RunHooks

    published: dict = {}

    def keep_published(run):
        """Keeps a copy of the weights the final export is written from (the store's copy dies with the run)."""
        from rlflow.runtime.parameter_server import fetch_state

        published.update({k: t.numpy() for k, t in fetch_state(run.weights.ref).items()})

    plan = plan_for("quickstart", "data.eval=0.1", "data.eval_size=12", "data.eval_k=2", "stages.train.eval_every=2",
                    "stages.train.save_every=2")
    run = Run(plan, out_dir=Path(".rlflow") / "runs" / plan["name"], log=lambda *a: None,
              hooks=RunHooks(before_export=keep_published))
    run.run()
    assert [h["step"] for h in run.history] == [1, 2, 3]

    # evaluations of the initial weights, every 2 steps and the last step: in MLflow at those steps, in the history
    client = mlflow.MlflowClient()
    for key in ("eval/accuracy", "eval/pass_at_2", "eval/reward_mean", "eval/sample_reward_mean"):
        assert sorted(m.step for m in client.get_metric_history(run.tracker.run_id, key)) == [0, 2, 3], key
    assert any(k.startswith("eval/accuracy_len_") for k in mlflow.get_run(run.tracker.run_id).data.metrics)
    rows = {h["step"]: h for h in run.history}
    assert "eval/accuracy" in rows[2] and "eval/accuracy" in rows[3] and "eval/accuracy" not in rows[1]
    assert [e["step"] for e in run.metrics.evals] == [0, 2, 3]
    assert 0 <= run.summary()["eval_last"]["eval/accuracy"] <= 1 and run.summary()["eval_last"]["step"] == 3

    # held-out prompts are never drawn for training: not one group in the ledger has one
    db = sqlite3.connect(run.out_dir / "ledger.sqlite")
    prompts = [json.loads(p)["prompt"] for (p,) in db.execute("select prompt from groups")]
    trained = db.execute("select count(*) from groups where state='trained'").fetchone()[0]
    assert trained == 3 * run.control["batch_size"] and prompts
    assert not [p for p in prompts if held_out(p, 0.1)]

    # the final export: the last published weights, loadable by transformers, logged as the run's MLflow model
    from transformers import AutoModelForCausalLM

    out = run.out_dir / "export"
    assert (out / "step-2" / "model.safetensors").is_file()
    assert json.loads((out / export.INFO).read_text())["version"] == run.weights.version == 3
    loaded = {k: v.detach().numpy() for k, v in AutoModelForCausalLM.from_pretrained(out).state_dict().items()}
    assert set(loaded) == set(published)
    for k, v in published.items():
        np.testing.assert_array_equal(loaded[k], v, err_msg=k)
    models = mlflow.search_logged_models(experiment_ids=[mlflow.get_run(run.tracker.run_id).info.experiment_id],
                                         output_format="list")
    # this run's: one model. (In one full default run the experiment also held a model of another run, not this one's;
    # whose is not known yet: the assertion counts this run's models only.)
    assert [m.source_run_id for m in models].count(run.tracker.run_id) == 1
    assert [m.name for m in models if m.source_run_id == run.tracker.run_id] == ["quickstart-step3"]  # <pipeline>-step<N>

    # rlflow export: the same weights rebuilt from the DeepSpeed checkpoint, without Ray
    capsys.readouterr()
    assert main(["export", str(run.out_dir), "-o", "from_checkpoint"]) == 0
    said = capsys.readouterr().out
    assert "wrote from_checkpoint" in said and "from_pretrained('from_checkpoint')" in said
    rebuilt = export.load_state("from_checkpoint")
    for k, v in export.load_state(out).items():
        np.testing.assert_array_equal(rebuilt[k], v, err_msg=k)  # rtol 0
    assert main(["export", "no-such-run"]) == 2

    # rlflow eval on the export: the run's held-out split and reward, from the plan the export carries
    assert main(["eval", "from_checkpoint", "--n", "6", "--k", "2"]) == 0
    table = capsys.readouterr().out
    assert "accuracy" in table and "pass_at_2" in table and "held out: 0.1" in table
