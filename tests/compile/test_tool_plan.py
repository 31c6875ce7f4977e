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


# a model directory whose template writes Qwen3-Coder calls (the tiny template, plus the marker in a comment)
QWEN3_CODER_TEMPLATE = TINY_TOOL_TEMPLATE + "{#- <tool_call>\n<function=NAME>\n<parameter=P>\nvalue\n</parameter> -#}"
LLAMA3_TEMPLATE = TINY_TOOL_TEMPLATE.replace("<tool_call>", "<|python_tag|>").replace("</tool_call>", "")


@pytest.fixture(scope="module")
def local_model(tmp_path_factory):
    """builtin:tiny-llama's calc build saved as a local directory (no template of its own yet)."""
    import shutil

    from rlflow.stages.tiny_model import build_tiny_llama

    out = tmp_path_factory.mktemp("local") / "model"
    shutil.copytree(build_tiny_llama("calc", progress=lambda line: None), out)
    return out


def local_pipeline(tmp_path, model, template: str, parser: str | None) -> Path:
    (model / "chat_template.jinja").write_text(template)
    text = PIPELINE.read_text().replace('"builtin:tiny-llama"', f'"{model}"')
    text = text.replace("tool_parser: hermes, ", "" if parser is None else f"tool_parser: {parser}, ")
    (tmp_path / "p.yaml").write_text(text)
    return tmp_path / "p.yaml"


def test_compile_picks_the_parser_the_models_chat_template_names_and_says_so(tmp_path, local_model):
    from rlflow.compiler import summary

    plan = compile_pipeline(local_pipeline(tmp_path, local_model, QWEN3_CODER_TEMPLATE, None))
    assert plan["pipeline"]["stages"]["rollout"]["tool_parser"] == "qwen3_coder"
    assert {a["role"]: a for a in plan["actors"]}["rollout"]["episode"]["tool_parser"] == "qwen3_coder"
    assert plan["tool_parsers"] == {"rollout": {"parser": "qwen3_coder", "from": "chat template", "marker": "<function="}}
    assert "rollout 'rollout' reads qwen3_coder tool calls: picked from the model's chat template" in summary(plan)


def test_a_tool_parser_the_template_contradicts_is_a_mismatch(tmp_path, local_model):
    with pytest.raises(PipelineInvalid) as e:
        compile_pipeline(local_pipeline(tmp_path, local_model, QWEN3_CODER_TEMPLATE, "hermes"))
    [problem] = e.value.problems
    assert (problem.rule, problem.loc) == ("tool-parser-mismatch", ("stages", "rollout", "tool_parser"))
    assert "set tool_parser: qwen3_coder, or remove tool_parser" in problem.fix


def test_a_template_that_agrees_keeps_the_declared_parser_and_json_reads_llama(tmp_path, local_model):
    plan = compile_pipeline(local_pipeline(tmp_path, local_model, LLAMA3_TEMPLATE, "json"))
    assert plan["pipeline"]["stages"]["rollout"]["tool_parser"] == "json" and "tool_parsers" not in plan


def test_a_template_without_a_known_format_still_needs_a_parser(tmp_path, local_model):
    with pytest.raises(PipelineInvalid) as e:
        compile_pipeline(local_pipeline(tmp_path, local_model, TINY_TOOL_TEMPLATE.replace("<tool_call>", "<call>"), None))
    assert [p.rule for p in e.value.problems] == ["tools-need-parser"]
