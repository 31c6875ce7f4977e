"""Where each stage runs, how many GPUs each of its actors takes, in which dtype, and the vLLM settings that follow.

Rules over the pipeline and a GPU count, nothing else (no torch, no Ray), so tests cover 0, 1, 2, 8 GPUs on a
machine without one. `rlflow compile` counts this machine's GPUs (`local_gpus`) or takes `--gpus N` (another
machine or cluster). With resources.address (a cluster joined, not started) it counts nothing, since this machine
says nothing about that cluster: it takes `--gpus N` or resources.num_gpus, else unset stages run on CPU.

The default split, for rollout and train stages whose num_gpus is unset, over the whole GPUs the declared ones leave
(elastic stages count at max_replicas; the evaluator follows the first rollout stage):
1. none left: CPU;
2. one for each trainer rank, rollout instance and the evaluator: one GPU each;
3. a GPU left beyond one per trainer rank: the ranks one each, the rollout instances and the evaluator share the rest
   in equal parts;
4. one trainer rank and one GPU: everything shares it in equal parts (colocated: vLLM gets sleep mode);
5. several trainer ranks (NCCL needs a GPU per rank) and too few GPUs: CPU, and the summary says why.
"""

from __future__ import annotations

import math
import os
import subprocess
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path

from rlflow.errors import Problem
from rlflow.resource_checks import AT_PEAK, peak
from rlflow.schema import Pipeline

#: vLLM's share of GPU memory for an instance with its GPU(s) to itself; on a shared GPU, this x its share
GPU_MEMORY_UTILIZATION = 0.85
_STEP = 10_000  # Ray counts fractions of a GPU in steps of 1e-4


@dataclass(frozen=True)
class GpuCount:
    """The GPUs of the machine or cluster compiled for; gpus None: not counted (a joined cluster)."""

    gpus: int | None
    counted_by: str  # "--gpus 8", "nvidia-smi -L", "no NVIDIA driver found", ...


@dataclass(frozen=True)
class Placement:
    """Where one stage's actors run."""

    gpus: float  # per instance / rank; 0: CPU
    count: int  # instances or ranks (an elastic stage at its max_replicas)
    declared: bool  # num_gpus set in the pipeline

    @property
    def device(self) -> str:
        return "cuda" if self.gpus > 0 else "cpu"


@dataclass(frozen=True)
class Devices:
    """The device decisions of one pipeline on one cluster."""

    gpus: int | None  # the cluster's GPUs the plan may use; None: not counted
    counted_by: str
    stages: dict[str, Placement]  # rollout and train stages, by name
    evaluator: Placement | None  # data.eval's actor: the first rollout stage's GPUs
    split: str  # how the stages without num_gpus were placed
    dtype: str
    dtype_reason: str

    @property
    def used(self) -> float:
        return sum(p.gpus * p.count for p in [*self.stages.values(), *([self.evaluator] if self.evaluator else [])])

    def as_dict(self) -> dict:
        """plan["devices"]."""
        where = lambda p: {**asdict(p), "device": p.device}  # noqa: E731
        return {"gpus": self.gpus, "counted_by": self.counted_by, "split": self.split,
                # whole GPUs no actor takes (k shares of 1/k, in Ray's steps, leave a rounding crumb, not a GPU)
                "unused_gpus": None if self.gpus is None else max(0, math.floor(self.gpus - self.used + 0.01)),
                "dtype": self.dtype, "dtype_reason": self.dtype_reason,
                "stages": {n: where(p) for n, p in self.stages.items()},
                "evaluator": where(self.evaluator) if self.evaluator else None}


# ---------------------------------------------------------------------------------------------- counting
@lru_cache(maxsize=1)
def _nvidia_gpus() -> tuple[int, str]:
    """This machine's NVIDIA GPUs, from the driver (no torch, no CUDA context)."""
    proc = Path("/proc/driver/nvidia/gpus")
    if proc.is_dir():
        return len(list(proc.iterdir())), "/proc/driver/nvidia/gpus"
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return 0, "no NVIDIA driver found"
    if out.returncode != 0:
        return 0, f"nvidia-smi -L failed with exit {out.returncode}"
    return sum(line.startswith("GPU ") for line in out.stdout.splitlines()), "nvidia-smi -L"


def local_gpus() -> GpuCount:
    """The GPUs a process started here would see: CUDA_VISIBLE_DEVICES honoured, as Ray honours it."""
    n, how = _nvidia_gpus()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return GpuCount(n, how)
    ids = []
    for v in visible.split(","):
        if not v.strip() or v.strip().startswith("-"):  # CUDA stops at the first invalid id
            break
        ids.append(v)
    return GpuCount(min(n, len(ids)), f"{how}, CUDA_VISIBLE_DEVICES={visible!r}")


def gpu_count(spec: Pipeline, given: int | None = None) -> GpuCount:
    """The GPU count the rules take: `--gpus N`, else nothing for a joined cluster, else this machine's."""
    if given is not None:
        return GpuCount(given, f"--gpus {given}")
    if spec.resources.address is not None:
        return GpuCount(None, f"not counted: a cluster joined at {spec.resources.address}; pass --gpus N")
    return local_gpus()


# ---------------------------------------------------------------------------------------------- placing
def _share(k: int) -> float:
    """One of k equal parts of a GPU, in Ray's steps (k parts never sum to more than one GPU)."""
    return 1.0 if k <= 1 else math.floor(_STEP / k) / _STEP


def split(left: int, ranks: int, rest: int) -> tuple[float, float, str]:
    """GPUs per trainer rank and per rollout instance (and evaluator) of the stages without num_gpus: the module's
    default split of `left` whole GPUs over `ranks` trainer ranks and `rest` other actors; and what was done."""
    n = ranks + rest
    if n == 0:
        return 0.0, 0.0, "none (every stage declares num_gpus)"
    if left < 1:
        return 0.0, 0.0, "CPU (no GPU left for them)"
    if left >= n:
        return 1.0, 1.0, "one GPU each"
    if left > ranks:
        k = math.ceil(rest / (left - ranks))
        how = f"{'one GPU per trainer rank; ' if ranks else ''}rollout instances {k} to a GPU on the {left - ranks} left"
        return float(ranks > 0), _share(k), how
    if ranks == 1:
        return _share(n), _share(n), f"colocated: {n} actors, trainer and rollout, share one GPU"
    return 0.0, 0.0, (f"CPU: {ranks} trainer ranks need a GPU each (NCCL) and rollout at least one more, "
                      f"{left} GPU(s) left; declare num_gpus to place them")


def place(spec: Pipeline, count: GpuCount) -> tuple[Devices, list[Problem]]:
    """The device decisions for `spec` on a cluster of `count` GPUs, and the problems (rules no-gpus,
    more-gpus-than-cluster, cluster-too-small, whole-gpus, gpu-memory-unused)."""
    problems: list[Problem] = []
    declared = spec.resources.num_gpus
    gpus, counted_by = (count.gpus, count.counted_by) if declared == "auto" else (declared, "resources.num_gpus")
    if declared != "auto" and count.gpus is not None and declared > count.gpus:
        problems.append(_over_cluster(declared, count))
    stages = {n: s for n, s in spec.stages.items() if s.kind in ("rollout", "train")}
    rollouts = [n for n, s in stages.items() if s.kind == "rollout"]
    first = rollouts[0] if spec.data.eval is not None and rollouts and len(stages) > len(rollouts) else None
    fixed = {n: s.num_gpus for n, s in stages.items() if s.num_gpus is not None}
    for name, g in fixed.items():
        if g > 1 and g % 1:
            problems.append(Problem(("stages", name, "num_gpus"), f"{g:g} GPUs per actor: Ray gives more than one GPU "
                                    "only in whole numbers", "whole-gpus", f"use {math.floor(g)} or {math.ceil(g)}"))
    for name in rollouts:
        s = stages[name]
        if s.gpu_memory_utilization is not None and s.engine != "vllm":
            problems.append(Problem(("stages", name, "gpu_memory_utilization"), f"is vLLM's setting, and this stage's "
                                    f"engine is '{s.engine}', which would ignore it", "gpu-memory-unused",
                                    "remove it, or set engine: vllm"))
    asked = sum(g * peak(stages[n]) for n, g in fixed.items()) + (fixed.get(first, 0) if first else 0)
    ranks = sum(peak(s) for n, s in stages.items() if n not in fixed and s.kind == "train")
    rest = sum(peak(stages[n]) for n in rollouts if n not in fixed) + int(first is not None and first not in fixed)
    if gpus is None:
        per_rank, per_instance, how = 0.0, 0.0, "CPU (GPUs not counted: pass --gpus N)"
    else:
        per_rank, per_instance, how = split(math.floor(gpus - asked + 1e-9), ranks, rest)
        problems += _too_many(spec, stages, fixed, first, asked, gpus, counted_by, declared)
    placed = {n: Placement(float(fixed[n]) if n in fixed else per_rank if s.kind == "train" else per_instance,
                           peak(s), n in fixed) for n, s in stages.items()}
    evaluator = Placement(placed[first].gpus, 1, placed[first].declared) if first else None
    dtype, reason = resolve_dtype(spec.model.dtype, [p for p in [*placed.values(), evaluator] if p and p.count])
    return Devices(gpus, counted_by, placed, evaluator, how, dtype, reason), problems


def resolve_dtype(declared: str, placements: list[Placement]) -> tuple[str, str]:
    """model.dtype: a declared one is kept; auto is bfloat16 when every rollout instance and trainer rank runs on a
    GPU, else float32 (bf16 is slow on CPUs without AVX-512-BF16, and one dtype serves rollout and train)."""
    if declared != "auto":
        return declared, "declared"
    on_gpu = [p.gpus > 0 for p in placements]
    if on_gpu and all(on_gpu):
        return "bfloat16", "auto: every stage runs on a GPU"
    return "float32", "auto: " + ("some stages run on CPU" if any(on_gpu) else "the stages run on CPU")


def _over_cluster(declared: int, count: GpuCount) -> Problem:
    loc = ("resources", "num_gpus")
    if count.gpus == 0:
        return Problem(loc, f"{declared} GPU(s) asked for, but the cluster has none ({count.counted_by})", "no-gpus",
                       "set resources.num_gpus: auto (the GPUs the cluster has), or compile for the machine that has "
                       f"them: rlflow compile PIPELINE --gpus {declared}")
    return Problem(loc, f"{declared} GPU(s) asked for, but the cluster has {count.gpus} ({count.counted_by})",
                   "more-gpus-than-cluster", f"set resources.num_gpus to at most {count.gpus}, or auto")


def _too_many(spec, stages, fixed, first, asked, gpus, counted_by, declared) -> list[Problem]:
    """Declared GPUs the cluster does not have: each stage asking on a cluster without GPUs (no-gpus), or their
    total, the evaluator counted, above the cluster's (cluster-too-small)."""
    if asked <= gpus:
        return []
    if gpus == 0:
        fix = ("raise resources.num_gpus, or remove num_gpus (a stage without it takes GPUs only where there are some)"
               if declared != "auto" else "remove num_gpus (a stage without it takes GPUs only where there are some), "
               "or compile for the machine that has them: rlflow compile PIPELINE --gpus N")
        return [Problem(("stages", n, "num_gpus"), f"asks for {g:g} GPU(s) per {_unit(stages[n])}"
                        + (" (and the evaluator as many)" if n == first else "")
                        + f", but the cluster has none ({counted_by})", "no-gpus", fix)
                for n, g in fixed.items() if g > 0]
    parts = [f"{n} {peak(stages[n])} x {g:g}" for n, g in fixed.items() if g > 0] + ([f"evaluator {fixed[first]:g}"]
                                                                                     if fixed.get(first) else [])
    elastic = any(getattr(stages[n], "elastic", None) for n in fixed)
    fix = (f"set resources.num_gpus to {math.ceil(asked)} (or more), or lower the stages' num_gpus" if declared != "auto"
           else f"lower the stages' num_gpus or replicas, or compile for a larger cluster: --gpus {math.ceil(asked)}")
    return [Problem(("resources", "num_gpus"), f"the stages ask for {asked:g} GPU(s) ({', '.join(parts)}){AT_PEAK if elastic else ''} "
                    f"but the cluster has {gpus} ({counted_by})", "cluster-too-small", fix)]


def _unit(stage) -> str:
    return "rank" if stage.kind == "train" else "instance"


# ---------------------------------------------------------------------------------------------- applying
def resolve(spec: Pipeline, devices: Devices) -> Pipeline:
    """`spec` with the decisions written in: each stage's num_gpus, model.dtype, resources.num_gpus (when counted)."""
    out = spec.model_copy(deep=True)
    for name, p in devices.stages.items():
        out.stages[name].num_gpus = int(p.gpus) if p.gpus == int(p.gpus) else p.gpus
    out.model.dtype = devices.dtype
    if devices.gpus is not None:
        out.resources.num_gpus = devices.gpus
    return out


def vllm_settings(spec: Pipeline, stage: str) -> dict:
    """Engine kwargs of a vLLM rollout stage of a resolved pipeline, from its GPUs per instance: tensor parallel over
    them, CUDA graphs on a GPU (eager on CPU), gpu_memory_utilization (the stage's, else 0.85 x its GPU share), and
    sleep mode when it may share its GPU with the trainer (both take a fraction of one). {} for other engines."""
    s = spec.stages[stage]
    if s.engine != "vllm":
        return {}
    gpus = s.num_gpus or 0
    if gpus == 0:
        return {"tensor_parallel_size": 1, "enforce_eager": True, "enable_sleep_mode": False}
    return {"tensor_parallel_size": max(1, int(gpus)), "enforce_eager": False,
            "gpu_memory_utilization": s.gpu_memory_utilization or round(GPU_MEMORY_UTILIZATION * min(gpus, 1), 2),
            "enable_sleep_mode": _shares_gpu_with_trainer(spec, stage) or bool(s.sleep_during_train)}


def _shares_gpu_with_trainer(spec: Pipeline, stage: str) -> bool:
    """The stage's instances take a fraction of a GPU and so does a trainer rank: they may sit on one GPU."""
    gpus = spec.stages[stage].num_gpus or 0
    return 0 < gpus < 1 and any(0 < (t.num_gpus or 0) < 1 for t in spec.stages.values() if t.kind == "train")


def _synchronous(spec: Pipeline) -> bool:
    """The policy into train is barrier (graph.py's _consume_policy reads the same edge; importing it here would
    close an import cycle through component_checks)."""
    from rlflow.schema import CONSUME_POLICIES

    return any(e.policy.kind == "barrier" for e in spec.edges if e.policy.kind in CONSUME_POLICIES)


def thread_plan(spec: Pipeline, stage: str) -> tuple[int | str, int, str]:
    """(threads, share, why) for a rollout or train stage of a resolved pipeline: the CPU threads of each of its
    actors (rlflow/runtime/actor_threads.py). Declared `threads` as is. In a synchronous run, "cores": the node's
    cores over `share`, the actors of the phase (rollout instances, at most, of every rollout stage; trainer ranks),
    since generation and training take turns — as a GPU shared in turns sleeps the engine (sleep_plan), so on CPU
    each phase takes every core in its turn. Otherwise the stage's num_cpus: its actors run beside the others, and
    more threads than cores makes every process's steps jump (PLATFORM-NOTES)."""
    s = spec.stages[stage]
    if s.threads is not None:
        return s.threads, 1, "declared"
    if _synchronous(spec):
        if s.kind == "train":
            share = s.replicas
        else:
            share = sum(r.elastic.max_replicas if r.elastic else r.replicas
                        for r in spec.stages.values() if r.kind == "rollout")
        return "cores", share, "synchronous: generation and training take turns, each with the node's cores"
    return max(1, int(s.num_cpus)), 1, f"num_cpus {s.num_cpus:g}: beside the other stages"


def sleep_plan(spec: Pipeline, stage: str) -> tuple[int, str]:
    """(level, why) for a rollout stage of a resolved pipeline: whether its engine sleeps during each train step. On
    when declared (sleep_during_train: true), or by default when its instances share a GPU with the trainer and the
    run is synchronous; never in an asynchronous run (it generates while it trains). Level 2 drops the weights too
    (every wake pulls the new version); with train.lora 1 (a version carries only the adapters, the base stays)."""
    s = spec.stages[stage]
    lora = any(getattr(t, "lora", None) is not None for t in spec.stages.values() if t.kind == "train")
    level = 1 if lora else 2
    if s.sleep_during_train is False:
        return 0, "sleep_during_train: false"
    if s.sleep_during_train:
        return level, "declared (sleep_during_train: true)"
    if not _shares_gpu_with_trainer(spec, stage):
        return 0, "its own device"
    if not _synchronous(spec):
        return 0, "shares a GPU with the trainer, but the run is asynchronous: both stay resident"
    return level, "shares a GPU with the trainer in a synchronous run"


def check_sleep(spec: Pipeline) -> list[Problem]:
    """sleep_during_train: true needs a synchronous run (sleep-needs-synchronous) and an engine that sleeps where it
    runs (sleep-unsupported: vLLM's sleep mode is CUDA's; an engine class without `supports_sleep`)."""
    from rlflow import registry

    problems = []
    for name, s in spec.stages.items():
        if s.kind != "rollout" or not s.sleep_during_train:
            continue
        loc = ("stages", name, "sleep_during_train")
        if not _synchronous(spec):
            problems.append(Problem(loc, "an engine asleep during a train step cannot generate the next batch meanwhile, "
                                    "and this run is asynchronous (its train edge's policy is not barrier)",
                                    "sleep-needs-synchronous", "use policy kind barrier on the edge into train, or "
                                    "remove sleep_during_train (an asynchronous run keeps both resident)"))
        if s.engine == "vllm" and not (s.num_gpus or 0):
            problems.append(Problem(loc, "engine vllm sleeps on GPUs only (its sleep mode frees CUDA memory), and this "
                                    "stage runs on CPU", "sleep-unsupported",
                                    "use engine: hf (it sleeps on CPU too), give the stage a GPU, or remove "
                                    "sleep_during_train"))
            continue
        try:
            engine = registry.resolve("engine", s.engine)
        except Exception:  # noqa: BLE001 -- an engine that cannot be resolved is named by its own rule
            continue
        if isinstance(engine, type) and not getattr(engine, "supports_sleep", False):
            problems.append(Problem(loc, f"engine '{s.engine}' does not implement sleep and wake_up "
                                    "(stages/engine.py, supports_sleep)", "sleep-unsupported",
                                    "use engine: hf or vllm, or remove sleep_during_train"))
    return problems
