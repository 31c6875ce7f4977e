"""Chat-form tool calling (pipelines/agentic_tools.yaml) on the real stack: episodes call the calculator in the
rollout workers, its replies come back as template tokens, and the trainer takes them whole. By default on a model
taught the Hermes format in seconds (tests/tool_model.py; its tokenizer's own template); as shipped (slow: its first
run builds the chat-form warm start, stages/tiny_tool_model.py) builtin:tiny-llama rendered with rlflow's template."""

from __future__ import annotations

from pathlib import Path

import pytest
from runs import plan_for
from test_run import assert_accounted

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("variant", [pytest.param("as_shipped", marks=pytest.mark.slow), "taught"])
def test_tool_pipeline_runs_in_chat_form(variant, ray_cluster, workdir, tmp_path):
    from tool_model import teach_tool_format

    from rlflow.runtime.driver import Run

    extra = [f"model.path={teach_tool_format(tmp_path / 'model')}"] if variant == "taught" else []
    plan = plan_for("agentic_tools", "data.eval_size=8", *extra)
    [rollout] = [a for a in plan["actors"] if a["role"] == "rollout"]
    # builtin:tiny-llama has no template of its own: the plan carries the one it is rendered with; a model with one uses it
    assert (rollout["episode"]["chat_template"] is None) == (variant == "taught")
    run = Run(plan, out_dir=Path(".rlflow/runs/tools"), log=lambda *a, **k: None)
    run.run()
    assert [h["step"] for h in run.history] == [1, 2, 3]
    assert_accounted(run)  # conservation, staleness <= eta, ledger: an episode is one trajectory
    n = run.counts
    assert n["episode_turns"] > n["episodes"] > 0 and n["env_tokens"] > 0  # calls ran, their replies were appended
