"""Tool-call parsers (a rollout stage's `tool_parser:`): the tool calls in one generated turn's text, and the text
outside them.

Named as vLLM and the model cards name them; two here, the newer models' in stages/tool_formats.py:

- `hermes` (Hermes, Qwen2.5/Qwen3, SmolLM2): each call is `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`;
  a turn may hold several. A turn is a call when it contains `<tool_call>`.
- `json` (plain function-call JSON): the whole turn (optionally in a ```json fence) is one object
  `{"name": ..., "arguments": {...}}` (`parameters` is read as `arguments`) or a list of them. A turn is a call when
  it starts with `{` or `[`.
- `llama3_json`, `pythonic`, `mistral`, `qwen3_coder`, `deepseek_v3`, `harmony`: stages/tool_formats.py.

Every parser takes the turn's text and returns its calls in order ([] for a turn without one). A malformed call is
never an exception: it is a ToolCall with `error` set (stages/tool_call.py; the tool message says what was wrong, so
the policy learns from it). `parser_for_template` names the format a chat template writes calls in, by its markers.
"""

from __future__ import annotations

import json
import re

from rlflow.stages import tool_formats as formats
from rlflow.stages.tool_call import ToolCall, call_object, json_call, json_error, malformed

__all__ = ["PARSERS", "ToolCall", "content", "parse", "parse_hermes", "parse_json", "parser_for_template"]

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
_HERMES = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)
_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.DOTALL)


def parse_hermes(text: str) -> list[ToolCall]:
    """Every `<tool_call>...</tool_call>` of the text, in order (an unclosed last one is a malformed call)."""
    calls = []
    for m in _HERMES.finditer(text):
        if not m.group(2):
            calls.append(malformed(f"{HERMES_OPEN} without {HERMES_CLOSE}"))
        else:
            calls.append(json_call(m.group(1).strip()))
    return calls


def parse_json(text: str) -> list[ToolCall]:
    """The call(s) of a turn that is one JSON object or a list of them; [] for a turn that is not JSON-shaped."""
    body = text.strip()
    if fence := _FENCE.match(body):
        body = fence.group(1)
    if not body.startswith(("{", "[")):
        return []
    try:
        value = json.loads(body)
    except json.JSONDecodeError as e:
        return [malformed(json_error(e))]
    items = value if isinstance(value, list) else [value]
    if not items:
        return [malformed("an empty list of calls")]
    return [call_object(item) for item in items]


def _hermes_content(text: str) -> str:
    return _HERMES.sub("", text).strip()


def _no_content(text: str) -> str:
    return ""


#: tool_parser name -> parser (text of one turn -> its calls)
PARSERS = {"hermes": parse_hermes, "json": parse_json, "llama3_json": formats.parse_llama3_json,
           "pythonic": formats.parse_pythonic, "mistral": formats.parse_mistral,
           "qwen3_coder": formats.parse_qwen3_coder, "deepseek_v3": formats.parse_deepseek_v3,
           "harmony": formats.parse_harmony}
#: tool_parser name -> the text of a turn outside its calls
CONTENT = {"hermes": _hermes_content, "json": _no_content, "llama3_json": formats.llama3_json_content,
           "pythonic": formats.pythonic_content, "mistral": formats.mistral_content,
           "qwen3_coder": formats.qwen3_coder_content, "deepseek_v3": formats.deepseek_v3_content,
           "harmony": formats.harmony_content}

#: (marker in a chat template, the parser of the calls it writes), the more specific first: Qwen3-Coder's template
#: has `<tool_call>` too, around its `<function=...>` calls
TEMPLATE_MARKERS = (
    ("<|constrain|>", "harmony"), ("<|call|>", "harmony"),
    ("tool▁calls▁begin", "deepseek_v3"),
    ("[TOOL_CALLS]", "mistral"),
    ("<function=", "qwen3_coder"),
    ("<tool_call>", "hermes"),
    ("<|python_tag|>", "llama3_json"),
)
#: formats that read another's calls too: `json` reads Llama 3.x's one-object turns
COMPATIBLE = {"llama3_json": {"json"}}


def parser_for_template(template: str | None) -> tuple[str, str] | None:
    """(parser, the marker that named it) for a chat template that writes tool calls in a known format; None when
    its text has none of the markers."""
    for marker, parser in TEMPLATE_MARKERS:
        if template and marker in template:
            return parser, marker
    return None


def content(parser: str, text: str) -> str:
    """A turn's text outside its calls (an OpenAI message's `content` beside its `tool_calls`): hermes, the text
    around the `<tool_call>` blocks; json, nothing (the turn is the call); the others: stages/tool_formats.py."""
    return CONTENT[parser](text)


def parse(parser: str, text: str) -> list[ToolCall]:
    """The calls of a turn in format `parser` (KeyError for an unknown one: compile rejects it first)."""
    return PARSERS[parser](text)


#: formats whose call markers are special tokens in their models' tokenizers (Mistral's [TOOL_CALLS] / [ARGS] from
#: tokenizer v3, DeepSeek's tool-call tokens, gpt-oss's harmony headers): their turns are read with special tokens kept
MARKERS_ARE_SPECIAL = frozenset({"mistral", "deepseek_v3", "harmony"})


def turn_text(tokenizer, ids: list[int], parser: str | None) -> str:
    """A generated turn as text for its parser: special tokens dropped, except for the formats whose markers are
    special tokens, which keep them (all but the end-of-sequence and padding the turn ends with)."""
    if parser not in MARKERS_ARE_SPECIAL:
        return tokenizer.decode(ids, skip_special_tokens=True)
    ends = {tokenizer.eos_token_id, tokenizer.pad_token_id} - {None}
    n = len(ids)
    while n and ids[n - 1] in ends:
        n -= 1
    return tokenizer.decode(ids[:n], skip_special_tokens=False)
