"""Tool calling in chat form, without an engine: the parsers per format (stages/tool_parsers.py; property tests: any
well-formed call round-trips, no text makes a parser raise), tool schemas from signatures and dicts and the ToolBox
environment (stages/tools.py), and the chat template's observation deltas (stages/chat_template.py)."""

from __future__ import annotations

import json
import pickle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlflow.stages.tool_parsers import PARSERS, ToolCall, parse, parse_hermes, parse_json
from rlflow.stages.tools import ToolBox, ToolError, calculator, checked_schema, load_tools, run_call, schema_of

NAMES = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,12}", fullmatch=True)
VALUES = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                      lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
                      max_leaves=6)
CALLS = st.lists(st.tuples(NAMES, st.dictionaries(NAMES, VALUES, max_size=3)), min_size=1, max_size=3)


def hermes(name, args) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": args})}\n</tool_call>'


@given(calls=CALLS, before=st.text(max_size=20).filter(lambda t: "<tool_call>" not in t))
@settings(max_examples=150, deadline=None)
def test_hermes_round_trips_every_well_formed_call(calls, before):
    text = before + "".join(hermes(n, a) for n, a in calls)
    assert parse("hermes", text) == [ToolCall(n, a) for n, a in calls]


@given(calls=CALLS)
@settings(max_examples=150, deadline=None)
def test_json_round_trips_one_call_or_a_list(calls):
    objects = [{"name": n, "arguments": a} for n, a in calls]
    assert parse("json", json.dumps(objects)) == [ToolCall(n, a) for n, a in calls]
    assert parse("json", "```json\n" + json.dumps(objects[0]) + "\n```") == [ToolCall(*calls[0])]


@given(text=st.text(max_size=200))
@settings(max_examples=300, deadline=None)
def test_no_text_makes_a_parser_raise(text):
    for name in PARSERS:
        for call in parse(name, text):
            assert isinstance(call.arguments, dict) and (call.error is not None or call.name)


@pytest.mark.parametrize("text,error", [
    ('<tool_call>{"name": "f", "arguments": {}', "without </tool_call>"),
    ("<tool_call>{not json}</tool_call>", "not valid JSON"),
    ('<tool_call>["f"]</tool_call>', "a JSON object, not list"),
    ('<tool_call>{"arguments": {}}</tool_call>', 'no "name"'),
    ('<tool_call>{"name": "f", "arguments": 3}</tool_call>', "must be an object"),
    ('<tool_call>{"name": "f", "arguments": "{oops"}</tool_call>', "string that is not JSON"),
])
def test_hermes_malformed_calls_say_what_is_wrong(text, error):
    [call] = parse_hermes(text)
    assert error in call.error


def test_hermes_reads_arguments_given_as_a_json_string_and_ignores_plain_text():
    assert parse_hermes('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>') == [ToolCall("f", {"x": 1})]
    assert parse_hermes("The answer is A=85.") == []


def test_json_format_reads_parameters_and_leaves_prose_alone():
    assert parse_json('{"name": "calculator", "parameters": {"expression": "2+2"}}') == [ToolCall("calculator", {"expression": "2+2"})]
    assert parse_json("A=4") == []
    assert "not valid JSON" in parse_json('{"name": ').pop().error
    assert "empty list" in parse_json("[]").pop().error


def greet(name: str, times: int = 1, loud: bool = False, tags: list | None = None) -> str:
    """Greet someone.

    More text that is not the description.

    Args:
        name: who to greet
        times (int): how often
    """
    return " ".join([f"hi {name}"] * times)


def test_schema_from_signature_and_docstring():
    f = schema_of(greet)["function"]
    assert f["name"] == "greet" and f["description"] == "Greet someone."
    assert f["parameters"]["required"] == ["name"]
    props = f["parameters"]["properties"]
    assert props["name"] == {"type": "string", "description": "who to greet"}
    assert props["times"] == {"type": "integer", "description": "how often"} and props["loud"] == {"type": "boolean"}
    assert props["tags"] == {}  # Optional[list]: no single JSON type


def test_builtin_calculator_and_dict_schemas():
    schemas, fns = load_tools(["builtin:calculator", {"name": "hello", "description": "Say hi.", "fn": f"{__name__}:greet",
                                                      "parameters": {"type": "object", "properties": {"name": {"type": "string"}}}}])
    assert [s["function"]["name"] for s in schemas] == ["calculator", "hello"]
    assert "fn" not in schemas[1]["function"] and fns["hello"] is greet
    assert calculator("37+48") == "85" and calculator("import os").startswith("error:")


@pytest.mark.parametrize("entry,rule", [
    ("builtin:nope", "unknown-tool"),
    ("no_such_module_xyz:f", "bad-tool"),
    ("not an import string", "bad-tool"),
    (f"{__name__}:NAMES", "bad-tool"),  # not callable
    ({"name": "f", "parameters": {"type": "object", "properties": {}}}, "tool-without-fn"),
    ({"name": "bad name", "fn": f"{__name__}:greet"}, "bad-tool-schema"),
    ({"name": "f", "parameters": {"type": "array"}, "fn": f"{__name__}:greet"}, "bad-tool-schema"),
    ({"type": "retrieval", "fn": f"{__name__}:greet"}, "bad-tool-schema"),
    (3, "bad-tool"),
])
def test_unusable_tools_are_named_errors(entry, rule):
    with pytest.raises(ToolError) as e:
        load_tools([entry])
    assert e.value.rule == rule and e.value.fix


def test_two_tools_with_one_name_are_refused():
    with pytest.raises(ToolError) as e:
        load_tools(["builtin:calculator", "builtin:calculator"])
    assert e.value.rule == "duplicate-tool"


def test_checked_schema_wraps_the_inner_form():
    inner = {"name": "f", "description": "d", "parameters": {"type": "object", "properties": {}}}
    assert checked_schema(inner) == {"type": "function", "function": inner} == checked_schema({"type": "function", "function": inner})


def boom(x: int) -> int:
    raise RuntimeError("tool broke")


def test_a_call_that_cannot_run_gets_a_message_not_an_exception():
    fns = {"boom": boom, "greet": greet}
    assert run_call(fns, "greet", {"name": "bo", "times": 2}, None) == "hi bo hi bo"
    assert run_call(fns, "nope", {}, None) == "error: unknown tool 'nope'; tools: boom, greet"
    assert run_call(fns, "greet", {"who": 1}, None).startswith("error: bad arguments for 'greet'")
    assert run_call(fns, "boom", {"x": 1}, None) == "error: RuntimeError: tool broke"
    assert run_call(fns, "", {}, "not valid JSON") == "error: not valid JSON"


def test_toolbox_answers_each_call_with_a_tool_message_and_pickles_without_its_functions():
    box = ToolBox(["builtin:calculator"], "hermes")
    step = box.step(hermes("calculator", {"expression": "6*7"}) + "<tool_call>{bad}</tool_call>")
    assert step.observation[0] == {"role": "tool", "name": "calculator", "content": "42"}
    assert step.observation[1]["content"].startswith("error: not valid JSON") and not step.done
    again = pickle.loads(pickle.dumps(box))
    assert again._fns is None and again.step(hermes("calculator", {"expression": "1+1"})).observation[0]["content"] == "2"
    assert box.step("no call").done  # nothing to run: the episode is over


# a ChatML-like template whose turns end `</s>` + newline (as Qwen's end `<|im_end|>` + newline), tools in a system turn
CHATML = ("{% if tools %}{{ '<s>system\\ntools: ' + (tools | map(attribute='function') | map(attribute='name') | join(',')) + '</s>\\n' }}{% endif %}"
          "{% for m in messages %}{{ '<s>' + m['role'] + '\\n' + m['content'] + '</s>\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<s>assistant\\n' }}{% endif %}")
# renders the first user message differently once a later message exists: no delta can be taken
SHIFTING = ("{% for m in messages %}{{ '<s>' + m['role'] + '\\n' + m['content'] + ('!' if loop.length > 2 and loop.first else '') + '</s>' }}"
            "{% endfor %}{% if add_generation_prompt %}{{ '<s>assistant\\n' }}{% endif %}")


@pytest.fixture(scope="module")
def tokenizer():
    transformers = pytest.importorskip("transformers")
    from rlflow.stages.tiny_model import build_tiny_llama

    return transformers.AutoTokenizer.from_pretrained(build_tiny_llama("arith", progress=lambda line: None))


def test_observation_is_the_templates_tokens_after_the_generated_turn(tokenizer):
    from rlflow.stages.chat_template import ChatRenderer

    schemas = load_tools(["builtin:calculator"])[0]
    r = ChatRenderer(tokenizer, schemas, CHATML)
    eos, newline = tokenizer.eos_token_id, tokenizer.encode("\n", add_special_tokens=False)
    assert r.end_of_turn == [eos, *newline]  # learned from the template: the turn's end, then the newline after it
    prompt = r.prompt_ids("2+2=")
    assert tokenizer.decode(prompt) == "<s>system\ntools: calculator</s>\n<s>user\n2+2=</s>\n<s>assistant\n"
    turn = tokenizer.encode("<tool_call>x</tool_call>", add_special_tokens=False)
    tool = [{"role": "tool", "name": "calculator", "content": "4"}]
    ended = r.observation_ids(turn + [eos], tool)  # ended on eos: the newline after it, then the tool turn
    assert tokenizer.decode(ended) == "\n<s>tool\n4</s>\n<s>assistant\n"
    stopped = r.observation_ids(turn, tool)  # ended otherwise (a stop string): the whole end of turn first
    assert stopped == [eos] + ended
    # the whole sequence is what the template gives for the conversation, generated ids untouched
    whole = prompt + turn + [eos] + ended
    conversation = [{"role": "user", "content": "2+2="}, {"role": "assistant", "content": "<tool_call>x</tool_call>"}, *tool]
    assert tokenizer.decode(whole) == tokenizer.decode(r.render(conversation, generation=True))


# drops the reasoning of earlier assistant turns when it re-renders them (as Qwen3's and DeepSeek-R1's templates do)
STRIPS_REASONING = ("{% for m in messages %}{% set c = m['content'] %}"
                    "{% if m['role'] == 'assistant' and not loop.last %}{% set c = c.split('</think>')[-1] %}{% endif %}"
                    "{{ '<s>' + m['role'] + '\\n' + c + '</s>' }}{% endfor %}"
                    "{% if add_generation_prompt %}{{ '<s>assistant\\n' }}{% endif %}")


def test_a_template_that_strips_earlier_reasoning_keeps_each_turns_sampled_ids(tokenizer):
    """Issue 48: re-rendered history is handled as the peers do, each call's ids kept: the next turn's context is the
    sampled turn, reasoning and all, then the template's tokens for what followed; never a re-render of the turn."""
    from rlflow.stages.chat_template import ChatRenderer

    r = ChatRenderer(tokenizer, [], STRIPS_REASONING)
    prompt = r.prompt_ids("2+2=")
    turn = tokenizer.encode("<think>two and two</think><tool_call>x</tool_call>", add_special_tokens=False)
    tool = [{"role": "tool", "content": "4"}]
    context = prompt + turn + r.observation_ids(turn, tool)  # what the model sees for its next turn, and is trained on
    assert context[len(prompt):len(prompt) + len(turn)] == turn
    assert tokenizer.decode(context).endswith("</s><s>tool\n4</s><s>assistant\n")
    conversation = [{"role": "user", "content": "2+2="}, {"role": "assistant", "content": tokenizer.decode(turn)}, *tool]
    assert "two and two" not in tokenizer.decode(r.render(conversation, generation=True))  # what a re-render gives


def test_templates_that_cannot_give_a_delta_are_refused(tokenizer):
    from rlflow.stages.chat_template import TINY_TOOL_TEMPLATE, ChatRenderer, TemplateError

    with pytest.raises(TemplateError, match="no chat template"):
        ChatRenderer(tokenizer, [])  # the tiny tokenizer has none of its own
    r = ChatRenderer(tokenizer, [], SHIFTING)
    with pytest.raises(TemplateError, match="renders earlier messages differently"):
        r.observation_ids([1], [{"role": "tool", "content": "4"}])
    assert ChatRenderer(tokenizer, [], TINY_TOOL_TEMPLATE).end_of_turn == [tokenizer.eos_token_id]


def test_the_tiny_tool_warm_start_trains_the_call_and_the_answer_not_the_reply(tokenizer):
    from rlflow.stages.chat_template import TINY_TOOL_TEMPLATE, ChatRenderer
    from rlflow.stages.tiny_tool_model import chat_example

    r = ChatRenderer(tokenizer, load_tools(["builtin:calculator"])[0], TINY_TOOL_TEMPLATE)
    row = {"prompt": "Ann has 37 pens and buys 48 more. How many pens now? Calc:", "answer": "85",
           "demo": "<calc>37+48</calc>=85 A=85"}
    ids, mask = chat_example(tokenizer, r, row)
    assert ids[:len(r.prompt_ids(row["prompt"]))] == r.prompt_ids(row["prompt"])
    trained = tokenizer.decode([i for i, m in zip(ids, mask) if m])
    assert trained == '<tool_call>{"name": "calculator", "arguments": {"expression": "37+48"}}</tool_call></s>A=85</s>'
    assert tokenizer.decode(ids).endswith("</s><s>tool\n85</s><s>assistant\nA=85</s>")
