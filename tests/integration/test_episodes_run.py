"""A multi-turn pipeline (pipelines/agentic_calc.yaml: the calculator environment in the sandbox) on the real
stack: episodes alternate turns and calculator calls, the trainer receives them whole with environment tokens
masked out, and the staleness bound, the ledger and the coordinator's speculative state hold across turns."""

from __future__ import annotations

from pathlib import Path

import pytest
from runs import plan_for
from test_run import assert_accounted

pytestmark = pytest.mark.integration


# interrupted: two instances, every weight sync interrupts what is generating (partial rollout); an episode
# interrupted mid-turn leaves with its environment and resumes on whichever instance the coordinator picks
# as_shipped (slow): the pipeline file as is, one instance; `interrupted` runs the same file with every assertion
# of it and more, so the default run keeps only that one
@pytest.mark.parametrize("variant", [pytest.param("as_shipped", marks=pytest.mark.slow), "interrupted"])
def test_agentic_pipeline_trains_whole_episodes(variant, ray_cluster, workdir, monkeypatch):
    import ray

    from rlflow.runtime.driver import Run
    from rlflow.runtime.hooks import RunHooks

    trained: list[dict] = []
    monkeypatch.syspath_prepend(str(Path(__file__).parent))

    def record_trained(run):
        start = run.sink.start

        def recording(batch, info):  # what the trainer is about to take from the store
            trained.extend(t.as_dict() for t in ray.get(run.store.peek.remote(list(batch.rewards)), timeout=60))
            return start(batch, info)
        run.sink.start = recording

    # test_run:small_chunk_hf decodes 4 tokens per step call, and snapshots come every 0.05 s: syncs find turns
    # mid-generation (most end within one 16-token step otherwise)
    # 5 steps, not 3: more syncs to find a turn mid-generation (3 once gave none in a full default run on 2 busy cores)
    extra = ["stages.rollout.replicas=2", "edges.4.policy.partial_rollout=true", "stages.rollout.engine=test_run:small_chunk_hf",
             "stages.rollout.coordinator.interval_s=0.05", "stages.train.steps=5"] if variant == "interrupted" else []
    plan = plan_for("agentic_calc", "data.eval_size=16", "stages.rollout.env_kwargs.latency_s=0.05", *extra)
    run = Run(plan, out_dir=Path(".rlflow/runs/agentic"), log=lambda *a, **k: None, hooks=RunHooks(on_started=record_trained))
    run.run()
    assert [h["step"] for h in run.history] == ([1, 2, 3, 4, 5] if variant == "interrupted" else [1, 2, 3])
    assert_accounted(run)  # conservation, staleness <= eta, ledger: episodes count as one trajectory each
    n = run.counts
    assert n["episodes"] >= len(trained) > 0 and n["episode_turns"] > n["episodes"]  # tool calls happened
    assert n["coord_resyncs"] == 0  # snapshots (env_trajs, episode completions) agree with the speculative state
    if variant == "interrupted":
        assert n["coord_interrupted"] > 0  # back to the TS partial, with their environments, and routed again
    tool_users = [t for t in trained if len(t["turn_starts"]) > 1]
    assert tool_users
    for t in trained:
        assert len(t["loss_mask"]) == len(t["completion_ids"]) == len(t["behaviour_logprobs"])
        assert t["version"] == min(t["versions_seen"])
        assert 1 <= len(t["turn_starts"]) <= plan["pipeline"]["stages"]["rollout"]["max_turns"]
    for t in tool_users:
        start = t["turn_starts"][1]
        zeros = [i for i, m in enumerate(t["loss_mask"]) if m == 0]
        assert zeros and max(zeros) < start  # the calculator's reply sits between the turns, untrained
        assert all(t["behaviour_logprobs"][i] == 0.0 for i in zeros)
        assert "</calc>=" in t["completion"]  # the transcript: the call, then the calculator's reply
    evals = [e for e in run.metrics.evals]
    last = run.history[-1]["step"]  # eval_every 20: the initial weights and the last step's
    assert [e["step"] for e in evals] == [0, last] and all(e["eval/prompts"] == 16 for e in evals)
