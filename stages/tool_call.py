"""One tool call as a parser reads it (stages/tool_parsers.py, stages/tool_formats.py): the ToolCall tuple, and the
decoding every JSON-bodied format shares.

A malformed call is never an exception: it is a ToolCall with `error` set (the tool message says what was wrong, so
the policy learns from it). `arguments` given as a JSON string of an object are decoded (some models write them so).
"""

from __future__ import annotations

import json
from typing import NamedTuple


class ToolCall(NamedTuple):
    name: str  # "" when the call did not say
    arguments: dict
    error: str | None = None  # why the call cannot run (malformed); None for a well-formed call


def malformed(why: str, name: str = "") -> ToolCall:
    return ToolCall(name, {}, why)


def json_error(e: json.JSONDecodeError) -> str:
    return f"not valid JSON: {e.msg} at char {e.pos}"


def json_call(body: str) -> ToolCall:
    """A call written as one JSON object {"name", "arguments" (or "parameters")}."""
    try:
        value = json.loads(body)
    except json.JSONDecodeError as e:
        return malformed(json_error(e))
    return call_object(value)


def call_object(value) -> ToolCall:
    """A decoded call: {"name": str, "arguments" (or "parameters"): object or a JSON string of one}."""
    if not isinstance(value, dict):
        return malformed(f"a call is a JSON object, not {type(value).__name__}")
    name = value.get("name")
    if not isinstance(name, str) or not name:
        return malformed('the call has no "name"')
    return named_call(name, value.get("arguments", value.get("parameters", {})))


def named_call(name: str, args) -> ToolCall:
    """A call whose name the format gives outside its JSON: `args` an object, or a JSON string of one."""
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            return malformed('"arguments" is a string that is not JSON', name)
    if not isinstance(args, dict):
        return malformed(f'"arguments" must be an object, not {type(args).__name__}', name)
    return ToolCall(name, args)


def json_arguments(name: str, body: str) -> ToolCall:
    """A call whose name the format gives outside its JSON, and whose body is the arguments object ("" = none)."""
    if not name:
        return malformed("the call has no name")
    if not body.strip():
        return ToolCall(name, {})
    try:
        args = json.loads(body)
    except json.JSONDecodeError as e:
        return malformed(f"the arguments are {json_error(e)}", name)
    return named_call(name, args)
