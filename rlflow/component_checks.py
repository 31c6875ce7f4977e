"""What a pipeline names outside itself, checked at compile: components (engines, rewards, filters,
rankers, the model), files (data, DeepSpeed configs, cost-model profiles) and the model's length limit.

Import strings are checked with the pipeline's directory and the working directory on sys.path
(rlflow/user_code.py), and a reward, filter or ranker they name must fit its call signature.
"""

from __future__ import annotations

import inspect
import json
import re
from pathlib import Path

from rlflow import registry
from rlflow.data_head import head_problem
from rlflow.data_sources import generated, is_table
from rlflow.errors import Problem
from rlflow.reward_scorers import check_reward_stage
from rlflow.schema import DATA_NODE, AgentSpec, Pipeline
from rlflow.stages.model_positions import model_positions
from rlflow.tool_checks import (
    check_parser_fits,
    check_tool_stage,
    check_tools_prompt_room,
    check_tools_template,
    model_tool_format,
)

DATA_SUFFIXES = (".jsonl", ".json", ".parquet", ".arrow")  # or a `datasets` directory
TASK_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


def stages_of(spec: Pipeline, kind: str) -> list[str]:
    return [n for n, s in spec.stages.items() if s.kind == kind]


def component(problems: list[Problem], category: str, ref: str, loc: tuple) -> None:
    """A problem unless `ref` names a `category` that exists and fits (rule from the error, else unknown-<category>)."""
    try:
        registry.check_reference(category, ref)
    except registry.ComponentError as err:
        why, _, fix = str(err).partition("; ")
        problems.append(Problem(loc, why, err.rule or f"unknown-{category}", fix))


#: where rlflow's own configs/ lives: inside the installed package (a wheel ships the repo's configs/ as
#: rlflow/configs, pyproject package-dir), or beside the package in a source checkout (editable install)
SHIPPED_CONFIGS = (Path(__file__).resolve().parent / "configs", Path(__file__).resolve().parents[1] / "configs")


def resolve_path(ref: str, base_dir: Path) -> Path | None:
    """A file reference relative to the pipeline's directory or one of its parents, else the working dir, else
    (for `configs/...`) the configs shipped with rlflow.

    So `configs/deepspeed/zero1.json` works from pipelines/ in the repo, from any working dir, and for a pipeline
    anywhere with rlflow installed from a wheel; a configs/ folder of the user's own, beside the pipeline, wins.
    """
    for candidate in (*(d / ref for d in (base_dir, *base_dir.parents)), Path.cwd() / ref, *_shipped(ref)):
        if candidate.exists():
            return candidate.resolve()
    return None


def _shipped(ref: str) -> list[Path]:
    first, *rest = Path(ref).parts or ("",)
    if first != "configs" or not rest or ".." in rest:
        return []
    # a source checkout's configs/ counts only beside its pyproject.toml (not any site-packages/configs)
    roots = [r for r in SHIPPED_CONFIGS if r.parent.name == "rlflow" or (r.parent / "pyproject.toml").exists()]
    return [r.joinpath(*rest) for r in roots]


def _check_episodes(stage, loc: tuple, problems: list[Problem], model_format: tuple[str, str] | None = None) -> None:
    """Multi-turn settings of a rollout stage (rlflow/runtime/episodes.py): an environment, reached by stop strings;
    or tools in chat form (rlflow/tool_checks.py). `model_format`: the tool-call format the local model's chat
    template names (tool_checks.model_tool_format)."""
    if stage.agent is not None:
        _check_agent(stage, loc, problems, model_format)
        return
    check_tool_stage(stage, loc, problems, model_format)
    if stage.env is None and stage.tools:
        _check_turn_budget(stage, loc, problems)
        return
    if stage.env is None:
        if stage.max_turns > 1 or stage.max_turn_tokens is not None or stage.env_kwargs:
            field = "max_turns" if stage.max_turns > 1 else "max_turn_tokens" if stage.max_turn_tokens else "env_kwargs"
            problems.append(Problem(loc + (field,), f"{field} is set but the stage has no environment", "turns-need-env",
                                    "name one with env: (calculator, python or package.module:Class), or remove "
                                    f"{field}"))
        return
    before = len(problems)
    component(problems, "env", stage.env, loc + ("env",))
    if len(problems) == before:  # a valid reference: its constructor must take env_kwargs (made once per episode)
        try:
            registry.resolve("env", stage.env)(**stage.env_kwargs)
        except Exception as e:  # noqa: BLE001 - any constructor failure is the user's input to report
            problems.append(Problem(loc + ("env_kwargs",), f"env '{stage.env}' rejects env_kwargs {stage.env_kwargs}: "
                                    f"{type(e).__name__}: {e}", "bad-env-kwargs",
                                    "pass the keyword arguments its constructor takes (see its docstring)"))
    if not stage.stop:
        problems.append(Problem(loc + ("stop",), f"env '{stage.env}' is never called: a turn goes to the environment "
                                "when it ends at one of the stage's stop strings, and there are none", "env-needs-stop",
                                "add the tool call's closing tag, e.g. stop: [\"</calc>\"] for the calculator"))
    if stage.max_turns < 2:
        problems.append(Problem(loc + ("max_turns",), f"env '{stage.env}' with max_turns {stage.max_turns}: the episode "
                                "ends before the environment's observation is ever read", "env-needs-turns",
                                "set max_turns to 2 or more (a tool call and the answer after it)"))
    _check_turn_budget(stage, loc, problems)


def _check_agent(stage, loc: tuple, problems: list[Problem], model_format: tuple[str, str] | None = None) -> None:
    """An agent stage (rlflow/runtime/agent_gateway.py): an async function or a command found here, and nothing that
    would drive the conversation besides it."""
    import inspect
    import shutil

    from rlflow.stages.tool_parsers import PARSERS

    loc = loc + ("agent",)
    spec = AgentSpec.entry(stage.agent)
    if stage.env is not None or stage.tools:
        problems.append(Problem(loc, "agent and " + ("env" if stage.env is not None else "tools") + " are both set: the "
                                "agent's program drives the conversation (its tools run in the agent)",
                                "agent-with-env-or-tools", "keep the agent, or the env / tools, not both"))
    if ("fn" in spec) == ("command" in spec):
        problems.append(Problem(loc, "an agent is a function (fn) or a command, one of them", "bad-agent",
                                "agent: package.module:function, or agent: {command: [python, my_agent.py]}"))
        return
    if "command" in spec:
        if shutil.which(spec["command"][0]) is None:
            problems.append(Problem(loc + ("command",), f"the agent's program {spec['command'][0]!r} is not found on PATH",
                                    "agent-command-not-found", "give its full path, or install it"))
    else:
        try:
            fn = registry.agent_fn(spec["fn"])
        except registry.ComponentError as e:
            problems.append(Problem(loc, f"agent {spec['fn']!r}: {e}", e.rule or "bad-agent", "name an async function "
                                    "package.module:function importable beside the pipeline, or a verifiers "
                                    "environment: verifiers:package.module:load_taskset"))
            return
        call = type(fn).__call__ if callable(fn) and not inspect.isroutine(fn) else fn  # an adapter's agent object
        if not inspect.iscoroutinefunction(call):
            problems.append(Problem(loc, f"agent {spec['fn']!r} is not an async function: many episodes run at once on "
                                    "one event loop, and a blocking call would stall them all", "agent-not-async",
                                    "write it as async def fn(row, base_url, episode_id) with openai.AsyncOpenAI, or "
                                    "run it as a command: agent: {command: [...]}"))
    if stage.tool_parser is not None and stage.tool_parser not in PARSERS:
        problems.append(Problem(loc[:-1] + ("tool_parser",), f"unknown tool_parser {stage.tool_parser!r}", "bad-tool-parser",
                                f"use one of {', '.join(PARSERS)}"))
    check_parser_fits(stage.tool_parser, loc[:-1], problems, model_format)
    _check_turn_budget(stage, loc[:-1], problems)


def _check_turn_budget(stage, loc: tuple, problems: list[Problem]) -> None:
    if stage.max_turn_tokens is not None and stage.max_turn_tokens > stage.max_new_tokens:
        problems.append(Problem(loc + ("max_turn_tokens",), f"max_turn_tokens {stage.max_turn_tokens} exceeds "
                                f"max_new_tokens {stage.max_new_tokens}, the whole episode's budget",
                                "turn-over-episode", "lower max_turn_tokens or raise max_new_tokens"))


def _check_overlong(spec: Pipeline, stage, loc: tuple, problems: list[Problem]) -> None:
    """DAPO's overlong shaping against the generation budget: 0 < cache_tokens < max_tokens <= max_new_tokens."""
    shaping = stage.overlong
    budget = max((spec.stages[r].max_new_tokens for r in stages_of(spec, "rollout")), default=None)
    if shaping is None or budget is None:
        return
    if shaping.max_tokens is not None and shaping.max_tokens > budget:
        problems.append(Problem(loc + ("overlong", "max_tokens"), f"overlong.max_tokens {shaping.max_tokens} exceeds "
                                f"max_new_tokens {budget}: completions are cut off before it, so the full penalty never "
                                "applies", "overlong-beyond-budget", "lower it, or leave it unset (max_new_tokens)"))
        return
    limit = shaping.max_tokens or budget
    if shaping.cache_tokens >= limit:
        what = "overlong.max_tokens" if shaping.max_tokens else "max_new_tokens"
        problems.append(Problem(loc + ("overlong", "cache_tokens"), f"overlong.cache_tokens {shaping.cache_tokens} is not "
                                f"below {what} {limit}: the expected length {what} - cache_tokens would be 0 or less, so "
                                "every completion would be punished", "overlong-cache-too-long",
                                f"set cache_tokens below {limit} (DAPO: a fifth of it), or raise {what}"))


def _check_lora(spec: Pipeline, stage, deepspeed: dict | None, loc: tuple, problems: list[Problem]) -> None:
    """train.lora needs engines that apply adapters, which they say by taking a `lora` argument (hf copies them in
    place, vllm serves each version as a LoRA adapter), and ZeRO 0-2 (the adapters are injected after the model is
    built, outside ZeRO-3's partitioning)."""
    if stage.lora is None:
        return
    for name in stages_of(spec, "rollout"):
        engine = spec.stages[name].engine
        if not _takes_lora(engine):
            problems.append(Problem(("stages", name, "engine"), f"rollout '{name}' uses engine '{engine}', which does not "
                                    "apply LoRA adapters: a version of a train.lora run carries only the adapters",
                                    "lora-needs-lora-engine", "use engine: hf or vllm, or remove train.lora (full fine-tuning)"))
    stage_of_zero = ((deepspeed or {}).get("zero_optimization") or {}).get("stage", 0)
    if stage_of_zero == 3:
        problems.append(Problem(loc + ("lora",), f"train.lora with ZeRO-3 ('{stage.deepspeed}'): the adapters are "
                                "injected outside ZeRO-3's partitioning", "lora-needs-unpartitioned-base",
                                "use configs/deepspeed/zero1.json (the base is frozen: its optimizer state is the adapters')"))


def _takes_lora(engine: str) -> bool:
    """Whether an engine's constructor takes `lora` (an engine that cannot be resolved is named by its own rule)."""
    try:
        cls = registry.resolve("engine", engine)
    except Exception:  # noqa: BLE001 - unknown-engine and friends say what is wrong with it
        return True
    return "lora" in inspect.signature(cls).parameters


def check_components(spec: Pipeline, base_dir: Path, problems: list[Problem]) -> None:
    rollouts = stages_of(spec, "rollout")
    chat = any(spec.stages[n].tools or spec.stages[n].agent is not None for n in rollouts)
    model_format = model_tool_format(spec, base_dir, resolve_path) if chat else None
    for name, stage in spec.stages.items():
        loc = ("stages", name)
        if stage.kind == "rollout":
            component(problems, "engine", stage.engine, loc + ("engine",))
            if stage.max_new_tokens >= spec.model.max_model_len:
                problems.append(Problem(loc + ("max_new_tokens",), f"max_new_tokens {stage.max_new_tokens} leaves no room for the prompt in model.max_model_len {spec.model.max_model_len}",
                                        "no-room-for-prompt", "lower max_new_tokens or raise model.max_model_len"))
            _check_episodes(stage, loc, problems, model_format)
            if stage.agent is not None and spec.data.eval is not None:
                problems.append(Problem(("data", "eval"), f"rollout stage {name} runs an agent, and evaluating agent "
                                        "episodes is not built yet (the evaluator has no endpoint)", "agent-eval-not-built",
                                        "remove data.eval; judge the agent by its training rewards in MLflow"))
        elif stage.kind == "reward":  # fn, model, judge, http or scorers (rlflow/reward_scorers.py)
            check_reward_stage(spec, name, stage, base_dir, problems, component, resolve_path)
        elif stage.kind == "train":
            path = resolve_path(stage.deepspeed, base_dir)
            if path is None:
                problems.append(Problem(loc + ("deepspeed",), f"no such DeepSpeed config '{stage.deepspeed}'", "missing-file",
                                        "use one of configs/deepspeed/*.json"))
            else:
                config = _read_json(path, stage.deepspeed, loc + ("deepspeed",), problems)
                _check_lora(spec, stage, config, loc, problems)
            _check_overlong(spec, stage, loc, problems)
            if stage.distill is not None:
                from rlflow.distill_checks import check_teacher

                check_teacher(spec, stage.distill.teacher, loc + ("distill", "teacher"), base_dir, problems, resolve_path)
    for name in rollouts[1:]:  # the trainer recomputes the behaviour log-probs at one temperature
        first, t = rollouts[0], spec.stages[name].temperature
        if t != spec.stages[first].temperature:
            problems.append(Problem(("stages", name, "temperature"), f"rollout '{name}' samples at temperature {t:g} but '{first}' at "
                                    f"{spec.stages[first].temperature:g}; the trainer recomputes log-probs at one temperature",
                                    "temperatures-differ", "use one temperature in every rollout stage"))
    mp = spec.model.path
    if mp.startswith("builtin:"):
        component(problems, "model", mp, ("model", "path"))
        _check_builtin_installed(mp, problems)
        positions, template = _builtin_positions(mp), BUILTIN_CHAT_TEMPLATES.get(mp, False)
    else:
        path = resolve_path(mp, base_dir)
        if path is None or not (path / "config.json").exists():
            problems.append(Problem(("model", "path"), f"'{mp}' is not a local Hugging Face model directory (no config.json)",
                                    "bad-model-path", "use builtin:tiny-llama, or a directory saved with save_pretrained"))
            return
        config = _read_json(path / "config.json", f"{mp}/config.json", ("model", "path"), problems)
        positions, template = model_positions(config), has_chat_template(path)
    _check_model_len(spec, positions, problems)
    _check_chat_template(spec, template, problems)
    check_tools_template(spec, template, problems)
    check_tools_prompt_room(spec, base_dir, problems, resolve_path)


#: whether a built-in model's tokenizer has a chat template (known without building it)
BUILTIN_CHAT_TEMPLATES = {"builtin:tiny-llama": False, "builtin:smollm2-135m": True}
#: files of a saved tokenizer that hold its chat template (transformers 5 writes the .jinja; 4 the config key)
CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")


def has_chat_template(model_dir: Path) -> bool:
    """Whether a local model directory's tokenizer has a chat template (tokenizer_config.json's `chat_template`,
    or a chat_template.jinja / .json beside it)."""
    if any((model_dir / f).is_file() for f in CHAT_TEMPLATE_FILES):
        return True
    try:
        config = json.loads((model_dir / "tokenizer_config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(config, dict) and bool(config.get("chat_template"))


def _prompt_formats(spec: Pipeline) -> list[tuple[tuple, str, str | None]]:
    """(YAML path, prompt_format, system_prompt) of each task type."""
    d = spec.data
    if d.tasks is None:
        return [(("data",), d.prompt_format, d.system_prompt)]
    return [(("data", "tasks", name), t.prompt_format, t.system_prompt) for name, t in d.tasks.items()]


def _check_chat_template(spec: Pipeline, template: bool, problems: list[Problem]) -> None:
    """prompt_format chat needs a tokenizer with a chat template; a system prompt needs prompt_format chat."""
    for loc, fmt, system in _prompt_formats(spec):
        if fmt in ("chat", "messages") and not template:
            problems.append(Problem(loc + ("prompt_format",), f"prompt_format {fmt}, but the tokenizer of model '{spec.model.path}' "
                                    "has no chat template", "no-chat-template",
                                    "use prompt_format: raw, or a model whose tokenizer has one (e.g. builtin:smollm2-135m)"))
        if system is not None and fmt == "raw":
            problems.append(Problem(loc + ("system_prompt",), "a system prompt is a chat message; with prompt_format raw it "
                                    "would be ignored", "system-prompt-needs-chat",
                                    "set prompt_format: chat, or put the instruction into the prompt text"))


def _check_builtin_installed(ref: str, problems: list[Problem]) -> None:
    """A built-in model whose weights come from an optional package needs that package (nothing is downloaded)."""
    if ref != "builtin:smollm2-135m":
        return
    from rlflow.stages import smollm2

    gone = smollm2.missing()
    if gone:
        problems.append(Problem(("model", "path"), f"{ref} converts SmolLM2-135M-Instruct from the {smollm2.PACKAGE} package, "
                                f"but {', '.join(gone)} {'is' if len(gone) == 1 else 'are'} not installed",
                                "model-not-installed", smollm2.install_hint()))


def _builtin_positions(ref: str) -> tuple[int, str] | None:
    """The positions of a built-in model, from its build settings (nothing is built)."""
    if ref == "builtin:smollm2-135m":
        from rlflow.stages.smollm2 import MAX_POSITIONS

        return MAX_POSITIONS, "max_position_embeddings"
    if ref != "builtin:tiny-llama":
        return None
    from rlflow.stages.tiny_model import DEFAULT_SETTINGS, TASK_SETTINGS

    return min(s.max_position_embeddings for s in (DEFAULT_SETTINGS, *TASK_SETTINGS.values())), "max_position_embeddings"


def _check_model_len(spec: Pipeline, positions: tuple[int, str] | None, problems: list[Problem]) -> None:
    """model.max_model_len within the model's positions (an engine refuses a longer one when the run starts)."""
    if positions is None or spec.model.max_model_len <= positions[0]:
        return
    limit, key = positions
    given = "" if "max_model_len" in spec.model.model_fields_set else " (the default)"
    problems.append(Problem(("model", "max_model_len"), f"max_model_len {spec.model.max_model_len}{given} is longer than the "
                            f"{limit} positions of model '{spec.model.path}' ({key} in its config)", "max-model-len-too-long",
                            f"set model.max_model_len: {limit} (the model's own limit) or lower"))


def _read_json(path: Path, ref: str, loc: tuple, problems: list[Problem]):
    """The parsed file, or None with a bad-json problem."""
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        problems.append(Problem(loc, f"'{ref}' is not valid JSON ({err})", "bad-json", "fix the file"))
        return None



# --------------------------------------------------------------------------- data and task types


def check_data(spec: Pipeline, base_dir: Path, problems: list[Problem]) -> None:
    d = spec.data
    if d.source is not None and d.tasks is not None:
        problems.append(Problem(("data",), "data sets both source and tasks", "data-source-or-tasks",
                                "keep source for one task type, or list every source under tasks: {<name>: {source: ...}}"))
    elif d.source is None and d.tasks is None:
        problems.append(Problem(("data",), "data has neither source nor tasks", "data-source-or-tasks",
                                "set data.source: builtin:arith, or data.tasks: {<name>: {source: ...}, ...}"))
    if d.source is not None:
        _check_source(d.source, ("data", "source"), base_dir, problems, (d.prompt_field, d.answer_field), d.split,
                      d.prompt_format)
    for name, task in (d.tasks or {}).items():
        if not TASK_NAME.match(name):
            problems.append(Problem(("data", "tasks", name), f"task name '{name}' has characters not allowed (it names metrics and operators)",
                                    "bad-task-name", "use letters, digits and _.- (starting with a letter or digit)"))
        _check_source(task.source, ("data", "tasks", name, "source"), base_dir, problems, (task.prompt_field, task.answer_field),
                      task.split, task.prompt_format)
    if isinstance(d.eval, float) and not 0 < d.eval <= 0.5:
        problems.append(Problem(("data", "eval"), f"a held-out fraction must be in (0, 0.5], got {d.eval:g}", "bad-eval",
                                "data.eval: 0.1 holds out 10% of the rows (the rest is trained on)"))
    if isinstance(d.eval, str):
        if d.tasks is not None:
            problems.append(Problem(("data", "eval"), "a file of held-out prompts has one task's rows, but data sets several tasks",
                                    "eval-file-with-tasks", "use a fraction (data.eval: 0.1 holds out 10% of every task's rows)"))
        elif d.eval.startswith("builtin:") or not d.eval.endswith(DATA_SUFFIXES):
            problems.append(Problem(("data", "eval"), f"'{d.eval}' is neither a fraction in (0, 0.5] nor a .jsonl/.json/.parquet file",
                                    "bad-eval", "data.eval: 0.1 holds out 10% of the source's rows; or give a file of prompts"))
        else:
            _check_source(d.eval, ("data", "eval"), base_dir, problems, (d.prompt_field, d.answer_field),
                          prompt_format=d.prompt_format)
    if d.tasks is not None:
        for field in ("limit", "prompt_field", "answer_field", "prompt_format", "system_prompt", "split"):
            if field in d.model_fields_set:
                problems.append(Problem(("data", field), f"data.{field} applies to data.source; with data.tasks each task has its own",
                                        "task-field-on-data", f"move it into each task: data.tasks.<name>.{field}"))


def _check_source(src: str, loc: tuple, base_dir: Path, problems: list[Problem], fields: tuple[str, str],
                  split: str | None = None, prompt_format: str = "raw") -> None:
    """A builtin task that exists, or a prompt file (or `datasets` directory: rlflow/data_sources.py) that exists and
    whose first rows have both `fields`."""
    path = None if generated(src) else resolve_path(src, base_dir)
    if generated(src):  # builtin:<task>, or a taskset through an adapter (verifiers:...): its first rows checked
        before = len(problems)
        component(problems, "task", src, loc)
        if len(problems) == before and not src.startswith("builtin:") and (
                problem := head_problem(src, fields, name=src, prompt_format=prompt_format)):
            problems.append(Problem(loc, *problem))
    elif path is None and (src.endswith(DATA_SUFFIXES) or not Path(src).suffix):
        problems.append(Problem(loc, f"no such data file '{src}'", "missing-file", "check the path (relative to the pipeline file)"))
    elif not (src.endswith(DATA_SUFFIXES) or (path is not None and path.is_dir())):
        problems.append(Problem(loc, f"'{src}' is neither builtin:<task> nor a .jsonl/.json/.parquet file (nor "
                                ".arrow, nor a `datasets` directory)", "bad-data-source",
                                "builtin tasks: " + ", ".join(registry.builtin_names("task"))))
    elif problem := head_problem(path, fields, name=src, split=split, prompt_format=prompt_format):
        problems.append(Problem(loc, *problem))
    if split is not None and (generated(src) or (path is not None and not is_table(path))):
        problems.append(Problem(loc[:-1] + ("split",), f"split {split!r} names a split of a `datasets` directory, but "
                                f"'{src}' is not one", "bad-split", "remove split"))


# --------------------------------------------------------------------------- cost-model profiles


def _profile_users(spec: Pipeline, name: str) -> list[str]:
    """What in rollout stage `name`'s coordination decides by the cost-model profile."""
    c = spec.stages[name].coordinator
    users = ["cost_model routing"] if c.routing == "cost_model" else []
    if c.migration != "none":
        users.append(f"{c.migration} migration")
    if any(e.from_ == DATA_NODE and e.to == name and e.policy.kind == "skew_aware_dispatch" for e in spec.edges):
        users.append("skew-aware dispatch")  # weighs predicted lengths by the profile's per-token latency
    return users


def _same_model(profile_model, path: str) -> bool:
    return profile_model == path or (not path.startswith("builtin:") and profile_model == Path(path).name)


def check_profiles(spec: Pipeline, base_dir: Path, problems: list[Problem]) -> None:
    """A profile where coordination needs one, measured on this stage's engine and the pipeline's model."""
    model = spec.model.path
    for name in stages_of(spec, "rollout"):
        stage, loc = spec.stages[name], ("stages", name, "coordinator", "profile")
        prof, users = stage.coordinator.profile, _profile_users(spec, name)
        measure = f"`rlflow profile --engine {stage.engine} --model {model} -o configs/profiles/<name>.json`"
        path = resolve_path(prof, base_dir) if prof is not None else None
        if prof is not None and path is None:
            problems.append(Problem(loc, f"no such profile file '{prof}'", "missing-file",
                                    f"see configs/profiles/, or measure one with {measure}"))
        if not users or (prof is not None and path is None):
            continue
        if prof is None:
            rule = ("routing-needs-profile" if users[0].endswith("routing") else
                    "migration-needs-profile" if users[0].endswith("migration") else "dispatch-needs-profile")
            also = f" (so do{'es' * (len(users) == 2)} {' and '.join(users[1:])})" if len(users) > 1 else ""
            problems.append(Problem(loc, f"{users[0]} needs a cost-model profile{also}", rule,
                                    f"set profile: configs/profiles/<engine>.json (measure one with {measure})"))
            continue
        raw = _read_json(path, prof, loc, problems)
        if raw is None or stage.coordinator.allow_foreign_profile:
            continue
        engine, measured = (raw.get("engine"), raw.get("model")) if isinstance(raw, dict) else (None, None)
        if engine == stage.engine and _same_model(measured, model):
            continue
        said = (f"was measured on engine '{engine}' with model '{measured}'" if engine is not None and measured is not None
                else 'does not say which engine and model it was measured on (no "engine" / "model" keys)')
        problems.append(Problem(loc, f"profile '{prof}' {said}, but rollout '{name}' runs engine '{stage.engine}' with model '{model}': "
                                f"its {' and '.join(users)} would decide by speeds measured elsewhere", "profile-mismatch",
                                f"measure one with {measure}, or set stages.{name}.coordinator.allow_foreign_profile: true"))
