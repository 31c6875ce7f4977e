"""An agent written against the plain OpenAI client (pipelines/agentic_openai.yaml, issue 48) on the real stack: the
endpoint runs in its Ray actor, the rollout worker answers the agent's requests turn by turn, the trainer takes the
episodes whole, and the rewards reach MLflow. On the model taught the Hermes format in seconds (tests/tool_model.py),
as test_tools_run.py's default variant."""

from __future__ import annotations

import pytest
from runs import plan_for, run_plan
from test_run import assert_accounted

pytestmark = pytest.mark.integration


def test_an_openai_client_agent_rolls_out_and_trains(ray_cluster, workdir, tmp_path):
    from mlflow.tracking import MlflowClient
    from tool_model import teach_tool_format

    plan = plan_for("agentic_openai", f"model.path={teach_tool_format(tmp_path / 'model')}")
    [rollout] = [a for a in plan["actors"] if a["role"] == "rollout"]
    assert rollout["episode"]["agent"] == {"fn": "rlflow.stages.openai_calc_agent:calc_agent", "timeout_s": 600.0}
    run = run_plan(plan)
    assert [h["step"] for h in run.history] == [1, 2, 3]
    assert_accounted(run)  # conservation, staleness <= eta, ledger: an episode is one trajectory
    n = run.counts
    assert n["episode_turns"] > n["episodes"] > 0 and n["env_tokens"] > 0  # the agent's tool results were appended
    assert n.get("reward_failed", 0) == 0  # no agent failed
    client = MlflowClient(tracking_uri=run.tracker.uri)
    history = client.get_metric_history(run.tracker.run_id, "reward/mean_trained")
    assert [m.step for m in history] == [1, 2, 3]


def test_a_verifiers_multi_turn_environment_rolls_out_and_trains(ray_cluster, workdir, tmp_path):
    """pipelines/verifiers_tools.yaml: each episode a verifiers rollout (its chat loop, its MCP calculator, its
    rubric) in the endpoint's actor; the rubric's scores are the rewards MLflow records."""
    pytest.importorskip("verifiers")
    from mlflow.tracking import MlflowClient
    from tool_model import teach_tool_format

    plan = plan_for("verifiers_tools", f"model.path={teach_tool_format(tmp_path / 'model')}", "stages.train.steps=2")
    run = run_plan(plan)
    assert [h["step"] for h in run.history] == [1, 2]
    assert_accounted(run)
    n = run.counts
    assert n["episode_turns"] > n["episodes"] > 0 and n["env_tokens"] > 0  # verifiers ran the calls and asked again
    assert n.get("reward_failed", 0) == 0  # every episode finished and was scored by its rubric
    client = MlflowClient(tracking_uri=run.tracker.uri)
    assert [m.step for m in client.get_metric_history(run.tracker.run_id, "reward/mean_trained")] == [1, 2]
