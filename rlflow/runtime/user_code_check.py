"""User code checked again as a run starts, before Ray does: a module the plan names (a reward, filter, ranker,
environment, tool, engine or taskset) may have been edited since `rlflow compile` checked it. One that no longer
imports (a syntax or import error) or no longer fits its call (a signature) is rule `user-code-error`: exit 2 with one
line naming the file and line, instead of a traceback from the driver or an actor minutes later.

The same break found mid-run (a reward process started again imports the module anew) stops the run by name after a
checkpoint, exit 3 (reward_stream.py Score).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

from rlflow.errors import Problem
from rlflow.plan_model import Plan

RULE = "user-code-error"


def references(pipeline: dict) -> Iterator[tuple[tuple, str, object]]:
    """(YAML path, category, reference) of every component the resolved pipeline names; 'tool' entries are a tools:
    item (an import string or a schema dict with fn)."""
    for name, stage in (pipeline.get("stages") or {}).items():
        loc = ("stages", name)
        if stage.get("kind") == "reward":
            for field in ("fn", "eval_fn"):
                if stage.get(field):
                    yield loc + (field,), "reward", stage[field]
            for i, part in enumerate(stage.get("scorers") or []):
                if part.get("fn"):
                    yield loc + ("scorers", i, "fn"), "reward", part["fn"]
        elif stage.get("kind") == "rollout":
            if stage.get("engine"):
                yield loc + ("engine",), "engine", stage["engine"]
            if stage.get("env"):
                yield loc + ("env",), "env", stage["env"]
            for i, entry in enumerate(stage.get("tools") or []):
                yield loc + ("tools", i), "tool", entry
    for i, edge in enumerate(pipeline.get("edges") or []):
        for field in ("filter", "ranker"):
            if (edge.get("policy") or {}).get(field):
                yield ("edges", i, "policy", field), field, edge["policy"][field]
    data = pipeline.get("data") or {}
    sources = [(("data", "source"), data.get("source"))]
    sources += [(("data", "tasks", n, "source"), t.get("source")) for n, t in (data.get("tasks") or {}).items()]
    for loc, src in sources:
        if isinstance(src, str) and ":" in src and not src.startswith("builtin:"):
            yield loc, "task", src


def _is_user_code(ref) -> bool:
    """Only import strings are user code (built-in names and plugins were fixed at install)."""
    return isinstance(ref, str) and ":" in ref and not ref.startswith("builtin:")


@contextlib.contextmanager
def _on_path(dirs: list[str]):
    """The plan's python_path in front of sys.path while checking, as the driver and the workers will have it."""
    added = [d for d in dirs if d not in sys.path]
    sys.path[:0] = added
    try:
        yield
    finally:
        for d in added:
            with contextlib.suppress(ValueError):
                sys.path.remove(d)


def check(plan: Plan) -> list[Problem]:
    """A `user-code-error` problem for each component of `plan` whose user code no longer loads or fits."""
    import importlib

    from rlflow import registry
    from rlflow.stages.tools import ToolError, resolve_callable
    from rlflow.user_code import described

    problems = []
    with _on_path(list(plan.python_path)):
        importlib.invalidate_caches()  # a module file written since this process last looked is found
        for loc, category, ref in references(plan.raw.get("pipeline") or {}):
            if isinstance(ref, dict):  # a tool's schema dict: its fn is the code
                ref = ref.get("fn")
            if not _is_user_code(ref):
                continue
            try:
                if category == "tool":
                    resolve_callable(ref)
                else:
                    registry.check_reference(category, ref)
            except (registry.ComponentError, ToolError) as err:
                fix = getattr(err, "fix", "") or str(err).partition("; ")[2]
                problems.append(Problem(loc, described(err, ref), RULE,
                                        (f"{fix}; " if fix else "") + "it changed since `rlflow compile` checked it"))
    return problems
