"""What a pipeline asks of the cluster, checked at compile: the trainer's ranks and the embedded cluster's size.

A request the cluster cannot hold would otherwise leave an actor or the trainer's placement group pending
until a start-up timeout. Checked here only what is known at compile time: the embedded local cluster's
declared `resources.num_cpus` (a cluster joined with `--address` is checked when the run places the trainer,
train_sink.py, rule cluster-too-small there too); GPUs are the device rules' (rlflow/devices.py). An elastic rollout
stage counts at its max_replicas: the embedded cluster has no autoscaler, so an instance it cannot place would only
wait out its start_timeout_s.
"""

from __future__ import annotations

from rlflow.errors import Problem
from rlflow.schema import Pipeline


AT_PEAK = " (elastic stages at their max_replicas)"


def peak(stage) -> int:
    """Instances or ranks a stage may hold at once: an elastic rollout stage's max_replicas."""
    elastic = getattr(stage, "elastic", None)
    return max(stage.replicas, elastic.max_replicas) if elastic else getattr(stage, "replicas", getattr(stage, "concurrency", 1))


def check_resources(spec: Pipeline, batch_groups: int | None, problems: list[Problem]) -> None:
    rollouts = [s for s in spec.stages.values() if s.kind == "rollout"]
    for name, s in spec.stages.items():
        e = getattr(s, "elastic", None)
        if e is not None and not e.min_replicas <= s.replicas <= e.max_replicas:
            problems.append(Problem(("stages", name, "elastic"), f"replicas {s.replicas} is outside the elastic range "
                                    f"[{e.min_replicas}, {e.max_replicas}]: the run starts with replicas instances",
                                    "elastic-bounds", "set min_replicas <= replicas <= max_replicas"))
    for name, s in spec.stages.items():
        if s.kind != "train" or s.replicas == 1:
            continue
        loc = ("stages", name, "replicas")
        if batch_groups is not None and rollouts:
            per_step = batch_groups * min(r.group_size for r in rollouts)
            if s.replicas > per_step:
                problems.append(Problem(loc, f"{s.replicas} trainer ranks but only {per_step} trajectories per step: "
                                        "a rank would have nothing to train", "ranks-exceed-batch",
                                        f"use at most {per_step} replicas, or a larger batch"))
        if s.num_gpus is not None and 0 < s.num_gpus < 1:
            problems.append(Problem(("stages", name, "num_gpus"), f"{s.replicas} trainer ranks sharing GPUs "
                                    f"(num_gpus {s.num_gpus:g} each): NCCL needs one GPU per rank", "ranks-share-gpus",
                                    "set num_gpus: 1 (one GPU per rank), or replicas: 1"))
    if spec.resources.address is not None:
        return
    elastic = any(getattr(s, "elastic", None) for s in spec.stages.values())
    if spec.resources.num_cpus is not None:
        cpus = sum(s.num_cpus * peak(s) for s in spec.stages.values() if s.kind in ("rollout", "train", "reward"))
        if cpus > spec.resources.num_cpus:
            problems.append(Problem(("resources", "num_cpus"), f"the stages ask for {cpus:g} CPU(s){AT_PEAK if elastic else ''} but the embedded cluster "
                                    f"has resources.num_cpus {spec.resources.num_cpus}", "cluster-too-small",
                                    f"raise resources.num_cpus to {cpus:g} (or leave it unset), or lower the stages' num_cpus"))
