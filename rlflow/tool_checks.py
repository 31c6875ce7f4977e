"""Compile-time rules of chat-form tool calling (a rollout stage's `tools:` and `tool_parser:`,
rlflow/runtime/chat_episodes.py): every tool loads and has a valid schema, the parser is known and fits the model's
chat template, the stage can reach a second turn, and the model has a chat template to render tool messages with.

A local model's chat template names its tool-call format by its markers (stages/tool_parsers.py
parser_for_template): a stage with tools (or an agent) and no `tool_parser` gets that parser at compile, and the
summary says so; a `tool_parser` the template contradicts is `tool-parser-mismatch`. Built-in models keep the rules
as they are (`tools-need-parser`): their tokenizers are built, not read from a directory."""

from __future__ import annotations

import json
from pathlib import Path

from rlflow.errors import Problem

TINY = "builtin:tiny-llama"  # no template of its own: chat-form stages render it with stages/chat_template.py's


def template_text(model_dir: Path) -> str | None:
    """The chat template of a local model directory's tokenizer (chat_template.jinja, chat_template.json or
    tokenizer_config.json's `chat_template`; of named templates, `tool_use`, else `default`); None without one."""
    try:
        return (model_dir / "chat_template.jinja").read_text()
    except (OSError, UnicodeDecodeError):
        pass
    for name in ("chat_template.json", "tokenizer_config.json"):
        try:
            config = json.loads((model_dir / name).read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            continue
        value = config.get("chat_template") if isinstance(config, dict) else None
        if isinstance(value, list):  # [{"name": ..., "template": ...}]
            named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
            value = named.get("tool_use") or named.get("default")
        if isinstance(value, str) and value:
            return value
    return None


def model_tool_format(spec, base_dir, resolve) -> tuple[str, str] | None:
    """(parser, marker): the tool-call format a local model's chat template writes; None for a built-in model, a
    model directory not at hand (its own rules name that), or a template without a known marker.
    `resolve`: component_checks.resolve_path."""
    from rlflow.stages.tool_parsers import parser_for_template

    if spec.model.path.startswith("builtin:"):
        return None
    model_dir = resolve(spec.model.path, base_dir)
    if model_dir is None or not (model_dir / "config.json").is_file():
        return None
    return parser_for_template(template_text(model_dir))


def picked_tool_parsers(spec, base_dir, resolve) -> dict[str, tuple[str, str]]:
    """Rollout stages with tools or an agent and no tool_parser -> the (parser, marker) compile gives them from the
    model's chat template; none when the template names no format."""
    stages = [n for n, s in spec.stages.items()
              if s.kind == "rollout" and (s.tools or s.agent is not None) and s.tool_parser is None]
    found = model_tool_format(spec, base_dir, resolve) if stages else None
    return dict.fromkeys(stages, found) if found else {}


def check_parser_fits(parser: str | None, loc: tuple, problems: list[Problem], model_format: tuple[str, str] | None) -> None:
    """A stage's explicit tool_parser against the format its model's chat template names (tool-parser-mismatch)."""
    from rlflow.stages.tool_parsers import COMPATIBLE, PARSERS

    if model_format is None or parser is None or parser not in PARSERS:
        return
    found, marker = model_format
    if parser != found and parser not in COMPATIBLE.get(found, ()):
        problems.append(Problem(loc + ("tool_parser",), f"tool_parser is {parser}, but the model's chat template writes "
                                f"{found} calls (it has {marker!r}): every call the model makes would be missed or "
                                "malformed", "tool-parser-mismatch",
                                f"set tool_parser: {found}, or remove tool_parser (compile then picks {found} from the "
                                "template)"))


def check_tool_stage(stage, loc: tuple, problems: list[Problem], model_format: tuple[str, str] | None = None) -> None:
    """The tool settings of one rollout stage; `model_format`: what its local model's chat template names
    (model_tool_format), which an unset tool_parser takes."""
    from rlflow.stages.tool_parsers import PARSERS
    from rlflow.stages.tools import ToolError, load_tools

    if not stage.tools:
        if stage.tool_parser is not None:
            problems.append(Problem(loc + ("tool_parser",), "tool_parser is set but the stage has no tools",
                                    "parser-needs-tools", "list the tools under tools:, or remove tool_parser"))
        return
    if stage.env is not None:
        problems.append(Problem(loc + ("tools",), f"the stage has both env '{stage.env}' (text form) and tools (chat "
                                "form); an episode has one of them", "tools-with-env",
                                "keep env: with stop strings for raw text, or tools: with tool_parser for chat"))
    elif stage.env_kwargs:
        problems.append(Problem(loc + ("env_kwargs",), "env_kwargs is set but the stage has tools, no environment",
                                "turns-need-env", "remove env_kwargs (tools are functions, built with no arguments)"))
    if stage.tool_parser is None and model_format is None:
        problems.append(Problem(loc + ("tool_parser",), "tools are set but not the model's tool-call format (and the "
                                "model has no local chat template that names one)", "tools-need-parser",
                                f"set tool_parser: one of {', '.join(PARSERS)} (hermes: Qwen2.5, Hermes, SmolLM2; "
                                "llama3_json: Llama 3.x; docs/guides/tool-calling.md#parsers)"))
    elif stage.tool_parser is not None and stage.tool_parser not in PARSERS:
        problems.append(Problem(loc + ("tool_parser",), f"unknown tool_parser '{stage.tool_parser}'", "unknown-tool-parser",
                                f"use one of: {', '.join(PARSERS)}"))
    check_parser_fits(stage.tool_parser, loc, problems, model_format)
    for i, entry in enumerate(stage.tools):
        try:
            load_tools([entry])
        except ToolError as e:
            problems.append(Problem(loc + ("tools", i), str(e), e.rule, e.fix))
    try:
        load_tools(stage.tools)
    except ToolError as e:
        if e.rule == "duplicate-tool":
            problems.append(Problem(loc + ("tools",), str(e), e.rule, e.fix))
    if stage.max_turns < 2:
        problems.append(Problem(loc + ("max_turns",), f"tools with max_turns {stage.max_turns}: the episode ends before "
                                "a tool's result is ever read", "tools-need-turns",
                                "set max_turns to 2 or more (a tool call and the answer after it)"))


def check_tools_template(spec, template: bool, problems: list[Problem]) -> None:
    """Chat-form tools render the conversation with the model's chat template: the model needs one."""
    if template or spec.model.path == TINY:
        return
    for name, stage in spec.stages.items():
        if stage.kind == "rollout" and stage.tools:
            problems.append(Problem(("stages", name, "tools"), f"tools render the conversation with the chat template, "
                                    f"but the tokenizer of model '{spec.model.path}' has none", "tools-need-chat-template",
                                    "use a model whose tokenizer has one (e.g. builtin:smollm2-135m), or env: with stop "
                                    "strings (text form)"))


def tiny_template(spec) -> str | None:
    """The template a chat-form stage renders builtin:tiny-llama with (None: the model's own)."""
    if spec.model.path != TINY:
        return None
    from rlflow.stages.chat_template import TINY_TOOL_TEMPLATE

    return TINY_TOOL_TEMPLATE


def check_tools_prompt_room(spec, base_dir, problems: list[Problem], resolve) -> None:
    """A chat-form stage's prompt is rendered with the tools block (stages/chat_template.py), not tokenized raw: the
    longest rendered prompt of its tasks' head rows, plus max_new_tokens, must fit model.max_model_len (else the
    engine refuses it when the run generates). Measured with the tokenizer the run renders with: a local model's, or
    builtin:tiny-llama's as its build trains it; skipped while the stage or the model has problems of its own.
    `resolve`: component_checks.resolve_path (a path relative to the pipeline, else the working directory)."""
    from rlflow.errors import PipelineInvalid
    from rlflow.stages.chat_template import ChatRenderer, TemplateError
    from rlflow.stages.tools import ToolError, load_tools
    from rlflow.task_routes import task_routes

    named = {p.loc[:2] for p in problems}
    stages = [n for n, s in spec.stages.items() if s.kind == "rollout" and s.tools and ("stages", n) not in named]
    if not stages or ("model", "path") in named or any(p.loc[:1] == ("data",) for p in problems):
        return
    try:
        routes = task_routes(spec)
        tokenizer = _tokenizer(spec, base_dir, resolve)
    except (LookupError, ValueError, OSError, PipelineInvalid):  # what stops these is named by its own rule
        return
    if tokenizer is None:
        return
    limit = spec.model.max_model_len
    for name in stages:
        stage = spec.stages[name]
        try:
            renderer = ChatRenderer(tokenizer, load_tools(stage.tools)[0], tiny_template(spec))
        except (ToolError, TemplateError):  # tools-need-chat-template and the tool rules name these
            continue
        block = len(renderer.prompt_ids(""))
        n, where = max(((len(renderer.prompt_ids(text, system)), where)
                        for where, text, system in _head_prompts(spec, base_dir, routes, name, resolve)),
                       key=lambda measured: measured[0], default=(block, ""))
        if n + stage.max_new_tokens > limit:
            at = f"the prompt at {where}" if where else "an empty prompt"
            problems.append(Problem(("stages", name, "tools"), f"with tools, {at} renders in chat form to {n} tokens "
                                    f"({block} of them the template and the tools block); with max_new_tokens "
                                    f"{stage.max_new_tokens} that exceeds model.max_model_len {limit}", "prompt-too-long",
                                    f"raise model.max_model_len to {n + stage.max_new_tokens} or more, lower "
                                    "max_new_tokens, or offer fewer tools"))


def _tokenizer(spec, base_dir, resolve):
    """The tokenizer a run of `spec` renders prompts with (None: not at hand without building a model)."""
    path = spec.model.path
    if path == TINY:  # as runtime/model.py prepare_model builds it: built-in tasks' BPE, or a byte per token
        from rlflow.stages.tiny_model import tokenizer_for

        sources = [t.source for t in (spec.data.tasks or {}).values()] or [spec.data.source]
        builtin = sorted({s.removeprefix("builtin:") for s in sources if s.startswith("builtin:")})
        files = len(builtin) < len(sources)
        return tokenizer_for(None if files else "+".join(builtin), spec.seed)
    if path.startswith("builtin:"):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(resolve(path, base_dir)))


def _head_prompts(spec, base_dir, routes: dict, stage: str, resolve):
    """(where, prompt text, system prompt) of the head rows of each task that rollout `stage` serves."""
    from rlflow import registry
    from rlflow.data_head import HEAD_ROWS, head_rows
    from rlflow.data_sources import generated
    from rlflow.prompt_rows import prompt_text, row_prompt_answer
    from rlflow.schema import MAIN_TASK

    d = spec.data
    tasks = d.tasks or {MAIN_TASK: d}
    for name, t in tasks.items():
        if routes.get(name, {}).get("rollout") != stage:
            continue
        fields, fmt = (t.prompt_field, t.answer_field), t.prompt_format
        system = t.system_prompt
        if generated(t.source):
            rows = [(f"row {i + 1} of {t.source}", r)
                    for i, r in enumerate(registry.resolve("task", t.source)(seed=d.seed, count=HEAD_ROWS))]
        else:
            rows = head_rows(resolve(t.source, base_dir), fields, split=t.split, prompt_format=fmt)
        for where, row in rows:
            yield where, prompt_text(row_prompt_answer(row, fields, fmt)[0]), system
