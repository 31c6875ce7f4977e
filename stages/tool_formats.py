"""The tool-call formats of today's open models (stages/tool_parsers.py registers them as `tool_parser:` names).
Each format has a parser (the text of one turn -> its calls, in order; [] for a turn without one) and the text of the
turn outside its calls (an OpenAI message's `content`). A malformed call is a ToolCall with `error` set, never an
exception (stages/tool_call.py).

- `llama3_json` (Llama 3.1 / 3.2 / 3.3, Llama 4 in JSON mode): `{"name": ..., "parameters": {...}}`, optionally after
  `<|python_tag|>`; several separated by `;`. A turn is a call when it starts with `{` or holds `<|python_tag|>`.
- `pythonic` (Llama 3.2 / 3.3 / 4 with a pythonic template, ToolACE): `[get_weather(city="Paris"), now()]`, optionally
  in `<|python_start|>...<|python_end|>` (Llama 4). Read with `ast` (never evaluated): keyword arguments, literal
  values (strings, numbers, True/False/None, JSON's true/false/null, lists, dicts with string keys).
- `mistral`: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (tokenizers v2/v3: Mistral-7B-Instruct-v0.3,
  Mixtral-8x22B, Nemo) or one `[TOOL_CALLS]name[ARGS]{...}` per call (v11+: Mistral Small 3.1+, Magistral, Devstral;
  v11's `[CALL_ID]id` before `[ARGS]` is skipped). Text before the first `[TOOL_CALLS]` is the content.
- `qwen3_coder` (Qwen3-Coder, Qwen3-Next): `<tool_call>\n<function=NAME>\n<parameter=P>\nvalue\n</parameter>\n...
  </function>\n</tool_call>`. The template writes a string value as its text and any other value as JSON (a bool or
  None as Python writes it), so without the tool's schema a value is read back as JSON when it is a JSON number,
  true/false/null, True/False/None, or a JSON object, array or quoted string, and as its text otherwise.
- `deepseek_v3` (DeepSeek-V3, V3-0324, R1-0528): `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
  \\n```json\\n{...}\\n```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>` (the bars are U+FF5C, the low bars U+2581); V3.1's
  `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>` is read too.
- `harmony` (gpt-oss): each call is a message whose header names a recipient, `<|start|>assistant<|channel|>commentary
  to=functions.NAME <|constrain|>json<|message|>{...}<|call|>` (the recipient may stand before `<|channel|>`; the
  turn's first message has no `<|start|>assistant`, which ends the prompt). The content is the `final` channel's text.

These markers are special tokens in most of these tokenizers: a turn decoded with skip_special_tokens loses them,
so the rollout reads mistral, deepseek_v3 and harmony turns with special tokens kept (tool_parsers.turn_text);
Llama's `<|python_tag|>` is optional: its JSON is read without it.
"""

from __future__ import annotations

import ast
import json
import re

from rlflow.stages.tool_call import ToolCall, call_object, json_arguments, json_error, malformed

# -- llama3_json ------------------------------------------------------------------------------------------------

PYTHON_TAG = "<|python_tag|>"


def _llama_body(text: str) -> str | None:
    """The calls part of a Llama 3 turn (None: the turn is not a call)."""
    if PYTHON_TAG in text:
        return text.split(PYTHON_TAG, 1)[1].strip()
    body = text.strip()
    return body if body.startswith("{") else None


def parse_llama3_json(text: str) -> list[ToolCall]:
    """`{"name", "parameters"}` objects separated by `;` (a turn that starts with `{`, or after `<|python_tag|>`)."""
    body = _llama_body(text)
    if body is None:
        return []
    if not body.startswith("{"):
        return [malformed(f'after {PYTHON_TAG} a call is a JSON object {{"name": ..., "parameters": {{...}}}}')]
    calls, pos, decoder = [], 0, json.JSONDecoder()
    while True:
        try:
            value, pos = decoder.raw_decode(body, pos)
        except json.JSONDecodeError as e:
            return calls + [malformed(json_error(e))]
        calls.append(call_object(value))
        rest = body[pos:].lstrip()
        if not rest.lstrip(";").strip():
            return calls
        if not rest.startswith(";"):
            return calls + [malformed(f"text after a call: {rest[:40]!r} (calls are separated by ';')")]
        pos = len(body) - len(rest[1:].lstrip())


def llama3_json_content(text: str) -> str:
    """The text before `<|python_tag|>`; the JSON turn is the call."""
    return text.split(PYTHON_TAG, 1)[0].strip() if PYTHON_TAG in text else "" if _llama_body(text) else text.strip()


# -- pythonic ---------------------------------------------------------------------------------------------------

PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"
_CALL_LIST = re.compile(r"\[\s*[A-Za-z_][\w.]*\s*\(")
_JSON_NAMES = {"true": True, "false": False, "null": None}


def _pythonic_body(text: str) -> str | None:
    if PYTHON_START in text:
        return text.split(PYTHON_START, 1)[1].split(PYTHON_END, 1)[0].strip()
    body = text.strip()
    return body if _CALL_LIST.match(body) else None


def parse_pythonic(text: str) -> list[ToolCall]:
    """A Python list of calls with keyword arguments, parsed with ast (nothing is evaluated)."""
    body = _pythonic_body(text)
    if body is None:
        return []
    try:
        tree = ast.parse(body, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        return [malformed(f"not a Python list of calls: {getattr(e, 'msg', None) or type(e).__name__}")]
    if not isinstance(tree, ast.List) or not tree.elts:
        return [malformed("the calls are a Python list of function calls: [f(a=1), g()]")]
    return [_python_call(node) for node in tree.elts]


def _python_call(node: ast.expr) -> ToolCall:
    if not isinstance(node, ast.Call):
        return malformed("an item of the list is not a function call")
    if not isinstance(node.func, ast.Name):
        return malformed("a call names its function by a plain identifier: f(a=1)")
    name = node.func.id
    if node.args:
        return malformed(f"{name}: positional arguments; name each one, {name}(x=1)", name)
    args = {}
    for kw in node.keywords:
        if kw.arg is None:
            return malformed(f"{name}: ** is not a literal argument", name)
        try:
            args[kw.arg] = _literal(kw.value)
        except (ValueError, RecursionError):
            return malformed(f"{name}: argument {kw.arg!r} is not a literal (a string, number, True/False/None, "
                             "list or dict)", name)
    return ToolCall(name, args)


def _literal(node: ast.expr):
    """A JSON value written as a Python literal (JSON's true/false/null read too); ValueError for anything else."""
    if isinstance(node, ast.Constant) and (node.value is None or isinstance(node.value, (str, int, float))):
        return node.value
    if (isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)) and isinstance(node.operand, ast.Constant)
            and type(node.operand.value) in (int, float)):
        return -node.operand.value if isinstance(node.op, ast.USub) else node.operand.value
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict) and all(isinstance(k, ast.Constant) and isinstance(k.value, str) for k in node.keys):
        return {k.value: _literal(v) for k, v in zip(node.keys, node.values)}
    raise ValueError("not a literal")


def pythonic_content(text: str) -> str:
    """The text before `<|python_start|>`; a bare list of calls is the whole turn."""
    return text.split(PYTHON_START, 1)[0].strip() if PYTHON_START in text else "" if _pythonic_body(text) else text.strip()


# -- mistral ----------------------------------------------------------------------------------------------------

TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_MISTRAL_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_JSON_LIST = re.compile(r"\s*\[\s*[{\]]")  # v3's list of call objects, not v11's [ARGS] / [CALL_ID]


def parse_mistral(text: str) -> list[ToolCall]:
    """After each `[TOOL_CALLS]`: a JSON list of {"name", "arguments"} (v3), or name[ARGS]{arguments} (v11+)."""
    if TOOL_CALLS not in text:
        return []
    calls = []
    for piece in text.split(TOOL_CALLS)[1:]:
        calls += _mistral_list(piece.strip()) if _JSON_LIST.match(piece) else [_mistral_call(piece)]
    return calls


def _mistral_list(body: str) -> list[ToolCall]:
    try:
        value = json.loads(body)
    except json.JSONDecodeError as e:
        return [malformed(json_error(e))]
    if not value:
        return [malformed("an empty list of calls")]
    return [call_object(item) for item in value]


def _mistral_call(piece: str) -> ToolCall:
    head, sep, body = piece.partition(ARGS)
    if not sep:  # the [ARGS] token dropped: the arguments start at the first brace
        brace = piece.find("{")
        if brace < 0:
            return malformed(f"a call is {TOOL_CALLS}name{ARGS}{{...}}: no arguments after the name")
        head, body = piece[:brace], piece[brace:]
    name = head.split(CALL_ID, 1)[0].strip()
    if not _MISTRAL_NAME.fullmatch(name):
        return malformed(f"{name[:40]!r} is not a function name" if name else "the call has no name")
    return json_arguments(name, body.strip())


def mistral_content(text: str) -> str:
    return text.split(TOOL_CALLS, 1)[0].strip()


# -- qwen3_coder ------------------------------------------------------------------------------------------------

_QWEN_CALL = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)
_QWEN_FUNCTION = re.compile(r"<function=(.*?)(</function>|$)", re.DOTALL)
_QWEN_PARAMETER = re.compile(r"<parameter=(.*?)(</parameter>|$)", re.DOTALL)
_JSON_SCALAR = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?|true|false|null")
_PYTHON_WORDS = {"True": True, "False": False, "None": None}


def parse_qwen3_coder(text: str) -> list[ToolCall]:
    """Every `<tool_call><function=NAME><parameter=P>value</parameter>...</function></tool_call>` (a turn with
    `<function=` blocks but no `<tool_call>` around them is read too)."""
    blocks = [(m.group(1), bool(m.group(2))) for m in _QWEN_CALL.finditer(text)]
    if not blocks and "<function=" in text:
        blocks = [(text, True)]
    calls = []
    for body, closed in blocks:
        functions = list(_QWEN_FUNCTION.finditer(body)) if closed else []
        if not closed:
            calls.append(malformed("<tool_call> without </tool_call>"))
        elif not functions:
            calls.append(malformed("<tool_call> without <function=NAME>"))
        calls += [_qwen_function(f.group(1), bool(f.group(2))) for f in functions]
    return calls


def _qwen_function(inner: str, closed: bool) -> ToolCall:
    name, gt, params = inner.partition(">")
    name = name.strip()
    if not closed:
        return malformed("<function=...> without </function>", name if gt else "")
    if not gt or not name:
        return malformed("a call is <function=NAME>...</function>")
    args = {}
    for m in _QWEN_PARAMETER.finditer(params):
        key, gt, value = m.group(1).partition(">")
        if not m.group(2):
            return malformed("<parameter=...> without </parameter>", name)
        if not gt or not key.strip():
            return malformed("a parameter is <parameter=NAME>value</parameter>", name)
        args[key.strip()] = _qwen_value(value)
    return ToolCall(name, args)


def _qwen_value(raw: str):
    """A parameter's value: the template puts a newline either side of it."""
    value = raw.removeprefix("\n").removesuffix("\n")
    if value in _PYTHON_WORDS:
        return _PYTHON_WORDS[value]
    if _JSON_SCALAR.fullmatch(value) or value[:1] in ('{', '[', '"'):
        try:
            return json.loads(value)
        except (json.JSONDecodeError, RecursionError):
            return value
    return value


def qwen3_coder_content(text: str) -> str:
    if "<tool_call>" not in text:
        return _QWEN_FUNCTION.sub("", text).strip()
    return _QWEN_CALL.sub("", text).strip()


# -- deepseek_v3 ------------------------------------------------------------------------------------------------

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, TOOL_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
_DEEPSEEK_CALL = re.compile(f"{re.escape(CALL_BEGIN)}(.*?)({re.escape(CALL_END)}|$)", re.DOTALL)
_DEEPSEEK_V3 = re.compile(r"([^\n]*)\n```(?:json)?\n(.*)\n```\s*", re.DOTALL)


def parse_deepseek_v3(text: str) -> list[ToolCall]:
    """Every `<｜tool▁call▁begin｜>...<｜tool▁call▁end｜>`: `type<｜tool▁sep｜>NAME` and a ```json fence (V3, R1), or
    `NAME<｜tool▁sep｜>{...}` (V3.1)."""
    if CALLS_BEGIN not in text and CALL_BEGIN not in text:
        return []
    found = list(_DEEPSEEK_CALL.finditer(text))
    if not found:
        return [malformed(f"{CALLS_BEGIN} without {CALL_BEGIN}")]
    return [_deepseek_call(m.group(1), bool(m.group(2))) for m in found]


def _deepseek_call(body: str, closed: bool) -> ToolCall:
    if not closed:
        return malformed(f"{CALL_BEGIN} without {CALL_END}")
    head, sep, rest = body.partition(TOOL_SEP)
    if not sep:
        return malformed(f"a call is {CALL_BEGIN}function{TOOL_SEP}NAME and its arguments: no {TOOL_SEP}")
    if v3 := _DEEPSEEK_V3.fullmatch(rest):
        return json_arguments(v3.group(1).strip(), v3.group(2))
    return json_arguments(head.strip(), rest)


def deepseek_v3_content(text: str) -> str:
    """The text before the calls block and after its end."""
    starts = [i for i in (text.find(CALLS_BEGIN), text.find(CALL_BEGIN)) if i >= 0]
    if not starts:
        return text.strip()
    end = text.rfind(CALLS_END)
    after = text[end + len(CALLS_END):] if end > min(starts) else ""
    return (text[:min(starts)] + after).strip()


# -- harmony ----------------------------------------------------------------------------------------------------

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
_MESSAGE_END = re.compile(r"<\|(?:end|call|return)\|>")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_WORD = re.compile(r"\s*([^\s<]*)")


def _messages(text: str):
    """(header, body or None without `<|message|>`) of each message of a turn that has a channel."""
    for piece in text.split(START):
        header, sep, body = piece.partition(MESSAGE)
        if CHANNEL not in header:
            continue
        end = _MESSAGE_END.search(body)
        yield header, (body[:end.start()] if end else body) if sep else None


def parse_harmony(text: str) -> list[ToolCall]:
    """Each message addressed `to=functions.NAME` (another recipient, e.g. `python`, keeps its whole name): its body
    is the JSON arguments."""
    calls = []
    for header, body in _messages(text):
        recipient = _RECIPIENT.search(header)
        if recipient is None:
            continue
        name = recipient.group(1).removeprefix("functions.")
        if body is None:
            calls.append(malformed(f"a message to {recipient.group(1)} without {MESSAGE}", name))
        else:
            calls.append(json_arguments(name, body.strip()))
    return calls


def harmony_content(text: str) -> str:
    """The text of the turn's `final` channel messages."""
    return "\n".join(body.strip() for header, body in _messages(text)
                     if body is not None and _WORD.match(header.partition(CHANNEL)[2]).group(1) == "final")
