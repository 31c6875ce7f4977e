"""Tool-call parsers (a rollout stage's `tool_parser:`): the tool calls in one generated turn's text.

Two formats, named as vLLM and the model cards name them:

- `hermes` (Hermes, Qwen2.5/Qwen3, SmolLM2): each call is `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`;
  a turn may hold several. A turn is a call when it contains `<tool_call>`.
- `json` (Llama 3.1-style plain function-call JSON): the whole turn (optionally in a ```json fence) is one object
  `{"name": ..., "arguments": {...}}` (`parameters` is read as `arguments`) or a list of them. A turn is a call when
  it starts with `{` or `[`.

A malformed call is never an exception: it is a ToolCall with `error` set (the tool message says what was wrong, so
the policy learns from it). `arguments` given as a JSON string of an object are decoded (some models write them so).
"""

from __future__ import annotations

import json
import re
from typing import NamedTuple

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
_HERMES = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)
_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.DOTALL)


class ToolCall(NamedTuple):
    name: str  # "" when the call did not say
    arguments: dict
    error: str | None = None  # why the call cannot run (malformed); None for a well-formed call


def parse_hermes(text: str) -> list[ToolCall]:
    """Every `<tool_call>...</tool_call>` of the text, in order (an unclosed last one is a malformed call)."""
    calls = []
    for m in _HERMES.finditer(text):
        if not m.group(2):
            calls.append(ToolCall("", {}, f"{HERMES_OPEN} without {HERMES_CLOSE}"))
        else:
            calls.append(_call(m.group(1).strip()))
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
        return [ToolCall("", {}, f"not valid JSON: {e.msg} at char {e.pos}")]
    items = value if isinstance(value, list) else [value]
    if not items:
        return [ToolCall("", {}, "an empty list of calls")]
    return [_object(item) for item in items]


def _call(body: str) -> ToolCall:
    try:
        value = json.loads(body)
    except json.JSONDecodeError as e:
        return ToolCall("", {}, f"not valid JSON: {e.msg} at char {e.pos}")
    return _object(value)


def _object(value) -> ToolCall:
    """A decoded call: {"name": str, "arguments" (or "parameters"): object or a JSON string of one}."""
    if not isinstance(value, dict):
        return ToolCall("", {}, f"a call is a JSON object, not {type(value).__name__}")
    name = value.get("name")
    if not isinstance(name, str) or not name:
        return ToolCall("", {}, 'the call has no "name"')
    args = value.get("arguments", value.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            return ToolCall(name, {}, '"arguments" is a string that is not JSON')
    if not isinstance(args, dict):
        return ToolCall(name, {}, f'"arguments" must be an object, not {type(args).__name__}')
    return ToolCall(name, args)


#: tool_parser name -> parser (text of one turn -> its calls)
PARSERS = {"hermes": parse_hermes, "json": parse_json}


def content(parser: str, text: str) -> str:
    """A turn's text outside its calls (an OpenAI message's `content` beside its `tool_calls`): hermes, the text
    around the `<tool_call>` blocks; json, nothing (the turn is the call)."""
    return _HERMES.sub("", text).strip() if parser == "hermes" else ""


def parse(parser: str, text: str) -> list[ToolCall]:
    """The calls of a turn in format `parser` (KeyError for an unknown one: compile rejects it first)."""
    return PARSERS[parser](text)
