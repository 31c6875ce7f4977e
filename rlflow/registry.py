"""Built-in components, one explicit dict per category; user code by `package.module:attr`.

Values are import strings, resolved lazily, so listing and checking names imports nothing heavy.
Third-party plugins register under the entry-point group `rlflow.<category>` (loaded on lookup,
never at import).
"""

from __future__ import annotations

import importlib
import re
from importlib.metadata import entry_points

ENGINES = {
    "hf": "rlflow.stages.engine_hf:HFEngine",
    "vllm": "rlflow.stages.engine_vllm:VLLMEngine",
}
REWARDS = {
    "exact_match": "rlflow.stages.rewards:exact_match",
    "numeric_close": "rlflow.stages.rewards:numeric_close",
    "countdown": "rlflow.stages.rewards:countdown",
    "final_number": "rlflow.stages.rewards:final_number",
    "code_tests": "rlflow.stages.rewards:code_tests",
    "tagged_number": "rlflow.stages.rewards:tagged_number",
    "agent_reward": "rlflow.stages.rewards:agent_reward",
}
FILTERS = {
    "drop_uniform_groups": "rlflow.stages.filters:drop_uniform_groups",
}
TASKS = {
    "builtin:arith": "rlflow.stages.tasks:arith",
    "builtin:repeat": "rlflow.stages.tasks:repeat",
    "builtin:countdown": "rlflow.stages.tasks:countdown",
    "builtin:word_problems": "rlflow.stages.tasks:word_problems",
    "builtin:code": "rlflow.stages.tasks:code",
    "builtin:calc": "rlflow.stages.tasks:calc",
}
# No `oracle`: it needs true lengths before generation, which only the simulator's synthetic lengths
# give (rlflow/graph.py rejects it by name); benchmarks use operators.length_ranker.OracleRanker directly.
RANKERS = {
    "learned": "rlflow.operators.length_ranker:OnlineLengthRanker",
}
MODELS = {
    "builtin:tiny-llama": "rlflow.stages.tiny_model:build_tiny_llama",
    "builtin:smollm2-135m": "rlflow.stages.smollm2:build_smollm2",  # needs the smollm2 extra (checked at compile)
}
# Reward models a reward stage's `model:` may name (docs/guides/reward-models.md): builders, built locally and cached.
REWARD_MODELS = {
    "builtin:tiny-reward": "rlflow.stages.reward_model:build_tiny_reward",
}

# Environments of multi-turn rollout stages (`env:`): classes that subclass rlflow.stages.environment.Environment.
ENVS = {
    "calculator": "rlflow.stages.env_calculator:Calculator",
    "python": "rlflow.stages.env_python:PythonTool",
}

# Environments, rewards and prompts written for other libraries, through an adapter: `<library>:package.module:attr`
# (e.g. env: "openenv:my_pkg.envs:GuessEnv", fn: "verifiers:my_pkg.tasks:load_taskset", data.source: the same).
# Each module's adapt(category, target) returns what the category needs (an env factory, a reward function, a task's
# row generator) or raises ComponentError.
ADAPTERS = {
    "verifiers": "rlflow.stages.env_verifiers",
    "openenv": "rlflow.stages.env_openenv",
}
ADAPTED = ("env", "reward", "task")  # the categories an adapter serves
AGENT_ADAPTERS = {"verifiers": "rlflow.stages.agent_verifiers"}  # agent: "<library>:package.module:attr"

CATEGORIES = {
    "engine": ENGINES,
    "reward": REWARDS,
    "filter": FILTERS,
    "task": TASKS,
    "ranker": RANKERS,
    "model": MODELS,
    "reward_model": REWARD_MODELS,
    "env": ENVS,
}

IMPORT_STRING = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


class ComponentError(LookupError):
    """A component reference that cannot be resolved or used; str() says why and how to fix it ('why; fix').

    `rule` names the rule it breaks (None: the caller's `unknown-<category>`).
    """

    def __init__(self, message: str, rule: str | None = None):
        super().__init__(message)
        self.rule = rule


def _plugins(category: str) -> dict:
    return {ep.name: ep for ep in entry_points(group=f"rlflow.{category}")}


def builtin_names(category: str) -> list[str]:
    return sorted(CATEGORIES[category])


def check_reference(category: str, ref: str, *, allow_import: bool = True) -> None:
    """Raise ComponentError unless `ref` is a built-in, a plugin, or an importable `module:attr` that fits
    the category (a reward's, filter's or ranker's signature, an env's base class: rlflow/user_code.py)."""
    builtins = CATEGORIES[category]
    if ref in builtins:
        return
    if adapter_target(category, ref):
        _adapt(category, ref)
        return
    if ":" in ref and allow_import and not ref.startswith("builtin:"):
        from rlflow.user_code import misfit

        why = misfit(category, ref, _import(ref))
        if why:
            raise ComponentError(why, f"not-a-{category}")
        return
    if ref in _plugins(category):
        return
    from rlflow.errors import did_you_mean

    names = ", ".join(builtin_names(category))
    how = f"use one of: {names}" + (", or an import string package.module:attr" if allow_import else "")
    raise ComponentError(f"unknown {category} '{ref}'{did_you_mean(ref, builtins)}; {how}")


def _import(ref: str):
    from rlflow.errors import did_you_mean

    if not IMPORT_STRING.match(ref):
        raise ComponentError(f"'{ref}' is not an import string; write package.module:attr (e.g. mypkg.rewards:exact)")
    from rlflow.user_code import not_found_help

    module_name, _, attr = ref.partition(":")
    try:
        obj = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and (module_name == e.name or module_name.startswith(e.name + ".")):
            raise ComponentError(f"cannot import module '{module_name}' ({e}); {not_found_help(module_name)}") from None
        raise ComponentError(f"importing '{module_name}' failed: {e} (a module it imports); install it, or fix the import",
                             "import-failed") from None
    except (Exception, SystemExit) as e:  # noqa: BLE001 - the user's module raised while importing: their bug, not rlflow's
        raise ComponentError(f"importing '{module_name}' failed: {type(e).__name__}: {e}; fix the module "
                             f"(run python -c 'import {module_name}' to see the traceback)", "import-failed") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ComponentError(f"module '{module_name}' has no attribute '{part}'{did_you_mean(part, dir(obj))}") from None
        obj = getattr(obj, part)
    return obj


def adapter_target(category: str, ref: str) -> str | None:
    """The `package.module:attr` an adapter reference `<library>:package.module:attr` names, or None when `ref`
    names no adapter of `category`."""
    library, _, target = ref.partition(":")
    return target if category in ADAPTED and library in ADAPTERS and ":" in target else None


def _adapt(category: str, ref: str):
    library, _, target = ref.partition(":")
    return importlib.import_module(ADAPTERS[library]).adapt(category, target)


def agent_fn(ref: str):
    """A rollout stage's `agent: fn`: the async function `package.module:fn` names, or what an adapter builds from
    `<library>:package.module:attr` (a verifiers environment: stages/agent_verifiers.py)."""
    library, _, target = ref.partition(":")
    if library in AGENT_ADAPTERS and ":" in target:
        return importlib.import_module(AGENT_ADAPTERS[library]).adapt(target)
    return _import(ref)


def resolve(category: str, ref: str):
    """The object a reference names (imports it)."""
    builtins = CATEGORIES[category]
    if ref in builtins:
        return _import(builtins[ref])
    if adapter_target(category, ref):
        return _adapt(category, ref)
    plugins = _plugins(category)
    if ref in plugins:
        return plugins[ref].load()
    check_reference(category, ref)
    return _import(ref)
