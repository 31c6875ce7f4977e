"""prompt_format chat: prompts become the tokenizer's chat template (with an optional system prompt); compile rejects
chat for a tokenizer without one, and a system prompt with raw prompts (no Ray: the row stream is stubbed)."""

from __future__ import annotations

import json
import shutil

import pytest

transformers = pytest.importorskip("transformers")

from rlflow.compiler import check_pipeline, compile_pipeline
from rlflow.component_checks import has_chat_template
from rlflow.errors import PipelineInvalid
from rlflow.runtime.prompt_source import BadRow, PromptSource, check_prompt_lengths, encode_prompt
from rlflow.stages import smollm2
from rlflow.stages.tiny_model import build_tiny_llama

CHATML = ("{% for m in messages %}{{ '<s>' + m['role'] + '\n' + m['content'] + '</s>\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<s>assistant\n' }}{% endif %}")
SYSTEM = "Reply with the number only."


@pytest.fixture(scope="module")
def tiny_dir():
    return build_tiny_llama("arith", progress=lambda line: None)


@pytest.fixture(scope="module")
def chat_tokenizer(tiny_dir):
    """The tiny model's tokenizer with a ChatML-like template (it has none of its own)."""
    tok = transformers.AutoTokenizer.from_pretrained(tiny_dir)
    tok.chat_template = CHATML
    return tok


def template_ids(tok, messages) -> list[int]:
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_chat_ids_equal_apply_chat_template(chat_tokenizer):
    user = [{"role": "user", "content": "12+7="}]
    assert encode_prompt(chat_tokenizer, "12+7=", "chat") == template_ids(chat_tokenizer, user)
    with_system = encode_prompt(chat_tokenizer, "12+7=", "chat", SYSTEM)
    assert with_system == template_ids(chat_tokenizer, [{"role": "system", "content": SYSTEM}, *user])
    text = chat_tokenizer.decode(with_system)
    assert text.endswith("assistant\n") and SYSTEM in text and "12+7=" in text


def test_raw_is_the_plain_tokenization(chat_tokenizer):
    assert encode_prompt(chat_tokenizer, "12+7=") == chat_tokenizer("12+7=")["input_ids"]
    assert encode_prompt(chat_tokenizer, "12+7=", "raw") == chat_tokenizer("12+7=", add_special_tokens=True)["input_ids"]


def test_chat_without_a_template_is_a_value_error(tiny_dir):
    tok = transformers.AutoTokenizer.from_pretrained(tiny_dir)
    assert not tok.chat_template
    with pytest.raises(ValueError):
        encode_prompt(tok, "12+7=", "chat")


def stub_source(tokenizer, **task) -> PromptSource:
    """A PromptSource over builtin:arith whose row stream is replaced by fixed rows (Ray Data is never started)."""
    source = PromptSource({"main": {"source": "builtin:arith", **task}}, tokenizer, max_new_tokens={"main": 8},
                          max_model_len=128, seed=0, source="p.yaml")
    source.streams["main"].next_row = lambda: {"prompt": "3+4=", "answer": "7"}
    return source


def test_prompt_source_formats_each_task_as_its_spec_says(chat_tokenizer, tiny_dir):
    chat = stub_source(chat_tokenizer, prompt_format="chat", system_prompt=SYSTEM).next(["main"])
    assert chat.prompt == "3+4=" and chat.answer == "7"  # rewards see the plain prompt and answer
    assert chat.prompt_ids == encode_prompt(chat_tokenizer, "3+4=", "chat", SYSTEM)
    raw = stub_source(chat_tokenizer).next(["main"])  # a plan without prompt_format: raw, as before
    assert raw.prompt_ids == chat_tokenizer("3+4=")["input_ids"]
    plain = transformers.AutoTokenizer.from_pretrained(tiny_dir)
    with pytest.raises(BadRow) as e:  # the model changed since compile: named rule, not a traceback
        stub_source(plain, prompt_format="chat").next(["main"])
    assert e.value.problem.rule == "no-chat-template"


def test_chat_counts_against_max_model_len(chat_tokenizer):
    source = stub_source(chat_tokenizer, prompt_format="chat", system_prompt="x " * 200)
    with pytest.raises(BadRow) as e:  # drawn mid-run: a named stop (exit 3), not a traceback
        source.next(["main"])
    assert e.value.problem.rule == "prompt-too-long"


def test_an_over_long_prompt_in_the_head_is_named_by_its_line_before_the_run_starts(chat_tokenizer, tmp_path):
    rows = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(1200)]
    rows[6]["prompt"] = "9+" * 100 + "1="  # line 7: about 200 tokens
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))

    def check(**task):
        check_prompt_lengths({"main": {"source": str(path), **task}}, chat_tokenizer, max_new_tokens={"main": 8},
                             max_model_len=128, source="p.yaml")

    with pytest.raises(PipelineInvalid) as e:
        check()
    p = e.value.problems[0]
    assert p.rule == "prompt-too-long" and f"'{path}' line 7 " in p.message and p.loc == ("data", "source")
    rows[6]["prompt"], rows[1100]["prompt"] = "6+1=", rows[6]["prompt"]  # past the head: found when drawn
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    check()
    with pytest.raises(PipelineInvalid) as e:  # the chat template counts too
        check(prompt_format="chat", system_prompt="x " * 200)
    assert e.value.problems[0].rule == "prompt-too-long" and "line 1 " in e.value.problems[0].message


# --------------------------------------------------------------------------- compile


PIPELINE = """
name: chat
model: {{path: "{model}", max_model_len: 128}}
data: {data}
stages:
  buffer:  {{kind: buffer, batch_groups: 2}}
  rollout: {{kind: rollout, group_size: 2, max_new_tokens: 8{rollout}}}
  score:   {{kind: reward, fn: exact_match}}
  train:   {{kind: train, steps: 1}}
edges:
  - {{from: data,    to: rollout, policy: {{kind: streaming}}}}
  - {{from: rollout, to: score,   policy: {{kind: streaming}}}}
  - {{from: score,   to: buffer,  policy: {{kind: streaming}}}}
  - {{from: buffer,  to: train,   policy: {{kind: one_step}}}}
  - {{from: train,   to: rollout, policy: {{kind: weight_sync}}}}
"""


def write(tmp_path, model="builtin:tiny-llama", data='{source: "builtin:arith"}', rollout=""):
    path = tmp_path / "p.yaml"
    path.write_text(PIPELINE.format(model=model, data=data, rollout=rollout))
    return path


def rules(path) -> dict[str, str]:
    with pytest.raises(PipelineInvalid) as e:
        check_pipeline(path)
    return {p.rule: p for p in e.value.problems}


def test_chat_needs_a_chat_template(tmp_path):
    p = rules(write(tmp_path, data='{source: "builtin:arith", prompt_format: chat}'))["no-chat-template"]
    assert p.loc == ("data", "prompt_format") and "builtin:tiny-llama" in p.message


def test_local_model_dir_is_read_for_a_chat_template(tmp_path, tiny_dir):
    model = tmp_path / "model"
    shutil.copytree(tiny_dir, model)
    assert not has_chat_template(model)
    path = write(tmp_path, model=str(model), data='{source: "builtin:arith", prompt_format: chat}')
    assert "no-chat-template" in rules(path)
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": CHATML}))  # transformers 4
    assert has_chat_template(model)
    check_pipeline(path)
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    (model / "chat_template.jinja").write_text(CHATML)  # transformers 5
    assert has_chat_template(model)
    plan = compile_pipeline(path)
    assert (plan["tasks"]["main"]["prompt_format"], plan["tasks"]["main"]["system_prompt"]) == ("chat", None)


def test_system_prompt_needs_chat_and_task_fields_stay_per_task(tmp_path):
    p = rules(write(tmp_path, data='{source: "builtin:arith", system_prompt: "hi"}'))["system-prompt-needs-chat"]
    assert p.loc == ("data", "system_prompt")
    tasks = '{tasks: {a: {source: "builtin:arith"}}, prompt_format: chat}'
    assert rules(write(tmp_path, data=tasks))["task-field-on-data"].loc == ("data", "prompt_format")


def test_stop_strings_reach_the_engine_arguments_only_when_set(tmp_path):
    plan = compile_pipeline(write(tmp_path, rollout=', stop: ["\\n", "###"]'))
    (rollout,) = [a for a in plan["actors"] if a["role"] == "rollout"]
    assert rollout["engine_kwargs"]["stop"] == ["\n", "###"]
    plan = compile_pipeline(write(tmp_path))
    (rollout,) = [a for a in plan["actors"] if a["role"] == "rollout"]
    assert "stop" not in rollout["engine_kwargs"]
    assert rules(write(tmp_path, rollout=', stop: [""]'))["string-too-short"].loc == ("stages", "rollout", "stop", 0)


@pytest.mark.skipif(bool(smollm2.missing()), reason=f"needs {', '.join(smollm2.NEEDS)}: {smollm2.INSTALL}")
def test_smollm2_chat_prompt_is_its_own_template():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2.build_smollm2(progress=lambda line: None))
    ids = encode_prompt(tok, "12+7=", "chat", SYSTEM)
    assert ids == template_ids(tok, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "12+7="}])
    assert tok.decode(ids) == f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n12+7=<|im_end|>\n<|im_start|>assistant\n"


def test_a_stage_with_tools_measures_its_prompts_as_it_renders_them(repo):
    """A stage with tools sends the engine its prompt in chat form, the tools block included: the driver's length
    check measures that (runtime/chat_episodes.py prompt_measures), not the raw prompt it encodes."""
    from rlflow.plan_model import Plan
    from rlflow.runtime.chat_episodes import ChatForm, prompt_measures
    from rlflow.stages.tiny_model import tokenizer_for
    from rlflow.stages.trajectory import Trajectory

    plan = Plan.of(compile_pipeline(repo / "pipelines" / "agentic_tools.yaml"))
    tok = tokenizer_for("calc", plan.pipeline["seed"])
    measure = prompt_measures(plan, tok)
    assert set(measure) == {"main"}
    traj = Trajectory(group_id="g", index=0, task="main", prompt="3+4=", answer="7", prompt_ids=[])
    ChatForm(plan.rollouts("rollout")[0].episode, tok).begin(traj)  # what the rollout worker hands the engine
    n = measure["main"]("3+4=")
    assert n == len(traj.prompt_ids) and n > len(tok("3+4=")["input_ids"]) + 50  # the tools block counts

    def draw(max_model_len: int, **kw):
        source = PromptSource(plan.tasks, tok, max_new_tokens={"main": 8}, max_model_len=max_model_len, seed=0,
                              source="p.yaml", **kw)
        source.streams["main"].next_row = lambda: {"prompt": "3+4=", "answer": "7"}
        return source.next(["main"])

    assert draw(n + 8, measure=measure).prompt == "3+4="  # fits exactly
    assert draw(n + 7).prompt == "3+4="  # the raw prompt alone fits: what the check measured before
    with pytest.raises(BadRow) as e:
        draw(n + 7, measure=measure)
    assert e.value.problem.rule == "prompt-too-long" and "in chat form" in e.value.problem.message
