"""Task types: which rollout and reward stage each task's prompts flow through (docs/guides/tasks-and-agents.md).

A task is a named data source (`data.tasks`, or the one task `main` of `data.source`). The `tasks:`
of a data -> rollout edge picks the tasks that rollout stage generates for; the `tasks:` of a
rollout -> reward edge picks the tasks that reward stage scores (default on both: all that arrive).
Each task must reach exactly one rollout stage, and from it exactly one reward stage.
"""

from __future__ import annotations

from rlflow.errors import Problem, did_you_mean
from rlflow.schema import DATA_NODE, MAIN_TASK, Pipeline

BACK_EDGE = "weight_sync"
#: the edges that route task types (`tasks:`), as (source kind, target kind)
TASK_EDGES = {("data", "rollout"), ("rollout", "reward")}


def kind_of(spec: Pipeline, name: str) -> str | None:
    """'data', a stage's kind, or None for an unknown name."""
    return "data" if name == DATA_NODE else spec.stages[name].kind if name in spec.stages else None


def task_names(spec: Pipeline) -> list[str]:
    """The pipeline's task types: `data.tasks`' names, or the one task `main` of `data.source`."""
    return list(spec.data.tasks) if spec.data.tasks else [MAIN_TASK]


def _routes(spec: Pipeline, source: str, to_kind: str, tasks: list[str]) -> dict[str, list[int]]:
    """task -> indices of the edges from `source` to a stage of `to_kind` it flows on (an edge without
    `tasks:` carries every task that reaches `source`)."""
    out: dict[str, list[int]] = {t: [] for t in tasks}
    for i, e in enumerate(spec.edges):
        if e.from_ == source and kind_of(spec, e.to) == to_kind:
            for t in e.tasks or tasks:
                if t in out and i not in out[t]:
                    out[t].append(i)
    return out


def data_routes(spec: Pipeline) -> dict[str, list[int]]:
    """task -> indices of the data -> rollout edges it flows on."""
    return _routes(spec, DATA_NODE, "rollout", task_names(spec))


def reward_routes(spec: Pipeline, rollout: str, received: list[str]) -> dict[str, list[int]]:
    """task (of those `rollout` receives) -> indices of the rollout -> reward edges it flows on."""
    return _routes(spec, rollout, "reward", received)


def received_tasks(spec: Pipeline) -> dict[str, list[str]]:
    """rollout stage -> the tasks that flow into it from data, in task order."""
    routes = data_routes(spec)
    rollouts = [n for n, s in spec.stages.items() if s.kind == "rollout"]
    return {r: [t for t, idx in routes.items() if any(spec.edges[i].to == r for i in idx)] for r in rollouts}


def task_routes(spec: Pipeline) -> dict[str, dict]:
    """task -> {"rollout", "reward", "filter"} of a checked pipeline (each task has exactly one of each)."""
    out = {}
    received = received_tasks(spec)
    for t, idx in data_routes(spec).items():
        rollout = spec.edges[idx[0]].to
        reward = spec.edges[reward_routes(spec, rollout, received[rollout])[t][0]].to
        after = next((e for e in spec.edges if e.from_ == reward and e.policy.kind != BACK_EDGE), None)
        filter_ = getattr(after.policy, "filter", None) if after is not None else None
        out[t] = {"rollout": rollout, "reward": reward, "filter": filter_}
    return out


def check_tasks(spec: Pipeline, problems: list[Problem], skip: set[int], *, edge_rules: set[str], structural_rules: set[str]) -> None:
    """`tasks:` only where tasks are routed, known names; then each task reaches one rollout and, from it, one reward stage.

    `edge_rules`: rules about an edge's ends (a `tasks:` problem on that edge would echo them);
    `structural_rules`: graph problems after which routing is not checked (it would echo them too).
    """
    if any(p.rule == "data-source-or-tasks" for p in problems):
        return
    names = task_names(spec)
    for i, e in enumerate(spec.edges):
        if e.tasks is None or i in skip:
            continue
        src, dst = kind_of(spec, e.from_), kind_of(spec, e.to)
        if e.policy.kind == BACK_EDGE or (src, dst) not in TASK_EDGES:
            if not any(p.loc[:2] == ("edges", i) and p.rule in edge_rules for p in problems):
                problems.append(Problem(("edges", i, "tasks"), f"tasks on {e.from_} -> {e.to}; task types are routed only on "
                                        "data -> rollout and rollout -> reward edges", "tasks-on-edge",
                                        "remove tasks: here (everything a reward stage scores flows on)"))
            continue
        for j, t in enumerate(e.tasks):
            if t not in names:
                problems.append(Problem(("edges", i, "tasks", j), f"unknown task '{t}'{did_you_mean(t, names)}", "unknown-task",
                                        "tasks are: " + ", ".join(names) + (" (data.source is the one task 'main')" if spec.data.source else "")))
    received = received_tasks(spec)
    for i, e in enumerate(spec.edges):
        if e.tasks and e.from_ in received and kind_of(spec, e.to) == "reward":
            for j, t in enumerate(e.tasks):
                if t in names and t not in received[e.from_]:
                    problems.append(Problem(("edges", i, "tasks", j), f"task '{t}' does not reach rollout '{e.from_}' "
                                            f"(it receives: {', '.join(received[e.from_]) or 'nothing'})", "task-not-received",
                                            f"route '{t}' from data to '{e.from_}', or remove it here"))
    if any(p.rule in structural_rules | {"tasks-on-edge", "unknown-task", "task-not-received"} for p in problems):
        return  # routing over a broken graph would only echo its problems
    problems.extend(_check_routes(spec, names, received))


def _check_routes(spec: Pipeline, names: list[str], received: dict[str, list[str]]) -> list[Problem]:
    out = []
    routes = data_routes(spec)
    for t, idx in routes.items():
        if not idx:
            out.append(Problem(("data", "tasks", t) if spec.data.tasks else ("data", "source"),
                               f"task '{t}' goes to no rollout stage: every edge from data lists tasks without it",
                               "task-unrouted", f"add '{t}' to the tasks: [...] of the edge from data to its rollout stage"))
    out += _dupes(spec, routes, "", "rollout", "task-two-rollouts", "give each edge from data its tasks: [...]" + (
        " (several task types under data.tasks), or remove the second rollout stage" if spec.data.source else ""))
    for r, tasks in received.items():
        routes = reward_routes(spec, r, tasks)
        missing = [t for t in tasks if not routes[t]]
        if missing:
            what = ", ".join(f"'{t}'" for t in missing)
            out.append(Problem(("stages", r), f"rollout '{r}' receives task{'s' * (len(missing) > 1)} {what} but sends "
                               f"{'them' if len(missing) > 1 else 'it'} to no reward stage", "task-no-reward",
                               f"add {what} to the tasks: [...] of an edge from '{r}' to a reward stage"))
        out += _dupes(spec, routes, f" from rollout '{r}'", "reward", "task-two-rewards", f"give each edge out of '{r}' its tasks: [...]")
    return out


def _dupes(spec: Pipeline, routes: dict[str, list[int]], origin: str, kind: str, rule: str, fix: str) -> list[Problem]:
    """One problem per edge that carries tasks an earlier edge already carries (grouped by that first edge)."""
    seconds: dict[tuple[int, int], list[str]] = {}
    for t, idx in routes.items():
        for j in idx[1:]:
            seconds.setdefault((idx[0], j), []).append(t)
    out = []
    for (i, j), tasks in sorted(seconds.items(), key=lambda kv: kv[0][::-1]):
        what = ("task " if len(tasks) == 1 else "tasks ") + ", ".join(f"'{t}'" for t in tasks)
        out.append(Problem(("edges", j), f"{what}{origin} also go{'es' * (len(tasks) == 1)} to {kind} '{spec.edges[j].to}' here "
                           f"(first to '{spec.edges[i].to}' on edges[{i}]); a task goes to exactly one {kind} stage", rule, fix))
    return out
