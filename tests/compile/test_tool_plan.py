"""What a chat-form tool stage compiles to: the plan's episode entry (tools, parser, the template builtin:tiny-llama is
rendered with, the tasks' system prompts) and the rule for a parser without tools."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlflow.compiler import compile_pipeline
from rlflow.errors import PipelineInvalid
from rlflow.stages.chat_template import TINY_TOOL_TEMPLATE

PIPELINE = Path(__file__).resolve().parents[2] / "pipelines" / "agentic_tools.yaml"


def test_the_rollout_and_the_evaluator_carry_the_chat_episode():
    plan = compile_pipeline(PIPELINE)
    actors = {a["role"]: a for a in plan["actors"]}
    episode = actors["rollout"]["episode"]
    assert episode == {"env": None, "tools": ["builtin:calculator"], "tool_parser": "hermes", "max_turns": 3,
                       "chat_template": TINY_TOOL_TEMPLATE, "system_prompts": {}}
    assert actors["evaluator"]["episode"] == episode  # held-out episodes are rendered and parsed as in training


def test_a_tool_parser_without_tools_is_a_problem():
    with pytest.raises(PipelineInvalid) as e:
        compile_pipeline(PIPELINE, ["stages.rollout.tools=[]", "stages.rollout.max_turns=1",
                                    "stages.rollout.max_turn_tokens=null"])
    assert [p.rule for p in e.value.problems] == ["parser-needs-tools"]


def test_env_kwargs_on_a_tools_stage_are_a_problem():
    with pytest.raises(PipelineInvalid) as e:
        compile_pipeline(PIPELINE, ["stages.rollout.env_kwargs.latency_s=1"])
    assert [(p.rule, p.loc) for p in e.value.problems] == [("turns-need-env", ("stages", "rollout", "env_kwargs"))]
