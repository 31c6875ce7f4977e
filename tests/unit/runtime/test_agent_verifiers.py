"""A verifiers multi-turn environment as a rollout stage's agent (issue 48: stages/agent_verifiers.py): verifiers' own
chat loop drives each episode against the endpoint over a real engine, verifiers serves the Task's Python-function
tool over MCP, the Task's rubric scores the episode; what is trained is what the endpoint generated, turn by turn.
And what cannot run as declared (a container, a tool server installed at run time, one verifiers cannot start) is
named at compile, before any episode."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("verifiers")
pytest.importorskip("openai")
transformers = pytest.importorskip("transformers")

from test_agent_endpoint import model_dir, roll_out  # noqa: E402,F401 - model_dir: the module's fixture, shared
from test_chat_episodes import runs  # noqa: E402

from rlflow import registry  # noqa: E402
from rlflow.stages.verifiers_calc import TAGGED  # noqa: E402

AGENT = "verifiers:rlflow.stages.verifiers_calc_tools:load_taskset"


@pytest.mark.parametrize("max_turns", [1, 3])
def test_a_verifiers_episode_is_trained_on_what_the_endpoint_generated(model_dir, max_turns):  # noqa: F811
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    done, _ = roll_out("hf", model_dir, {"fn": AGENT, "max_turns": max_turns, "timeout_s": 120}, n=4,
                       max_turns=max_turns)
    turns = []
    for t in done.values():
        assert not t.rollout_error, t.rollout_error  # at the turn limit verifiers stops and scores: no failure
        result = json.loads(t.agent_result)
        generated = [t.completion_ids[a:b] for a, b in runs(t.loss_mask, 1)]
        assert len(generated) == result["turns"] <= max_turns  # one trained run per model call verifiers made
        turns.append(result["turns"])
        # the rubric scored the reply the model generated last: the Task's @vf.reward on it, recomputed
        assert result["reply"].strip() in tok.decode(generated[-1], skip_special_tokens=True)
        found = TAGGED.findall(result["reply"])
        assert result["reward"] == result["rewards"]["correct"] == float(bool(found) and float(found[-1]) == float(
            t.answer))
    if max_turns > 1:
        assert max(turns) > 1  # the model called the calculator, verifiers ran it over MCP and asked again


@pytest.mark.parametrize("ref, rule, words", [
    ("container", "verifiers-needs-install", "ContainerTask needs a container runtime"),
    ("docker_tool", "verifiers-needs-install", "its Toolset CalcToolset runs in a docker runtime"),
    ("not_runnable_tool", "verifiers-toolset-not-runnable", 'if __name__ == "__main__": Echo.run()'),
])
def test_what_would_need_an_install_or_cannot_start_is_named_at_compile(ref, rule, words):
    with pytest.raises(registry.ComponentError) as e:
        registry.agent_fn(f"verifiers:agents.verifiers_envs:{ref}")
    assert e.value.rule == rule and words in str(e.value)


def test_the_shipped_pipeline_names_its_verifiers_agent_in_the_plan():
    from pathlib import Path

    from rlflow.compiler import compile_pipeline

    plan = compile_pipeline(Path(__file__).resolve().parents[3] / "pipelines" / "verifiers_tools.yaml")
    [rollout] = [a for a in plan["actors"] if a["role"] == "rollout"]
    assert rollout["episode"]["agent"] == {"fn": AGENT, "timeout_s": 600.0}
    assert rollout["episode"]["max_turns"] == 3  # the budget its verifiers Agent is given


def test_compile_refuses_a_verifiers_agent_that_needs_a_container(tmp_path):
    from pathlib import Path

    from rlflow.compiler import compile_pipeline
    from rlflow.errors import PipelineInvalid

    text = (Path(__file__).resolve().parents[3] / "pipelines" / "verifiers_tools.yaml").read_text()
    (tmp_path / "p.yaml").write_text(text.replace(AGENT, "verifiers:agents.verifiers_envs:container"))
    with pytest.raises(PipelineInvalid) as e:
        compile_pipeline(tmp_path / "p.yaml")
    [problem] = e.value.problems
    assert problem.rule == "verifiers-needs-install" and problem.loc == ("stages", "rollout", "agent")
