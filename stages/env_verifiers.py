"""`verifiers` environments' rubrics as rewards and their tasksets as prompts: `verifiers:package.module:load_taskset`
as a reward stage's `fn`, or as `data.source`.

A verifiers (v1, >= 0.4) environment is a Taskset (rows -> typed Tasks) plus the agents that play it. A Task scores
a finished rollout's Trace with its `@vf.reward` methods and plugged judges, each weighted: that is its rubric.
The adapter builds the Task for an rlflow row (the TaskData fields the row has, by name: `prompt`, `answer`, ...),
wraps the completion as a one-turn Trace (the prompt as the user message, the completion as the sampled assistant
reply) and returns `trace.reward`, the weighted sum verifiers itself reports. Rewards that need a sandbox runtime
are skipped, as verifiers skips them when scoring offline.

As `data.source`, the taskset's tasks are the rows, in its order: each TaskData's fields (`prompt`: its text, or the
chat as a list of {role, content} for prompt_format messages; `answer` and the other fields its type declares), the
runtime plumbing (image, resources, timeouts, ...) left out. The reward then rebuilds the very Task from its row.

The target is a Taskset, a Taskset class, a verifiers Env (its `.taskset`), or a function returning one of these
(a package's `load_taskset` / `load_environment`).

A verifiers environment is not a rollout `env:`: its episodes drive the model themselves through an
OpenAI-compatible client, where an rlflow `env` is stepped by the rollout engine turn by turn; compile says so by
name (verifiers-env-not-steppable) and points at `agent: "verifiers:..."`, which runs its episodes as verifiers
writes them against rlflow's endpoint (stages/agent_verifiers.py).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import threading

INSTALL = "pip install verifiers (or rlflow's `ecosystem` extra: pip install 'rlflow[ecosystem]')"
#: TaskData fields about running a task in a sandbox, not about the prompt: left out of the rows
PLUMBING = {"image", "workdir", "agent_user", "skills", "network_allow", "network_block", "artifacts",
            "artifact_max_bytes", "timeout", "resources"}


def adapt(category: str, target: str):
    """The reward function for a `verifiers:` reference (registry.ADAPTERS); ComponentError when it cannot be one."""
    from rlflow.registry import ComponentError

    if category == "env":
        raise ComponentError(f"'verifiers:{target}' cannot be a rollout env: a verifiers environment drives the model "
                             "itself (Env.run calls its agents through an OpenAI-compatible client), so it cannot be "
                             "stepped turn by turn; score with its rubric instead (a reward stage with fn: "
                             f"\"verifiers:{target}\"), run its episodes as verifiers does with agent: "
                             f"\"verifiers:{target}\" instead of env, or give the stage an rlflow env",
                             "verifiers-env-not-steppable")
    taskset(target)  # imports it and checks its type now: compile names the problem
    return functools.partial(taskset_rows, target) if category == "task" else VerifiersReward(target)


def taskset_rows(target: str, seed: int = 0, count: int | None = None) -> list[dict]:
    """The first `count` tasks of the taskset as rows (its own order: the prompt stream shuffles them with `seed`)."""
    rows = []
    for task in itertools.islice(iter(taskset(target)), count):
        row = task.data.model_dump(mode="json", exclude_none=True, exclude=PLUMBING)
        if not isinstance(task.data.prompt, str) and task.data.prompt is not None:  # a chat
            row["prompt"] = [{"role": m["role"], "content": m.get("content") or ""} for m in row["prompt"]]
        rows.append(row)
    return rows


@functools.cache
def taskset(target: str):
    """The Taskset a target names, loaded once per process."""
    from rlflow.registry import ComponentError, _import

    try:
        import verifiers.v1 as vf
    except ImportError:
        raise ComponentError(f"'verifiers:{target}' needs the verifiers package, which is not installed; {INSTALL}",
                             "missing-package") from None
    obj = _import(target)
    if isinstance(obj, type) and issubclass(obj, vf.Taskset):
        obj = obj(obj.config_type()() if hasattr(obj, "config_type") else vf.TasksetConfig())
    elif callable(obj) and not isinstance(obj, (vf.Taskset, vf.Env)):
        try:
            obj = obj()
        except Exception as e:  # noqa: BLE001 - the user's loader failed: say so by name
            raise ComponentError(f"'{target}' raised {type(e).__name__}: {e} when called with no arguments; make it "
                                 "load its taskset with defaults", "import-failed") from None
    obj = getattr(obj, "taskset", obj)  # a vf.Env: its seed taskset
    if not isinstance(obj, vf.Taskset):
        raise ComponentError(f"'{target}' gives a {type(obj).__name__}, not a verifiers Taskset or Env; point at a "
                             "Taskset, its class, or a load_taskset / load_environment function", "not-a-reward")
    return obj


class VerifiersReward:
    """fn(completion, answer, prompt, row) -> the Task's weighted reward for the completion (picklable: it holds the
    target and loads the taskset where it runs)."""

    def __init__(self, target: str):
        self.target = target
        self.__name__ = f"verifiers:{target}"

    def __call__(self, completion: str, answer: str, prompt: str, row: dict) -> float:
        task = task_for(self.target, row, prompt=prompt, answer=answer)
        trace = one_turn_trace(task, completion)
        _run(task.score(trace))
        if not trace.rewards:
            raise ValueError(f"{type(task).__name__} has no reward that scores without a runtime")
        return trace.reward


def task_for(target: str, row: dict | None, **defaults):
    """The taskset's Task for an rlflow row: the TaskData fields the row has, by name (`defaults` fill the ones it
    lacks, where the Task's data declares them)."""
    ts = taskset(target)
    task_cls = type(ts).task_type()
    data_cls = task_cls.data_type()
    fields = {k: v for k, v in (row or {}).items() if k in data_cls.model_fields and k != "idx"}
    for k, v in defaults.items():
        if k in data_cls.model_fields or k == "prompt":
            fields.setdefault(k, v)
    return task_cls(data_cls(**fields), ts.config.task)


def one_turn_trace(task, completion: str):
    """A Trace of one turn: the task's prompt as the user message, `completion` as the sampled reply."""
    import verifiers.v1 as vf
    from verifiers.v1.graph import MessageNode
    from verifiers.v1.trace import TraceTask

    prompt = task.data.prompt
    messages = [vf.UserMessage(content=prompt)] if isinstance(prompt, str) else list(prompt or [])
    nodes = [MessageNode(parent=i - 1 if i else None, message=m) for i, m in enumerate(messages)]
    nodes.append(MessageNode(parent=len(nodes) - 1 if nodes else None, message=vf.AssistantMessage(content=completion),
                             sampled=True))
    return vf.Trace(task=TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
                    agent=vf.AgentInfo(config=vf.AgentConfig(), name="rlflow"), nodes=nodes, is_completed=True, ok=True)


def _run(coro):
    """Run a coroutine to its end from synchronous code, also where an event loop is already running."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    out: dict = {}
    thread = threading.Thread(target=lambda: out.setdefault("r", asyncio.run(coro)))
    thread.start()
    thread.join()
    return out.get("r")
