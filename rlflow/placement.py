"""Where a stage's actors may run: Ray custom resources (`stages.<name>.resources: {worker_node: 1}`).

At compile, a stage may not name Ray's own resources (those are num_cpus / num_gpus). At run start the cluster
must offer every requested resource, on some node and in total, or the run fails at once naming the stage
(exit 2), instead of waiting forever on an actor Ray cannot place. An embedded local cluster is one node: it
offers what the plan asks for, so a placed pipeline also runs on a laptop. No Ray import: callers pass nodes.
"""

from __future__ import annotations

from rlflow.errors import PipelineInvalid, Problem
from rlflow.plan_model import Plan, TrainerActor
from rlflow.schema import Pipeline

#: Ray's predefined resources, set per stage by num_cpus / num_gpus, not by `resources`
RAY_RESOURCES = {"CPU": "num_cpus", "GPU": "num_gpus", "memory": None, "object_store_memory": None}
START_NODE = "ray start --address HEAD:PORT --resources '{\"%s\": %g}'"


def check_stage_resources(spec: Pipeline) -> list[Problem]:
    """Compile-time: a stage's `resources` names custom resources only (rule reserved-resource)."""
    problems = []
    for name, stage in spec.stages.items():
        for key in getattr(stage, "resources", None) or {}:
            if key in RAY_RESOURCES:
                field = RAY_RESOURCES[key]
                fix = (f"set stages.{name}.{field} instead; keep resources for custom ones such as {{worker_node: 1}}"
                       if field else "remove it; resources names custom resources such as {worker_node: 1}")
                problems.append(Problem(("stages", name, "resources", key), f"'{key}' is Ray's own resource, not a custom one",
                                        "reserved-resource", fix))
    return problems


def requests(plan: Plan) -> dict[str, tuple[dict[str, float], int]]:
    """Per stage with custom resources: (resources per actor, number of actors) from the plan's actors and
    Ray Data operators (a trainer's ranks and a reward stage's concurrency count as actors)."""
    out: dict[str, tuple[dict[str, float], int]] = {}
    for a in plan.actors:
        if a.resources:
            res, n = out.get(a.stage, (a.resources, 0))
            out[a.stage] = (res, n + (a.replicas if isinstance(a, TrainerActor) else 1))
    for op in plan.reward_operators():
        if op.resources:
            out[op.stage] = (op.resources, op.concurrency)
    return out


def embedded_resources(plan: Plan) -> dict[str, float]:
    """What an embedded one-node cluster offers so every placed actor fits: the plan's total per resource."""
    total: dict[str, float] = {}
    for res, n in requests(plan).values():
        for key, amount in res.items():
            total[key] = total.get(key, 0.0) + amount * n
    return total


def check_cluster(plan: Plan, nodes: list[dict], where: str) -> None:
    """Run start: PipelineInvalid (exit 2) naming stages.<name>.resources when no alive node of `nodes` (Ray's
    `ray.nodes()`) offers a resource a stage needs per actor, or the cluster offers less than all its actors
    together need; naming resources.num_cpus / num_gpus when its alive nodes hold fewer CPUs or GPUs than the plan
    (a resume on a cluster that lost a node would otherwise wait for a placement it can never get)."""
    alive = [n.get("Resources", {}) for n in nodes if n.get("Alive", True)]
    wanted = requests(plan)
    total: dict[str, float] = {}
    for res, n in wanted.values():
        for key, amount in res.items():
            total[key] = total.get(key, 0.0) + amount * n
    problems = []
    for stage, (res, n) in sorted(wanted.items()):
        for key, amount in sorted(res.items()):
            offered = [node.get(key, 0.0) for node in alive]
            loc = ("stages", stage, "resources", key)
            if max(offered, default=0.0) < amount:
                have = sorted({k for node in alive for k in node if k not in RAY_RESOURCES and not k.startswith("node:")})
                problems.append(Problem(loc, f"no node of {where} offers {amount:g} '{key}' (custom resources there: "
                                        f"{', '.join(have) or 'none'})", "unplaceable",
                                        f"start a node with {START_NODE % (key, amount * n)}, or remove "
                                        f"stages.{stage}.resources.{key}"))
            elif sum(offered) < total[key]:
                problems.append(Problem(loc, f"{where} offers {sum(offered):g} '{key}' in all, but the plan's actors need "
                                        f"{total[key]:g} (stage '{stage}': {n} x {amount:g})", "unplaceable",
                                        f"add nodes offering '{key}', lower the stage's replicas or concurrency, or "
                                        f"lower stages.{stage}.resources.{key}"))
    for key, field in (("CPU", "num_cpus"), ("GPU", "num_gpus")):  # a cluster that lost a node: fail now, not wait
        need, offered = getattr(plan.resources, field), sum(node.get(key, 0.0) for node in alive)
        if need > offered + 1e-9:
            problems.append(Problem(("resources", field), f"{where} offers {offered:g} {key}(s) on its {len(alive)} alive "
                                    f"node(s), but the plan's actors need {need:g} at once: they could never all be "
                                    "placed (a node lost?)", "unplaceable",
                                    f"add nodes (or bring the lost one back) with {need - offered:g} more {key}(s), or lower "
                                    "the stages' replicas or num_cpus / num_gpus and compile again"))
    if problems:
        raise PipelineInvalid(plan.source, problems)
