"""`rlflow run` on the real stack: Ray actors, Ray Data reward stream, DeepSpeed GRPO, MLflow, tiny model."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from rlflow.compiler import compile_pipeline
from rlflow.errors import PipelineInvalid

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
SMALL = ["stages.train.steps=3", "stages.buffer.batch_groups=2", "stages.rollout.group_size=4",
         "tracking.progress=false"]


def plan_for(name: str, *extra: str) -> dict:
    return compile_pipeline(REPO / "pipelines" / f"{name}.yaml", SMALL + list(extra))


def run_plan(plan: dict, **kwargs):
    from rlflow.runtime.driver import Run

    run = Run(plan, out_dir=Path(".rlflow") / "runs" / plan["name"], log=lambda *a: None, **kwargs)
    run.run()
    return run


def assert_accounted(run) -> None:
    c = run.policy.counters
    assert c.conserved(), vars(c)
    assert c.consumed == len(run.history) * run.control["batch_size"]
    eta = run.control["eta"]
    if eta is not None:
        assert max(run.staleness_all) <= eta


@pytest.mark.parametrize("pipeline", ["quickstart", "synchronous", "bounded_async", "staleflow"])
def test_pipeline_runs_end_to_end(pipeline, ray_cluster, workdir):
    plan = plan_for(pipeline)
    run = run_plan(plan)
    assert [h["step"] for h in run.history] == [1, 2, 3]
    assert_accounted(run)
    if pipeline == "synchronous":
        assert set(run.staleness_all) == {0}
    import mlflow

    data = mlflow.get_run(run.tracker.run_id).data
    assert data.params["stages.train.steps"] == "3"
    assert {"reward_mean", "loss", "staleness_mean", "tokens_per_s", "rollout_idle_ratio"} <= set(data.metrics)
    artifacts = {a.path for a in mlflow.MlflowClient().list_artifacts(run.tracker.run_id, "plots")}
    assert {"plots/staleness.png", "plots/instance_load.png", "plots/learning_curves.png"} <= artifacts


def test_failing_reward_is_counted_and_loses_nothing(ray_cluster, workdir, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    plan = plan_for("quickstart", "stages.score.fn=rewards_for_tests:flaky_exact")
    run = run_plan(plan)
    assert run.counts["reward_failed"] > 0
    assert len(run.history) == 3
    assert_accounted(run)


def test_dead_rollout_instance_loses_no_trajectory(ray_cluster, workdir):
    import ray

    from rlflow.runtime.driver import Run

    class KillAfterRouting(Run):
        """Kills an instance right after work was routed to it (deterministic: the work is in flight)."""

        victim = None

        def _admit(self):
            super()._admit()
            if self.victim is None and self.history:
                self.victim = next((i for i in self.instances if i.alive and i.routes), None)
                if self.victim is not None:
                    ray.kill(self.victim.handle)

    plan = plan_for("bounded_async", "stages.train.steps=4")
    run = KillAfterRouting(plan, out_dir=Path(".rlflow/runs/x"), log=lambda *a: None)
    run.run()
    assert run.victim is not None and not run.victim.alive
    assert run.counts["rerouted"] > 0
    assert len(run.history) == 4
    assert_accounted(run)


def test_ctrl_c_checkpoints_and_resume_continues(ray_cluster, workdir):
    plan = plan_for("quickstart", "stages.train.steps=4")
    from rlflow.runtime.driver import Run

    first = Run(plan, out_dir=Path(".rlflow/runs") / plan["name"], log=lambda *a: None)

    def interrupt():
        while len(first.history) < 2:
            time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=interrupt, daemon=True).start()
    first.run()
    stopped_at = len(first.history)
    assert first.stop_requested and 2 <= stopped_at < 4
    assert (Path(".rlflow/runs") / plan["name"] / "state.json").exists()
    second = run_plan(plan, resume=True)
    assert [h["step"] for h in second.history] == list(range(1, 5))
    assert second.tracker.run_id == first.tracker.run_id


def test_missing_data_file_is_a_clear_error(ray_cluster, workdir):
    (workdir / "prompts.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    plan = plan_for("quickstart", f"data.source={workdir / 'prompts.jsonl'}")
    (workdir / "prompts.jsonl").unlink()
    with pytest.raises(PipelineInvalid, match="no such data file"):
        run_plan(plan)


def test_prompt_longer_than_the_model_allows(ray_cluster, workdir):
    (workdir / "long.jsonl").write_text('{"prompt": "' + "1+" * 200 + '1=", "answer": "201"}\n')
    plan = plan_for("quickstart", f"data.source={workdir / 'long.jsonl'}")
    with pytest.raises(PipelineInvalid, match="too long"):
        run_plan(plan)


@pytest.mark.vllm
@pytest.mark.parametrize("pipeline", ["quickstart", "bounded_async"])
def test_pipeline_runs_on_the_vllm_engine(pipeline, ray_cluster, workdir):
    """The same pipelines with `engine: vllm`: AsyncLLM inside the RolloutWorker actors, weights pulled in flight."""
    pytest.importorskip("vllm")
    plan = plan_for(pipeline, "stages.rollout.engine=vllm")
    run = run_plan(plan)
    assert [h["step"] for h in run.history] == [1, 2, 3]
    assert_accounted(run)
    assert run.pull_s > 0, "no instance pulled a new weights version"
    assert all(inst.version >= 1 for inst in run.instances if inst.alive)
