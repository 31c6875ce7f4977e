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
@pytest.mark.parametrize("pipeline", ["quickstart", "bounded_async", "staleflow"])
def test_pipeline_runs_on_the_vllm_engine(pipeline, ray_cluster, workdir):
    """The same pipelines with `engine: vllm`: AsyncLLM inside the RolloutWorker actors, weights pulled in
    flight; staleflow also drives vLLM through the rollout coordinator."""
    pytest.importorskip("vllm")
    plan = plan_for(pipeline, "stages.rollout.engine=vllm")
    run = run_plan(plan)
    assert [h["step"] for h in run.history] == [1, 2, 3]
    assert_accounted(run)
    assert run.pull_s > 0, "no instance pulled a new weights version"
    # at least one instance moved on (throughput-aware sync may leave a lightly used one on old weights)
    assert max(inst.version for inst in run.instances if inst.alive) >= 1


def small_chunk_hf(model_dir, **kwargs):
    """The hf engine decoding 4 tokens per step instead of 16, so the tiny model's short answers span
    several steps and a snapshot finds them mid-generation (used as `engine: test_run:small_chunk_hf`)."""
    from rlflow.stages.engine_hf import HFEngine

    return HFEngine(model_dir, chunk_size=4, **kwargs)


@pytest.mark.parametrize("variant", ["as_planned", "migrating"])
def test_staleflow_runs_through_the_rollout_coordinator(variant, ray_cluster, workdir, monkeypatch):
    """staleflow.yaml selects cost-model routing, throughput-aware sync with partial rollout and threshold
    migration: routing, sync and migration go through the rollout coordinator (staleflow.txt §5.2,
    Algorithm 1), every snapshot validates against the speculative state (Eq. 1), and the invariants hold.

    On the tiny model most answers finish within one 16-token engine step, so snapshots rarely find work
    in flight. "migrating" decodes 4 tokens per step, takes a snapshot every 0.05 s and migrates on any
    throughput gap (phi_throughput = 1 instead of 5), so partial trajectories are interrupted, go back to
    the TS and resume elsewhere, keeping their oldest V_traj.
    """
    import dataclasses

    from rlflow.runtime.driver import Run

    class Migrating(Run):
        def _start(self):
            super()._start()
            coord = self.coordination.coord
            coord.cfg = dataclasses.replace(coord.cfg, phi_throughput=1.0)

    migrating = variant == "migrating"
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    extra = ["stages.rollout.engine=test_run:small_chunk_hf", "stages.rollout.coordinator.interval_s=0.05"]
    plan = plan_for("staleflow", *(extra if migrating else []))
    run = (Migrating if migrating else Run)(plan, out_dir=Path(".rlflow/runs/staleflow"), log=lambda *a: None)
    run.run()
    assert [h["step"] for h in run.history] == [1, 2, 3]
    assert_accounted(run)
    coord = run.coordination
    assert coord is not None
    assert (coord.coord.cfg.routing, coord.coord.cfg.sync, coord.coord.cfg.migration) == (
        "cost_model", "throughput_aware", "threshold")
    n = run.counts
    assert n["coord_cycles"] > 0 and n["coord_rejected"] == 0 and n["coord_resyncs"] == 0, n
    # every trained trajectory was routed by a Route command; instances were pulled onto newer weights
    assert n["coord_routed"] >= len(run.history) * run.control["batch_size"] * run.group_size, n
    assert n["coord_pulls"] > 0 and max(inst.version for inst in run.instances) >= 1, n
    if migrating:
        assert n["coord_interrupted"] > 0, n
    assert run.history[-1]["coord_routed"] > 0  # the counts are logged with every step (MLflow metrics)
