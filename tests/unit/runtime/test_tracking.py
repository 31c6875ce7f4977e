"""MLflow as a user sees it (rlflow/runtime/tracking.py, metric_names.py), read back from a real sqlite store: the
run's documented name, metrics grouped by prefix with the headline curves first, no step/version metrics, zero
counters held back, start-up times as tags, params without "None"."""

from __future__ import annotations

import re

import pytest

from rlflow.plan_model import Plan
from rlflow.runtime import metric_names
from rlflow.runtime.metric_names import GROUPS, mlflow_key

pytest.importorskip("mlflow")

TRAINER = {  # what stages/trainer.py returns for a step (and batch_shards.py merges over the ranks)
    "loss": 0.04, "pg_loss": 0.04, "kl": 0.0, "entropy": 1.1, "clip_frac": 0.0, "ratio_mean": 1.0,
    "importance_weight_mean": 1.0, "importance_weight_used_mean": 1.0, "importance_truncated_frac": 0.0,
    "importance_masked_frac": 0.0, "nonfinite": "", "grad_norm": 2.7, "importance_weight_max": 1.2,
    "reward_mean": 0.48, "tokens": 517, "micro_batches": 16, "step_time_s": 0.24, "version": 1, "lr": 3e-4,
    "rank_token_imbalance": 1.0,
}


def step_row(plan: Plan, step: int, **extra) -> dict:
    """A step row as driver.Run._finish_step builds it: metrics.py's row, the ledger's counts, the loop's clock."""
    from rlflow.operators.policy import Counters
    from rlflow.runtime.messages import StepResult
    from rlflow.runtime.metrics import Metrics

    metrics = Metrics(plan, log=lambda *a: None)
    metrics.rewarded("main", [0.0, 1.0, 1.0])
    info = Metrics.batch_info({"main-1/0": 1.0, "main-1/1": 0.0}, {"main-1": ["main-1/0", "main-1/1"]},
                              {"main-1": 1}, {"main-1/0": 4, "main-1/1": 6})
    counts = {"reward_failed": 0, "filtered_groups": 3, "dropped_groups": 0, "rerouted": 0, "aborted_trajectories": 0,
              "coord_cycles": 7, "coord_pulls": 1, "coord_routed": 40, "coord_interrupted": 0, "coord_rejected": 0,
              "coord_resyncs": 0}
    row = metrics.step_row(step, step, info, StepResult(TRAINER, "", 0.005, 1), 1.5, 2.0, 4.0, Counters(), counts,
                           None)
    row.update(ledger_trained=2, ledger_filtered=3, ledger_buffered=1, ledger_drawn=1, ledger_routed=15,
               ledger_generated=15, consumed=2, filtered=3, dropped=0, aborted=0, admitted=6,
               control_share=0.09, driver_cpu_share=0.08, steady_s=10.0, rollout_instances=1)
    row.update(extra)
    return row


def test_every_key_of_a_step_row_has_its_group(quickstart_plan):
    """No key of a real row falls to other/ (a new metric needs its line in metric_names.NAMES), and every logged
    name is in one of the documented groups."""
    plan = Plan.of(quickstart_plan)
    row = step_row(plan, 1, episodes=1, env_waiting_rollout_0=2, staleness_predicted=0.4, ranker_recall_top20=0.5,
                   nonfinite_steps=1, duplicate_rewards=1, resume_restored_groups=3, **{"eval/accuracy": 0.5})
    for per_task in (True, False):
        names = {k: mlflow_key(k, per_task=per_task) for k in row}
        assert not [k for k, n in names.items() if n and n.startswith(metric_names.OTHER + "/")], names
        assert {n.split("/")[0] for n in names.values() if n} <= set(GROUPS)
    assert mlflow_key("task/main/reward_all_mean", per_task=True) == "reward/main/mean"
    assert mlflow_key("task/main/reward_all_mean", per_task=False) is None
    assert mlflow_key("something_new") == "other/something_new"


def test_mlflow_run_reads_back_named_grouped_and_without_noise(quickstart_plan, tmp_path):
    import mlflow

    from rlflow.runtime.tracking import Tracker

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    quickstart_plan["pipeline"]["tracking"]["mlflow"].update(uri=uri, run_name=None, experiment=None)
    plan = Plan.of(quickstart_plan)
    tracker = Tracker(plan)
    rows = [step_row(plan, 1), step_row(plan, 2), step_row(plan, 3, dropped=2, ledger_dropped=2)]
    for row in rows:
        tracker.log_metrics(row, row["step"])
    tracker.log_metrics({"startup/ray_s": 4.4, "startup/first_step_s": 21.07}, 0)  # as the driver logs them
    tracker.log_metrics({"eval/accuracy": 0.25, "eval/prompts": 32, "eval/reward_failed": 0}, 2)
    tracker.end()

    client = mlflow.MlflowClient(uri)
    run = client.get_run(tracker.run_id)
    assert re.fullmatch(r"quickstart-\d{8}-\d{6}", run.info.run_name), run.info.run_name
    keys = set(run.data.metrics)
    assert all(k.split("/")[0] in GROUPS for k in keys), sorted(keys)
    assert {"reward/mean", "reward/mean_trained", "train/loss", "staleness/mean", "rollout/trajectories_per_s",
            "system/ranks", "eval/accuracy", "staleness/hist/1"} <= keys
    assert not keys & {"step", "version", "system/step", "system/version"}
    # the headline curve sorts first in its section (MLflow's UI orders a section's charts alphabetically)
    for section, headline in (("reward", "reward/mean"), ("train", "train/loss")):
        assert min(k for k in keys if k.rsplit("/", 1)[0] == section) == headline
    # counters that stayed zero are not logged; one that moved is, from its first non-zero step on
    assert not keys & {"staleness/groups/aborted", "rollout/reward_failed", "rollout/coord/rejected", "train/policy/kl",
                       "eval/reward_failed", "eval/prompts"}
    assert "system/eval_prompts" in keys
    assert [m.step for m in client.get_metric_history(tracker.run_id, "staleness/groups/dropped")] == [3]
    assert "reward/main/mean" not in keys  # one task type: the per-task numbers are the batch's
    assert not [k for k in keys if "startup" in k]
    assert run.data.tags["startup.ray_s"] == "4.40" and run.data.tags["startup.first_step_s"] == "21.07"
    params = run.data.params
    assert params["stages.train.steps"] == str(plan.trainer.steps) and "control.staleness" in params
    assert "None" not in params.values() and "tracking.mlflow.run_name" not in params

    resumed = Tracker(plan, run_id=tracker.run_id)  # --resume continues the run under its name
    resumed.log_metrics(step_row(plan, 4), 4)
    resumed.end()
    again = client.get_run(tracker.run_id)
    assert again.info.run_name == run.info.run_name
    assert [m.step for m in client.get_metric_history(tracker.run_id, "train/loss")] == [1, 2, 3, 4]


def test_a_named_run_keeps_its_name(quickstart_plan, tmp_path):
    from rlflow.runtime.tracking import run_name

    assert run_name(Plan.of(quickstart_plan), now=0) == "quickstart-19700101-000000"
    quickstart_plan["pipeline"]["tracking"]["mlflow"]["run_name"] = "baseline"
    assert run_name(Plan.of(quickstart_plan)) == "baseline"


def test_the_tracking_page_names_every_metric(repo):
    """docs/guides/tracking.md covers each MLflow name metric_names gives (a name, or a family like
    `rollout/coord/*`), so a metric added to the table without its line in the docs fails here."""
    import fnmatch

    page = (repo / "docs" / "guides" / "tracking.md").read_text()
    patterns = [re.sub(r"<[a-z]+>", "*", p) for p in re.findall(r"`([a-z_]+/[^`\s]*)`", page)]
    names = {n for n in metric_names.NAMES.values() if n} | {n.format(task="main") for n in metric_names.TASK_NAMES.values()}
    missing = [n for n in sorted(names) if not any(fnmatch.fnmatchcase(n, p) for p in patterns)]
    assert not missing, f"docs/guides/tracking.md does not name {missing}"


def test_the_experiment_is_marked_as_model_training_and_a_chosen_kind_is_kept(quickstart_plan, tmp_path):
    """MLflow 3's UI opens an experiment without `mlflow.experimentKind` on its GenAI overview: rlflow's experiment
    says it holds model training; a kind someone picked in the UI since is not overwritten by the next run."""
    import mlflow

    from rlflow.runtime.tracking import EXPERIMENT_KIND_TAG, Tracker

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    quickstart_plan["pipeline"]["tracking"]["mlflow"].update(uri=uri, experiment=None)
    tracker = Tracker(Plan.of(quickstart_plan))
    tracker.end()
    client = mlflow.MlflowClient(uri)
    experiment = client.get_experiment_by_name("quickstart")
    assert experiment.experiment_id == tracker.experiment_id
    assert experiment.tags[EXPERIMENT_KIND_TAG] == "custom_model_development"

    client.set_experiment_tag(experiment.experiment_id, EXPERIMENT_KIND_TAG, "genai_development")
    Tracker(Plan.of(quickstart_plan)).end()
    assert client.get_experiment(experiment.experiment_id).tags[EXPERIMENT_KIND_TAG] == "genai_development"


def test_a_model_name_is_the_pipeline_and_step_in_characters_mlflow_accepts():
    from mlflow.utils.validation import _validate_logged_model_name

    from rlflow.runtime.tracking import model_name

    assert model_name("quickstart", 100) == "quickstart-step100"
    assert model_name("my.pipe/v2:'x'", 30) == "my-pipe-v2--x--step30"  # MLflow refuses / : . % " ' in a model's name
    _validate_logged_model_name(model_name("a.b/c:d%e\"f'g", 1))


@pytest.mark.slow  # ~30-90 s of MLflow's transformers flavor; a full run's model name: integration/test_eval_export.py
def test_the_logged_model_is_named_after_the_pipeline_and_step(quickstart_plan, tmp_path, repeat_model_dir):
    """An export logged through the tracker, read back from the store: `quickstart-step7`, not `model`."""
    import mlflow

    from rlflow.runtime.tracking import Tracker

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    quickstart_plan["pipeline"]["tracking"]["mlflow"].update(uri=uri, experiment=None)
    tracker = Tracker(Plan.of(quickstart_plan))
    try:
        tracker.log_model(repeat_model_dir, step=7, info={"pipeline": "quickstart", "step": 7})
    finally:
        tracker.end()
    models = mlflow.search_logged_models(experiment_ids=[tracker.experiment_id], output_format="list")
    assert [(m.name, m.source_run_id) for m in models] == [("quickstart-step7", tracker.run_id)]
