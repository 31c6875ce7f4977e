"""What a pipeline asks of the cluster, checked at compile: the trainer's ranks and the embedded cluster's size.

A request the cluster cannot hold would otherwise leave an actor or the trainer's placement group pending
until a start-up timeout. Checked here only what is known at compile time: the embedded local cluster's
declared `resources.num_cpus` (a cluster joined with `--address` is checked when the run places the trainer,
trainer_worker.py, rule cluster-too-small there too); GPUs are the device rules' (rlflow/devices.py). An elastic rollout
stage counts at its max_replicas: the embedded cluster has no autoscaler, so an instance it cannot place would only
wait out its start_timeout_s.
"""

from __future__ import annotations

import math
import os

from rlflow.errors import Problem
from rlflow.schema import Pipeline

AT_PEAK = " (elastic stages at their max_replicas)"
#: the embedded cluster may hold actors asking for up to this many times the machine's CPUs: they mostly wait on each
#: other (launch.py gives Ray that many logical CPUs); past it the run spends its time starting and switching processes
OVERSUBSCRIBE = 4
#: Adam moves every weight by about lr per step; weights are of order 0.01-1, so at lr > 1 a step overwrites them
LR_MAX = 1.0
#: a staleness bound above the run's steps bounds nothing (no group can be staler than the run is long); above this
#: floor as well it is refused, so a short trial run (steps: 2) of a pipeline with eta 4 stays valid
ETA_FLOOR = 1000


def peak(stage) -> int:
    """Instances or ranks a stage may hold at once: an elastic rollout stage's max_replicas."""
    elastic = getattr(stage, "elastic", None)
    return max(stage.replicas, elastic.max_replicas) if elastic else getattr(stage, "replicas", getattr(stage, "concurrency", 1))


def check_ranges(spec: Pipeline, problems: list[Problem]) -> None:
    """Settings that compile but make a run that cannot work: a learning rate that is not finite or above LR_MAX
    (rule lr-out-of-range), a staleness bound above both the run's steps and ETA_FLOOR (rule eta-out-of-range)."""
    trains = [(name, s) for name, s in spec.stages.items() if s.kind == "train"]
    for name, s in trains:
        if not (math.isfinite(s.lr) and s.lr <= LR_MAX):
            problems.append(Problem(("stages", name, "lr"), f"lr {s.lr:g} is not a learning rate a run can train at: "
                                    f"the first step would make the weights non-finite (at most {LR_MAX:g})",
                                    "lr-out-of-range", "use a learning rate such as 1e-6 to 1e-4 for a pretrained "
                                    "model (3e-4 for the built-in tiny one)"))
    steps = max((s.steps for _, s in trains), default=0)
    for i, e in enumerate(spec.edges):
        eta = getattr(e.policy, "eta", None)
        if eta is not None and eta > max(steps, ETA_FLOOR):
            problems.append(Problem(("edges", i, "policy", "eta"), f"eta {eta} is more than the run's {steps} steps (and "
                                    f"more than {ETA_FLOOR}): no group can be that stale, so the bound bounds nothing",
                                    "eta-out-of-range", "to train on whatever finished first, use policy kind "
                                    f"unbounded; else a bound of a few steps (0 is on-policy), at most {max(steps, ETA_FLOOR)}"))


def check_machine(spec: Pipeline, problems: list[Problem], cpus: int | None = None) -> None:
    """The embedded cluster with no resources.num_cpus runs on this machine (`cpus`: its CPU count): the stages'
    CPUs may be at most OVERSUBSCRIBE x its CPUs (rule cluster-too-small). Not for a joined cluster, a declared
    num_cpus (check_resources) or a plan compiled for another machine (--gpus N: the caller skips it)."""
    if spec.resources.address is not None or spec.resources.num_cpus is not None:
        return
    cpus = cpus or os.cpu_count() or 1
    elastic = any(getattr(s, "elastic", None) for s in spec.stages.values())
    used = [(n, s) for n, s in spec.stages.items() if s.kind in ("rollout", "train", "reward")]
    want = sum(s.num_cpus * peak(s) for _, s in used)
    if want > OVERSUBSCRIBE * cpus:
        big = max(used, key=lambda ns: ns[1].num_cpus * peak(ns[1]))[0]
        problems.append(Problem(("stages", big, "replicas" if spec.stages[big].kind != "reward" else "concurrency"),
                                f"the stages ask for {want:g} CPU(s){AT_PEAK if elastic else ''} but the embedded "
                                f"cluster runs on this machine's {cpus} CPU(s) (at most {OVERSUBSCRIBE} x that: its "
                                "actors mostly wait on each other)", "cluster-too-small",
                                f"lower stages.{big}'s replicas (or its num_cpus), or join a larger cluster with "
                                "resources.address"))


def check_resources(spec: Pipeline, batch_groups: int | None, problems: list[Problem]) -> None:
    check_ranges(spec, problems)
    rollouts = [s for s in spec.stages.values() if s.kind == "rollout"]
    for name, s in spec.stages.items():
        e = getattr(s, "elastic", None)
        if e is not None and not e.min_replicas <= s.replicas <= e.max_replicas:
            problems.append(Problem(("stages", name, "elastic"), f"replicas {s.replicas} is outside the elastic range "
                                    f"[{e.min_replicas}, {e.max_replicas}]: the run starts with replicas instances",
                                    "elastic-bounds", "set min_replicas <= replicas <= max_replicas"))
    for name, s in spec.stages.items():
        if s.kind == "train" and s.mini_batches > 1 and batch_groups is not None and rollouts:
            per_rank = batch_groups * min(r.group_size for r in rollouts) // s.replicas
            if s.mini_batches > per_rank:
                problems.append(Problem(("stages", name, "mini_batches"), f"{s.mini_batches} mini-batches but "
                                        f"{per_rank} trajectories per step on each of the {s.replicas} trainer rank(s): "
                                        "a mini-batch would have nothing to train", "mini-batches-exceed-batch",
                                        f"use at most {per_rank} mini_batches, or a larger batch"))
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
