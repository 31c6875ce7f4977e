"""Compile-time rules of chat-form tool calling (a rollout stage's `tools:` and `tool_parser:`,
rlflow/runtime/chat_episodes.py): every tool loads and has a valid schema, the parser is known, the stage can reach a
second turn, and the model has a chat template to render tool messages with."""

from __future__ import annotations

from rlflow.errors import Problem

TINY = "builtin:tiny-llama"  # no template of its own: chat-form stages render it with stages/chat_template.py's


def check_tool_stage(stage, loc: tuple, problems: list[Problem]) -> None:
    """The tool settings of one rollout stage."""
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
    if stage.tool_parser is None:
        problems.append(Problem(loc + ("tool_parser",), "tools are set but not the model's tool-call format",
                                "tools-need-parser", f"set tool_parser: one of {', '.join(PARSERS)} (hermes: Qwen, "
                                "Hermes, SmolLM2; json: Llama 3.1-style function-call JSON)"))
    elif stage.tool_parser not in PARSERS:
        problems.append(Problem(loc + ("tool_parser",), f"unknown tool_parser '{stage.tool_parser}'", "unknown-tool-parser",
                                f"use one of: {', '.join(PARSERS)}"))
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
