"""Tools of a chat-form rollout stage (`tools:`): their JSON schemas (OpenAI function format), the callables that run
them, and the environment that runs a turn's calls (rlflow/runtime/chat_episodes.py drives it).

A tool is named by
- an import string `package.module:function`, or a built-in name (`builtin:calculator`): the schema comes from the
  function's signature (type hints: str, int, float, bool, list, dict) and docstring (first paragraph: the
  description; an `Args:` section: one `name: description` line per parameter);
- a dict: an OpenAI function schema (`{"type": "function", "function": {name, description, parameters}}`, or the
  inner `{name, description, parameters}`) plus `fn`, the import string of the callable that runs it.

A tool's result is sent to the model as text (str() of what it returns, at most MAX_RESULT_CHARS). A call that
cannot run (malformed, unknown tool, wrong arguments, the tool raised) gets a message that says why, never an
exception: the policy learns from it.
"""

from __future__ import annotations

import inspect
import re
import typing

from rlflow.stages.environment import Environment, EnvStep
from rlflow.stages.tool_parsers import parse

MAX_RESULT_CHARS = 500
_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}
NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]{0,63}$")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression (numbers, + - * / // %, parentheses) and return its value.

    Args:
        expression: the expression, e.g. 37+48
    """
    from rlflow.stages.env_calculator import calculate

    return calculate(str(expression))


#: built-in tools, by exact name
BUILTIN_TOOLS = {"builtin:calculator": calculator}


class ToolError(ValueError):
    """A tool entry that cannot be used; str() says why, `rule` names the rule and `fix` the way out."""

    def __init__(self, why: str, rule: str, fix: str):
        super().__init__(why)
        self.rule, self.fix = rule, fix


def resolve_callable(ref: str):
    """The function an import string or built-in name names (ToolError if it cannot be imported or called)."""
    if ref in BUILTIN_TOOLS:
        return BUILTIN_TOOLS[ref]
    if ref.startswith("builtin:"):
        raise ToolError(f"unknown built-in tool {ref!r}", "unknown-tool", f"use one of {', '.join(BUILTIN_TOOLS)} or "
                        "an import string package.module:function")
    from rlflow import registry

    if not registry.IMPORT_STRING.match(ref):
        raise ToolError(f"tool {ref!r} is not an import string", "bad-tool",
                        f"name a function as package.module:function, or a built-in ({', '.join(BUILTIN_TOOLS)})")
    try:
        fn = registry._import(ref)
    except registry.ComponentError as e:  # why; the way out
        why, _, fix = str(e).partition("; ")
        raise ToolError(f"tool {ref!r} cannot be imported: {why}", "bad-tool",
                        fix or "check the module is on the path (beside the pipeline, or installed)") from e
    if not callable(fn):
        raise ToolError(f"tool {ref!r} is a {type(fn).__name__}, not a function", "bad-tool", "name a function")
    return fn


def schema_of(fn) -> dict:
    """The OpenAI function schema of a function, from its signature and docstring."""
    doc = inspect.getdoc(fn) or ""
    summary = doc.split("\n\n")[0].replace("\n", " ").strip()
    arg_docs = dict(re.findall(r"^\s+(\w+)(?: \([^)]*\))?: (.+)$", doc.partition("Args:")[2], re.MULTILINE))
    hints = typing.get_type_hints(fn)
    properties, required = {}, []
    for name, p in inspect.signature(fn).parameters.items():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        hint = typing.get_origin(hints.get(name)) or hints.get(name)
        prop = {"type": _TYPES[hint]} if hint in _TYPES else {}
        if name in arg_docs:
            prop["description"] = arg_docs[name].strip()
        properties[name] = prop
        if p.default is p.empty:
            required.append(name)
    return {"type": "function", "function": {"name": fn.__name__, "description": summary,
                                             "parameters": {"type": "object", "properties": properties, "required": required}}}


def checked_schema(entry: dict) -> dict:
    """An OpenAI function schema (either form) as `{"type": "function", "function": {...}}`, checked (ToolError)."""
    fn = entry.get("function", entry) if entry.get("type", "function") == "function" else None
    if not isinstance(fn, dict):
        raise ToolError(f"tool schema has type {entry.get('type')!r}", "bad-tool-schema", 'use {"type": "function", ...}')
    name, params = fn.get("name"), fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(name, str) or not NAME.match(name):
        raise ToolError(f"tool schema has no valid name ({name!r})", "bad-tool-schema",
                        "give function.name: letters, digits, _ or -, at most 64")
    if not isinstance(params, dict) or params.get("type") != "object" or not isinstance(params.get("properties", {}), dict):
        raise ToolError(f"tool '{name}': parameters must be a JSON schema of type object with properties",
                        "bad-tool-schema", 'write parameters as {"type": "object", "properties": {...}, "required": [...]}')
    if not isinstance(fn.get("description", ""), str):
        raise ToolError(f"tool '{name}': description must be text", "bad-tool-schema", "write the description as a string")
    return {"type": "function", "function": {**{k: v for k, v in fn.items() if k != "fn"}, "parameters": params}}


def load_tool(entry) -> tuple[dict, object]:
    """(schema, callable) of one `tools:` entry (ToolError when it cannot be used)."""
    if isinstance(entry, str):
        fn = resolve_callable(entry)
        return schema_of(fn), fn
    if not isinstance(entry, dict):
        raise ToolError(f"a tool is an import string or a schema dict, not {type(entry).__name__}", "bad-tool",
                        "write package.module:function, builtin:calculator, or a schema with fn:")
    entry = dict(entry)
    ref = entry.pop("fn", None)
    if not isinstance(ref, str):
        raise ToolError(f"tool schema {entry.get('function', entry).get('name', '?')!r} has no fn", "tool-without-fn",
                        "add fn: package.module:function, the callable that runs it")
    return checked_schema(entry), resolve_callable(ref)


def load_tools(entries: list) -> tuple[list[dict], dict[str, object]]:
    """The schemas (in order) and name -> callable of a stage's tools (ToolError on the first unusable one)."""
    schemas, fns = [], {}
    for entry in entries:
        schema, fn = load_tool(entry)
        name = schema["function"]["name"]
        if name in fns:
            raise ToolError(f"two tools are named '{name}'", "duplicate-tool", "give each tool its own name")
        schemas.append(schema)
        fns[name] = fn
    return schemas, fns


def run_call(fns: dict, name: str, arguments: dict, error: str | None) -> str:
    """One call's result as text; what was wrong when it cannot run."""
    if error:
        return f"error: {error}"
    if name not in fns:
        return f"error: unknown tool '{name}'; tools: {', '.join(fns)}"
    try:
        result = fns[name](**arguments)
    except TypeError as e:
        return f"error: bad arguments for '{name}': {e}"[:MAX_RESULT_CHARS]
    except Exception as e:  # noqa: BLE001 - a tool's failure is the model's observation, not the run's
        return f"error: {type(e).__name__}: {e}"[:MAX_RESULT_CHARS]
    return str(result)[:MAX_RESULT_CHARS]


class ToolBox(Environment):
    """The environment of a chat-form episode: `step` runs the turn's tool calls and returns the tool messages
    (`{"role": "tool", "name", "content"}` dicts, in call order) as its observation; a turn without calls ends the
    episode (the worker only sends turns that hold calls). Picklable: it keeps the tool entries, not the functions."""

    def __init__(self, tools: list, parser: str):
        self.tools, self.parser = list(tools), parser
        self._fns = None

    def __getstate__(self):
        return {"tools": self.tools, "parser": self.parser}

    def __setstate__(self, state):
        self.tools, self.parser, self._fns = state["tools"], state["parser"], None

    def calls(self, action: str):
        return parse(self.parser, action)

    def step(self, action: str) -> EnvStep:
        if self._fns is None:
            self._fns = load_tools(self.tools)[1]
        messages = [{"role": "tool", "name": c.name or "unknown", "content": run_call(self._fns, *c)}
                    for c in self.calls(action)]
        return EnvStep(messages, 0.0, not messages)
