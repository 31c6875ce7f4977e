"""`rlflow tune`: choose the rollout/train GPU split and the staleness knob before paying for a run.

The search space, for a budget of N GPUs: rollout GPUs R (in whole instances of `gpus_per_instance`), the
rest training; and the plan's staleness knob (η for bound-style policies, the queue capacity for queue
policies; the batch size stays the plan's, since it changes what is learned, not only how fast).

1. Prune with the closed form, by branch and bound: a two-stage pipeline runs at most at its slower stage's
   rate, and the cost model's decode throughput with every instance running a full batch (StaleFlow App. B,
   Eq. 11) bounds the rollout's, so min(v_R at full load, v_T) bounds a split's trained tokens/s. The plan's own
   setting at an even split is simulated first; then splits in decreasing bound, until the bound falls below the
   best simulated throughput: the rest cannot beat it and are pruned. (A ratio band on rho = v_R / v_T was tried
   first: under StaleFlow's long tails the full-load v_R is 20x what instances reach, so the band dropped or
   kept splits for the wrong reason.)
2. Rank the survivors with the simulator (rlflow/sim): the same plan and policy objects as `rlflow run`,
   every staleness setting, a fixed seed. Report trained tokens/s, mean and max staleness and idle ratios,
   mark the Pareto front (tokens/s against mean staleness), and recommend the fastest point whose max
   staleness stays within the plan's own setting's (within 1% counts as a tie: the plan's own setting, then
   the split nearest even, win it).

What the plan and profile do not say is an assumption, returned as a note: the trainer's tokens/s per GPU
(default: the value that balances an even split, rho = 1 at R = N/2), linear scaling of training with GPUs.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path

QUEUE_KINDS = ("queue_drop", "queue_max")
FIXED_KINDS = ("synchronous", "one_step", "unbounded")  # no staleness knob to tune


@dataclass
class Candidate:
    rollout_gpus: int
    train_gpus: int
    instances: int  # rollout instances: rollout_gpus / GPUs per instance
    knob: int | None  # eta, or queue capacity in groups; None: the policy has none
    rho: float = 0.0  # closed-form v_R / v_T, rollout at full load
    bound: float = 0.0  # closed-form upper bound on trained tokens/s: min(v_R at full load, v_T)
    shipped: bool = False  # the plan's own knob at an even split (the baseline)
    result: dict = field(default_factory=dict)  # simulated: tokens_per_s, mean/max staleness, idle ratios
    pareto: bool = False


def split_grid(gpus: int, per_instance: int, points: int = 9) -> list[tuple[int, int]]:
    """(rollout GPUs, train GPUs) in whole instances, at most `points` of them evenly over the range."""
    instances = [k for k in range(1, gpus // per_instance + 1) if gpus - k * per_instance >= 1]
    if len(instances) > points:
        step = (len(instances) - 1) / (points - 1)
        instances = sorted({instances[round(i * step)] for i in range(points)})
    return [(k * per_instance, gpus - k * per_instance) for k in instances]


def knob_name(kind: str) -> str | None:
    return None if kind in FIXED_KINDS else "capacity" if kind in QUEUE_KINDS else "eta"


def knob_values(control: dict) -> list[int | None]:
    """The plan's own setting and its neighbours worth simulating."""
    name = knob_name(control["kind"])
    if name is None:
        return [None]
    if name == "capacity":
        b = control["batch_size"]
        return sorted({control["capacity"], b, 2 * b, 4 * b})
    return sorted({control["eta"], 1, 2, 3, 4})


def gpus_per_instance(profile_path: str | None, given: int | None, notes: list[str]) -> int:
    if given:
        return given
    if profile_path and Path(profile_path).is_file():
        value = json.loads(Path(profile_path).read_text()).get("gpus_per_instance", {}).get("value")
        if value:
            return int(value)
    notes.append("one GPU per rollout instance assumed (the profile does not say; pass --gpus-per-instance)")
    return 1


def tune(plan: dict, *, gpus: int, steps: int = 30, profile: str | None = None, per_instance: int | None = None,
         train_tokens_per_gpu: float | None = None, seed: int = 0, progress=print) -> tuple[list[Candidate], list[str]]:
    """Every candidate (pruned ones without a result), and the notes on what was assumed."""
    from rlflow.sim import simulate
    from rlflow.sim.config import LengthSpec
    from rlflow.sim.from_plan import load_profile, plan_coordination, sim_config
    from rlflow.sim.lengths import expected_length

    notes: list[str] = []
    rollout = plan["pipeline"]["stages"][rollout_name(plan)]
    control = plan["control"]["staleness"]
    profile = profile or plan_coordination(plan).profile
    prof = load_profile(profile, notes)
    g = gpus_per_instance(profile, per_instance, notes)
    if gpus < 2 * g:
        raise ValueError(f"--gpus {gpus} cannot hold one rollout instance ({g} GPUs) and a trainer GPU")
    w = plan["pipeline"]["workload"]
    n = min(prof.max_running, rollout["max_running"], control["batch_size"] * rollout["group_size"])
    lengths = LengthSpec(kind="lognormal" if w["tailness"] > 0 else "fixed", mean=w["mean_length"],
                         tailness=w["tailness"], cap=w["length_cap"] or rollout["max_new_tokens"])
    per_inst = n / prof.step_latency(prof.k5 * n * expected_length(lengths) / 2, n)  # tokens/s, one full instance
    if train_tokens_per_gpu is None:
        half = max(1, gpus // (2 * g))
        train_tokens_per_gpu = half * per_inst / max(1, gpus - half * g)
        notes.append(f"trainer speed per GPU assumed {train_tokens_per_gpu:,.0f} tokens/s (balances an even split; "
                     "pass --train-tokens-per-gpu), scaling linearly with GPUs")
    splits = split_grid(gpus, g)
    candidates = []
    even = min(splits, key=lambda s: abs(s[0] - gpus / 2))
    for r, t in splits:
        v_r, v_t = (r // g) * per_inst, t * train_tokens_per_gpu
        for knob in knob_values(control):
            candidates.append(Candidate(r, t, r // g, knob, v_r / v_t, min(v_r, v_t),
                                        shipped=(r, t) == even and knob == _own(control)))
    name = knob_name(control["kind"])

    def run(c: Candidate):
        p = copy.deepcopy(plan)
        if name:
            p["control"]["staleness"][name] = c.knob
        config, _ = sim_config(p, steps=steps, mode="cost_model", instances=c.instances, profile=profile,
                               train_tokens_per_s=c.train_gpus * train_tokens_per_gpu, seed=seed)
        r = simulate(config)
        c.result = {"tokens_per_s": r.trained_tokens_per_s, "mean_staleness": r.mean_staleness,
                    "max_staleness": r.max_staleness, "rollout_idle": r.rollout_idle_ratio,
                    "trainer_idle": r.trainer_idle_ratio}
        return r

    # Branch and bound: a split's trained tokens/s cannot exceed min(v_R at full load, v_T), the closed form's
    # optimistic bound (Eq. 11 with every instance decoding a full batch). Simulate the plan's own setting first,
    # then splits in decreasing bound, and prune every split whose bound is below the best simulated so far.
    (shipped,) = [c for c in candidates if c.shipped]
    run(shipped)
    best, simulated = shipped.result["tokens_per_s"], 1
    for split in sorted({(c.rollout_gpus, c.train_gpus, c.bound) for c in candidates}, key=lambda s: -s[2]):
        if split[2] <= best:
            break
        for c in candidates:
            if (c.rollout_gpus, c.train_gpus) == split[:2] and not c.result:
                run(c)
                simulated += 1
                best = max(best, c.result["tokens_per_s"])
    progress(f"tune: {len(splits)} splits x {len(knob_values(control))} settings = {len(candidates)} candidates; "
             f"simulated {simulated} ({steps} steps each), pruned the rest: their closed-form bound is below the best "
             "simulated throughput")
    ran = [c for c in candidates if c.result]
    for c in ran:
        c.pareto = not any(_dominates(o, c) for o in ran)
    return candidates, notes


def _own(control: dict) -> int | None:
    name = knob_name(control["kind"])
    return control[name] if name else None


def _dominates(a: Candidate, b: Candidate) -> bool:
    ra, rb = a.result, b.result
    return (ra["tokens_per_s"] >= rb["tokens_per_s"] and ra["mean_staleness"] <= rb["mean_staleness"]
            and (ra["tokens_per_s"] > rb["tokens_per_s"] or ra["mean_staleness"] < rb["mean_staleness"]))


def choose(candidates: list[Candidate]) -> Candidate:
    """The fastest simulated point whose max staleness stays within the shipped setting's (the plan's bound is a
    statement about learning, not only speed)."""
    shipped = next((c for c in candidates if c.shipped and c.result), None)
    limit = shipped.result["max_staleness"] if shipped else float("inf")
    within = [c for c in candidates if c.result and c.result["max_staleness"] <= limit] or [c for c in candidates if c.result]
    fastest = max(c.result["tokens_per_s"] for c in within)
    # within 1% of the fastest is a tie (one seed): then lower staleness, then no change, then the split nearest even
    tied = [c for c in within if c.result["tokens_per_s"] >= 0.99 * fastest]
    total = tied[0].rollout_gpus + tied[0].train_gpus
    return min(tied, key=lambda c: (c.result["mean_staleness"], not c.shipped, abs(c.rollout_gpus - total / 2)))


def overrides(plan: dict, c: Candidate) -> list[str]:
    """The chosen point as `--set` overrides of the plan's pipeline."""
    out = [f"stages.{rollout_name(plan)}.replicas={c.instances}"]
    knob = knob_name(plan["control"]["staleness"]["kind"])
    if knob:
        edge = next(i for i, e in enumerate(plan["pipeline"]["edges"]) if e["policy"]["kind"] not in
                    ("streaming", "weight_sync"))
        out.append(f"edges.{edge}.policy.{knob}={c.knob}")
    return out


def rollout_name(plan: dict) -> str:
    """The first rollout stage: the one the simulator runs."""
    from rlflow.plan_read import rollout_stages

    return rollout_stages(plan)[0]


def table(candidates: list[Candidate], knob: str | None) -> list[str]:
    """The simulated candidates (pruned splits are summarised in one line)."""
    lines = [(f"| rollout GPUs | train GPUs | {knob or 'policy'} | bound (closed form) | trained tokens/s | "
              "mean / max staleness | rollout idle | trainer idle | |"), "|---:|---:|---:|---:|---:|---|---:|---:|---|"]
    pruned = sorted({(c.rollout_gpus, c.bound) for c in candidates if not c.result})
    for c in sorted((c for c in candidates if c.result), key=lambda c: (c.rollout_gpus, c.knob if c.knob is not None else -1)):
        mark = ", ".join(m for m, on in (("Pareto", c.pareto), ("shipped", c.shipped)) if on)
        r = c.result
        lines.append(f"| {c.rollout_gpus} | {c.train_gpus} | {c.knob if c.knob is not None else '-'} | {c.bound:,.0f} | "
                     f"{r['tokens_per_s']:,.0f} | {r['mean_staleness']:.2f} / {r['max_staleness']} | "
                     f"{r['rollout_idle']:.0%} | {r['trainer_idle']:.0%} | {mark} |")
    if pruned:
        lines.append("\npruned by the closed form (bound on trained tokens/s below the best simulated): rollout GPUs "
                     + ", ".join(f"{r} ({b:,.0f})" for r, b in pruned))
    return lines
