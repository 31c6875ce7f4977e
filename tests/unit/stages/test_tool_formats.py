"""The tool-call formats of today's models (stages/tool_formats.py), as tests/unit/stages/test_tool_calls.py tests
hermes and json: every well-formed call, written as the model's chat template writes it, parses back to itself;
prose is no call; a malformed call is a named error, never an exception. And the chat-template markers that name a
format (stages/tool_parsers.py parser_for_template)."""

from __future__ import annotations

import json
import keyword
import re

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from rlflow.stages.chat_template import TINY_TOOL_TEMPLATE
from rlflow.stages.tool_parsers import PARSERS, ToolCall, content, parse, parser_for_template

NAMES = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,12}", fullmatch=True)
VALUES = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                      lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
                      max_leaves=6)
CALLS = st.lists(st.tuples(NAMES, st.dictionaries(NAMES, VALUES, max_size=3)), min_size=1, max_size=3)
PROSE = st.text(alphabet=st.characters(blacklist_characters="[{<｜"), max_size=60)  # no format's opening

DS_CALLS, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL, DS_CALL_END, DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"


def llama3_json(calls, tag: bool) -> str:
    return ("<|python_tag|>" if tag else "") + "; ".join(json.dumps({"name": n, "parameters": a}) for n, a in calls)


def pythonic(calls) -> str:
    return "[" + ", ".join(f"{n}(" + ", ".join(f"{k}={v!r}" for k, v in a.items()) + ")" for n, a in calls) + "]"


def mistral_v3(calls) -> str:  # tokenizers v2/v3 (mistral-common InstructTokenizerV2/V3)
    return "[TOOL_CALLS]" + json.dumps([{"name": n, "arguments": a} for n, a in calls], ensure_ascii=False)


def mistral_v11(calls, call_id: bool) -> str:  # v11 writes [CALL_ID]id before [ARGS]; v13 does not
    return "".join(f"[TOOL_CALLS]{n}" + ("[CALL_ID]a1B2c3D4e" if call_id else "") + f"[ARGS]{json.dumps(a)}"
                   for n, a in calls)


def qwen3_coder_value(v) -> str:  # as Qwen3-Coder's template: a string as it is, a mapping or list as JSON, else |string
    return json.dumps(v, ensure_ascii=False) if isinstance(v, (dict, list)) else v if isinstance(v, str) else str(v)


def qwen3_coder(calls) -> str:
    return "".join("\n<tool_call>\n<function=" + n + ">\n"
                   + "".join(f"<parameter={k}>\n{qwen3_coder_value(v)}\n</parameter>\n" for k, v in a.items())
                   + "</function>\n</tool_call>" for n, a in calls)


def deepseek_v3(calls) -> str:  # DeepSeek-V3 / R1-0528's template
    return DS_CALLS + "\n".join(f"{DS_CALL}function{DS_SEP}{n}\n```json\n{json.dumps(a)}\n```{DS_CALL_END}"
                                for n, a in calls) + DS_CALLS_END


def deepseek_v31(calls) -> str:
    return DS_CALLS + "".join(f"{DS_CALL}{n}{DS_SEP}{json.dumps(a)}{DS_CALL_END}" for n, a in calls) + DS_CALLS_END


def harmony(calls) -> str:  # the turn after the prompt's `<|start|>assistant`: reasoning, then one message per call
    return "<|channel|>analysis<|message|>Need the tools.<|end|>" + "".join(
        f"<|start|>assistant<|channel|>commentary to=functions.{n} <|constrain|>json<|message|>{json.dumps(a)}<|call|>"
        for n, a in calls)


def expected(calls) -> list[ToolCall]:
    return [ToolCall(n, a) for n, a in calls]


@given(calls=CALLS, tag=st.booleans())
@settings(max_examples=100, deadline=None)
def test_llama3_json_round_trips_calls_separated_by_semicolons(calls, tag):
    assert parse("llama3_json", llama3_json(calls, tag)) == expected(calls)
    assert content("llama3_json", "Let me look." + llama3_json(calls, True)) == "Let me look."


def python_names(calls) -> bool:
    return all(not keyword.iskeyword(n) and not any(keyword.iskeyword(k) for k in a) for n, a in calls)


@given(calls=CALLS, llama4=st.booleans())
@settings(max_examples=100, deadline=None)
def test_pythonic_round_trips_keyword_calls_with_literal_values(calls, llama4):
    assume(python_names(calls))  # `class=1` is no Python: the format cannot name a keyword
    text = pythonic(calls)
    assert parse("pythonic", f"<|python_start|>{text}<|python_end|>" if llama4 else text) == expected(calls)


@given(calls=CALLS, call_id=st.booleans(), before=PROSE)
@settings(max_examples=100, deadline=None)
def test_mistral_round_trips_the_json_list_and_the_args_forms(calls, call_id, before):
    for text in (mistral_v3(calls), mistral_v11(calls, call_id)):
        assert parse("mistral", before + text) == expected(calls)
        assert content("mistral", before + text) == before.strip()


def qwen3_coder_reads_back(v) -> bool:
    """A top-level string the format cannot tell from JSON (`42`, `true`, `None`, `[1]`) comes back as that value."""
    return not isinstance(v, str) or not (v in ("True", "False", "None") or v[:1] in "{[\""
                                          or re.fullmatch(r"-?(0|[1-9]\d*)(\.\d+)?([eE][+-]?\d+)?|true|false|null", v))


@given(calls=CALLS, before=PROSE)
@settings(max_examples=100, deadline=None)
def test_qwen3_coder_round_trips_calls_as_its_template_writes_them(calls, before):
    assume(all(qwen3_coder_reads_back(v) for _, a in calls for v in a.values()))
    assert parse("qwen3_coder", before + qwen3_coder(calls)) == expected(calls)
    assert content("qwen3_coder", before + qwen3_coder(calls)) == before.strip()


def test_qwen3_coder_reads_values_without_the_schema():
    text = ("<tool_call>\n<function=f>\n<parameter=n>\n42\n</parameter>\n<parameter=ok>\nTrue\n</parameter>\n"
            "<parameter=xs>\n[1, \"a\"]\n</parameter>\n<parameter=code>\nprint(1)\nprint(2)\n</parameter>\n"
            "</function>\n</tool_call>")
    assert parse("qwen3_coder", text) == [ToolCall("f", {"n": 42, "ok": True, "xs": [1, "a"], "code": "print(1)\nprint(2)"})]


@given(calls=CALLS, before=PROSE, after=PROSE)
@settings(max_examples=100, deadline=None)
def test_deepseek_v3_round_trips_v3_and_v31_calls(calls, before, after):
    for text in (deepseek_v3(calls), deepseek_v31(calls)):
        assert parse("deepseek_v3", before + text + after) == expected(calls)
        assert content("deepseek_v3", before + text + after) == (before + after).strip()


@given(calls=CALLS)
@settings(max_examples=100, deadline=None)
def test_harmony_round_trips_messages_to_functions(calls):
    assume("<|" not in json.dumps([a for _, a in calls], ensure_ascii=False))  # a body holding `<|end|>` ends there
    text = harmony(calls)
    assert parse("harmony", text) == expected(calls)
    assert content("harmony", text + "<|start|>assistant<|channel|>final<|message|>It is 20 C.<|return|>") == "It is 20 C."


def test_harmony_reads_the_recipient_in_the_role_and_skips_messages_to_no_one():
    text = ("<|channel|>analysis<|message|>Plan: to=functions.x is what I call.<|end|>"
            "<|start|>assistant<|channel|>commentary<|message|>Calling it.<|end|>"
            '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Oslo"}<|call|>')
    assert parse("harmony", text) == [ToolCall("get_weather", {"city": "Oslo"})]


@given(text=PROSE)
@settings(max_examples=200, deadline=None)
def test_prose_is_no_call_in_any_format(text):
    for name in PARSERS:
        assert parse(name, text) == [], name


@pytest.mark.parametrize("parser,text,error", [
    ("llama3_json", '{"name": "f", "parameters": ', "not valid JSON"),
    ("llama3_json", '{"name": "f", "parameters": {}} and then', "text after a call"),
    ("llama3_json", "<|python_tag|>brave_search.call(query='x')", "a call is a JSON object"),
    ("llama3_json", '{"parameters": {}}', 'no "name"'),
    ("pythonic", "[f(a=1", "not a Python list of calls"),
    ("pythonic", "[f(1, 2)]", "positional arguments"),
    ("pythonic", "[f(a=open('x'))]", "not a literal"),
    ("pythonic", "[os.system(cmd='ls')]", "plain identifier"),
    ("pythonic", "<|python_start|>3<|python_end|>", "a Python list of function calls"),
    ("mistral", "[TOOL_CALLS][{\"name\": \"f\", \"arguments\": {}}", "not valid JSON"),
    ("mistral", "[TOOL_CALLS]f", "no arguments after the name"),
    ("mistral", "[TOOL_CALLS][ARGS]{}", "no name"),
    ("mistral", '[TOOL_CALLS]f[ARGS]{"a": ', "not valid JSON"),
    ("qwen3_coder", "<tool_call>\n<function=f>\n</function>", "without </tool_call>"),
    ("qwen3_coder", "<tool_call>\n<function=f>\n</tool_call>", "without </function>"),
    ("qwen3_coder", "<tool_call>\n{\"name\": \"f\"}\n</tool_call>", "without <function=NAME>"),
    ("qwen3_coder", "<tool_call>\n<function=f>\n<parameter=a>\n1\n</function>\n</tool_call>", "without </parameter>"),
    ("deepseek_v3", f"{DS_CALLS}{DS_CALL}function{DS_SEP}f\n```json\n{{}}\n```", f"without {DS_CALL_END}"),
    ("deepseek_v3", f"{DS_CALLS}{DS_CALL}f{{}}{DS_CALL_END}", f"no {DS_SEP}"),
    ("deepseek_v3", f"{DS_CALLS}{DS_CALL}function{DS_SEP}f\n```json\n{{oops\n```{DS_CALL_END}", "not valid JSON"),
    ("deepseek_v3", f"{DS_CALLS}{DS_CALLS_END}", f"without {DS_CALL}"),
    ("harmony", "<|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json<|message|>{oops<|call|>",
     "not valid JSON"),
    ("harmony", "<|start|>assistant<|channel|>commentary to=functions.f", "without <|message|>"),
    ("harmony", "<|start|>assistant<|channel|>commentary to=functions. <|message|>{}<|call|>", "no name"),
])
def test_malformed_calls_say_what_is_wrong(parser, text, error):
    calls = parse(parser, text)
    assert calls and error in calls[-1].error


@pytest.mark.parametrize("template,parser", [
    ("{{- '<tool_call>\\n' + tool_call | tojson + '\\n</tool_call>' }}", "hermes"),  # Qwen2.5, Hermes, SmolLM2
    ("{%- if builtin_tools is defined %}{{- '<|python_tag|>' + tool_call.name + '.call(' }}", "llama3_json"),
    ("{{- '[TOOL_CALLS][' }}{%- for tool_call in message.tool_calls %}", "mistral"),
    ("{{- '[TOOL_CALLS]' + tool.name + '[ARGS]' + tool.arguments }}", "mistral"),
    ("{{- '\\n<tool_call>\\n<function=' + tool_call.name + '>\\n' }}{{- '<parameter=' + k + '>\\n' }}", "qwen3_coder"),
    ("{{'<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>'}}", "deepseek_v3"),
    ("{{- '<|start|>assistant to=' + 'functions.' + name + '<|channel|>commentary ' + '<|constrain|>json' }}"
     "{{- '<|message|>' + args + '<|call|>' }}", "harmony"),
    (TINY_TOOL_TEMPLATE, "hermes"),
])
def test_a_chat_template_names_its_tool_call_format(template, parser):
    assert parser_for_template(template)[0] == parser


def test_a_template_without_a_known_marker_names_none():
    assert parser_for_template("{% for m in messages %}{{ m['role'] + ': ' + m['content'] }}{% endfor %}") is None
    assert parser_for_template("") is None and parser_for_template(None) is None


def test_a_turn_keeps_the_special_tokens_its_format_marks_calls_with():
    """Mistral's [TOOL_CALLS] is a special token: a turn decoded without special tokens loses the call (the rollout
    reads such formats with them kept, all but the turn's closing end-of-sequence)."""
    transformers = pytest.importorskip("transformers")
    from rlflow.stages.tiny_model import build_tiny_llama
    from rlflow.stages.tool_parsers import parse, turn_text

    tok = transformers.AutoTokenizer.from_pretrained(build_tiny_llama("arith", progress=lambda line: None))
    tok.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]"]})
    ids = tok.encode('[TOOL_CALLS][{"name": "calculator", "arguments": {"expression": "2+2"}}]',
                     add_special_tokens=False) + [tok.eos_token_id]
    assert parse("mistral", tok.decode(ids, skip_special_tokens=True)) == []  # the marker is gone
    [call] = parse("mistral", turn_text(tok, ids, "mistral"))
    assert (call.name, call.arguments, call.error) == ("calculator", {"expression": "2+2"}, None)
    assert turn_text(tok, ids, "hermes") == tok.decode(ids, skip_special_tokens=True)  # other formats: as before
