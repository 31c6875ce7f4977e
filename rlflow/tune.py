"""`rlflow tune`: choose the rollout/train GPU split and the staleness knob before paying for a run.

The search space, for a budget of N GPUs: rollout GPUs R (in whole instances of `gpus_per_instance`), the
rest training; the plan's staleness knob (η for bound-style policies, the queue capacity for queue policies);
and, only when asked (`batch_sizes`), the batch size in groups. By default the batch stays the plan's: a batch
changes how many updates each sample gets, which is about learning, and the simulator only judges speed.

1. Prune with the closed form: a two-stage pipeline runs at most at its slower stage's
   rate, and the cost model's decode throughput with every instance running a full batch (StaleFlow App. B,
   Eq. 11) bounds the rollout's, so min(v_R at full load, v_T) bounds a split's trained tokens/s. The plan's own
   setting at an even split is simulated first (full length); then every point whose bound is above its
   throughput: the rest cannot beat it and are pruned. An eta over the shipped max staleness is screened at the
   shipped split only (see _looser). (A ratio band on rho = v_R / v_T was tried first: under StaleFlow's long
   tails the full-load v_R is 20x what instances reach, so the band dropped or
   kept splits for the wrong reason.)
2. Rank the survivors with the simulator (rlflow/sim): the same plan and policy objects as `rlflow run`,
   every staleness setting, a fixed seed. Report trained tokens/s, mean and max staleness and idle ratios,
   mark the Pareto front (tokens/s against mean staleness), and recommend the fastest point whose max
   staleness stays within the plan's own setting's (within 1% counts as a tie: the plan's own setting, then
   the split nearest even, win it).
   Steps 1-2 run at a screening length (`screen_steps`, a third of `steps` by default): successive halving's
   first rung. A short run ranks points well enough to pick the few worth a full one, at a fraction of the cost.
   The split grid is coarse (at most 9 splits); the splits halfway between the fastest screened point and its
   neighbours are screened too, and again around the new fastest if it moved (REFINE_ROUNDS halvings).
3. Confirm at full length with more seeds: one seed can make a point look several % faster than it is
   (streamrl.yaml at 64 GPUs, queue-drop with skew-aware dispatch: its pick on seed 0 was 5% ahead of the shipped
   setting and 14% behind it on seed 1). The plan's own setting and the CONTENDERS fastest screened points within
   its screened max staleness are simulated for `steps` with `seeds` seeds; their results are averages over the
   seeds (max staleness: the max), and only these confirmed points can be recommended.

A queue policy's capacity acts only when its queue overflows, so a run whose queue never reached a capacity answers
for it exactly (_reuse): queue capacities are screened largest first at each split, and a point whose run would
repeat one already simulated takes its result instead (streamrl.yaml at 1,024 GPUs: every capacity's screen at a
split is one run; the rollout's warm-up before the first batch is most of a run's cost, so a screen costs nearly what
a full run does).

The simulations of a step are independent: `jobs` > 1 runs them in that many worker processes.

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
CONTENDERS = 3  # the fastest points re-simulated with more seeds, beside the plan's own setting
REFINE_ROUNDS = 2  # halvings of the split grid's step around the fastest screened split


class TuneArgError(ValueError):
    """A search argument that cannot work; `option` names it (the CLI reports the error there)."""

    def __init__(self, option: str, message: str):
        super().__init__(f"{option}: {message}")
        self.option = option


@dataclass
class Candidate:
    rollout_gpus: int
    train_gpus: int
    instances: int  # rollout instances: rollout_gpus / GPUs per instance
    knob: int | None  # eta, or queue capacity in groups; None: the policy has none
    rho: float = 0.0  # closed-form v_R / v_T, rollout at full load
    bound: float = 0.0  # closed-form upper bound on trained tokens/s: min(v_R at full load, v_T)
    train_tokens_per_s: float = 0.0  # the trainer speed simulated: train GPUs x tokens/s per GPU
    shipped: bool = False  # the plan's own knob at an even split (the baseline)
    batch: int | None = None  # groups per training step; None: the plan's
    result: dict = field(default_factory=dict)  # simulated: tokens_per_s, mean/max staleness, idle ratios
    runs: list[dict] = field(default_factory=list)  # one full-length result per seed; `result` aggregates them
    screen: dict = field(default_factory=dict)  # the screening run (seed 0, screen_steps); {} if not screened
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


def knob_values(control: dict, batch: int | None = None) -> list[int | None]:
    """The plan's own setting and its neighbours worth simulating (queue capacities: multiples of `batch`, by
    default the plan's batch)."""
    name = knob_name(control["kind"])
    if name is None:
        return [None]
    if name == "capacity":
        b = batch or control["batch_size"]
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
         train_tokens_per_gpu: float | None = None, seed: int = 0, seeds: int = 2, screen_steps: int | None = None,
         jobs: int = 1, batch_sizes: list[int] | None = None, progress=print) -> tuple[list[Candidate], list[str]]:
    """Every candidate (pruned ones without a screen), and the notes on what was assumed. The search screens with
    `seed` for `screen_steps` (default: a third of `steps`, at least 5); the plan's own setting and the CONTENDERS
    fastest screened points are confirmed for `steps` with seeds `seed`..`seed + seeds - 1`."""
    from rlflow.sim.config import LengthSpec
    from rlflow.sim.from_plan import load_profile, plan_coordination
    from rlflow.sim.lengths import expected_length

    notes: list[str] = []
    rollout = plan["pipeline"]["stages"][rollout_name(plan)]
    control = plan["control"]["staleness"]
    profile = profile or plan_coordination(plan).profile
    prof = load_profile(profile, notes)
    g = gpus_per_instance(profile, per_instance, notes)
    if gpus < 2 * g:
        raise TuneArgError("--gpus", f"{gpus} GPUs cannot hold one rollout instance ({g} GPUs) and a trainer GPU")
    w = plan["pipeline"]["workload"]
    lengths = LengthSpec(kind="lognormal" if w["tailness"] > 0 else "fixed", mean=w["mean_length"],
                         tailness=w["tailness"], cap=w["length_cap"] or rollout["max_new_tokens"])

    def full_instance(batch: int) -> float:
        """Decode tokens/s of one instance at full load (Eq. 11): at most a whole batch runs on it."""
        n = min(prof.max_running, rollout["max_running"], batch * rollout["group_size"])
        return n / prof.step_latency(prof.k5 * n * expected_length(lengths) / 2, n)

    own_batch = control["batch_size"]
    batches = sorted({own_batch, *(batch_sizes or [])})
    if min(batches) < 1:
        raise TuneArgError("--batch-sizes", f"a batch is at least 1 group, got {min(batches)}")
    per_inst = full_instance(own_batch)
    if train_tokens_per_gpu is None:
        half = max(1, gpus // (2 * g))
        train_tokens_per_gpu = half * per_inst / max(1, gpus - half * g)
        notes.append(f"trainer speed per GPU assumed {train_tokens_per_gpu:,.0f} tokens/s (balances an even split; "
                     "pass --train-tokens-per-gpu), scaling linearly with GPUs")
    splits = split_grid(gpus, g)
    candidates = []
    even = min(splits, key=lambda s: abs(s[0] - gpus / 2))

    def make(k: int, b: int, knob: int | None) -> Candidate:
        """The point with k rollout instances (the rest of the GPUs train), batch b and the knob."""
        r, t = k * g, gpus - k * g
        v_r, v_t = k * full_instance(b), t * train_tokens_per_gpu
        return Candidate(r, t, k, knob, v_r / v_t, min(v_r, v_t), v_t,
                         shipped=(r, t) == even and knob == _own(control) and b == own_batch,
                         batch=None if b == own_batch else b)

    for r, _ in splits:
        for b in batches:
            candidates.extend(make(r // g, b, knob) for knob in knob_values(control, b))
    name = knob_name(control["kind"])
    screen = min(steps, screen_steps or max(5, steps // 3))

    same: dict[tuple, list[tuple[int, dict]]] = {}  # queue runs by point: (peak queued, result), see _reuse
    counts = {"simulated": 0, "reused": 0}

    def run(batch: list[tuple[Candidate, int, int]]) -> None:
        """Simulate (candidate, steps, seed) points; a full-length run joins the candidate's runs. A queue point
        whose run is known to be identical to one already simulated (_reuse) takes that run's result."""
        todo = []
        for c, n, s in batch:
            r = _reuse(same, c, n, s)
            if r is None:
                todo.append((c, n, s))
            else:
                counts["reused"] += 1
                keep(c, n, s, r)
        args = [(plan, name, c.knob, c.instances, profile, c.train_tokens_per_s, n, s, c.batch) for c, n, s in todo]
        for (c, n, s), r in zip(todo, workers.map(args)):
            counts["simulated"] += 1
            if name == "capacity" and r["peak_queued"] <= c.knob:
                same.setdefault(_point(c, n, s), []).append((r["peak_queued"], r))
            keep(c, n, s, r)

    def keep(c: Candidate, n: int, s: int, r: dict) -> None:
        if n == screen and s == seed:
            c.screen = r
        if n == steps:
            c.runs.append(r)
            c.result = _aggregate(c.runs)

    def screen_all(points: list[Candidate]) -> None:
        """Screen `points`; queue capacities largest first at each split, so a run whose queue never filled answers
        for the smaller capacities it never reached."""
        if name != "capacity":
            return run([(c, screen, seed) for c in points])
        largest = {}
        for c in points:
            key = _point(c, screen, seed)
            if key not in largest or c.knob > largest[key].knob:
                largest[key] = c
        run([(c, screen, seed) for c in largest.values()])
        run([(c, screen, seed) for c in points if not c.screen])

    # Bound pruning: a split's trained tokens/s cannot exceed min(v_R at full load, v_T), the closed form's
    # optimistic bound (Eq. 11 with every instance decoding a full batch). Simulate the plan's own setting first (a
    # screen and its full-length runs), then screen at once every point whose bound is above its first seed's
    # full-length throughput; the rest are pruned: they cannot beat the shipped setting, which is always eligible.
    # Not against the shipped screen: a short run can overstate a pipeline whose staleness is still climbing
    # (laminar's unbounded policy), and would prune splits that beat it at full length. Not against the best point so
    # far (branch and bound): a point within the staleness limit on a short run may exceed it at full length, and
    # would have pruned splits that win.
    with _Workers(jobs) as workers:
        (shipped,) = [c for c in candidates if c.shipped]
        # every seed of the shipped setting at once: all of them are needed, and they keep both workers busy
        run([(shipped, steps, s) for s in range(seed, seed + seeds)] + ([(shipped, screen, seed)] if steps != screen else []))
        limit = shipped.screen["max_staleness"]
        screen_all([c for c in candidates if not c.shipped and c.bound > shipped.runs[0]["tokens_per_s"]
                    and not _looser(c, shipped, name)])
        progress(f"tune: {len(splits)} splits x {len(candidates) // len(splits)} settings = {len(candidates)} candidates; "
                 f"screened {sum(1 for c in candidates if c.screen)} ({screen} steps each), pruned the rest: their "
                 "closed-form bound is below the shipped setting's throughput")
        # Refine the split: the grid has at most 9 splits, and the best one often lies between two of them. Screen the
        # splits halfway between the fastest screened point within the staleness limit and its neighbours (same knob
        # and batch), and again around the new best if it moved: a hill climb of REFINE_ROUNDS halvings.
        for _ in range(REFINE_ROUNDS):
            best = max((c for c in candidates if c.screen and c.screen["max_staleness"] <= limit),
                       key=lambda c: c.screen["tokens_per_s"])
            have = sorted({c.instances for c in candidates})
            i = have.index(best.instances)
            mids = {(best.instances + n) // 2 for n in have[max(0, i - 1):i + 2]} - set(have)
            new = [make(k, best.batch or own_batch, best.knob) for k in sorted(mids)]
            candidates.extend(new)
            screen_all([c for c in new if c.bound > shipped.runs[0]["tokens_per_s"]])
            after = max((c for c in candidates if c.screen and c.screen["max_staleness"] <= limit),
                        key=lambda c: c.screen["tokens_per_s"])
            if after is best:
                break
            progress(f"tune: refined the split: {after.rollout_gpus} rollout GPUs screen faster than {best.rollout_gpus}")
        screened = [c for c in candidates if c.screen]
        # Confirm: the fastest screened points within the shipped max staleness, full length, every seed (as the shipped
        # setting ran above).
        contenders = _contenders(screened, shipped, limit)
        run([(c, steps, s) for s in range(seed, seed + seeds) for c in contenders
             if s != seed or steps != screen])  # a full-length screen counts as the first seed's run
        progress(f"tune: simulated the shipped setting and {len(contenders)} fastest point(s) within its max staleness "
                 f"for {steps} steps with seeds {seed}..{seed + seeds - 1}; the recommendation is among them (averages)")
        if counts["reused"]:
            progress(f"tune: {counts['simulated']} simulations; {counts['reused']} more points ran identically to one of "
                     "them (their queue never reached the smaller capacity) and took its result")
    for c in screened:
        c.pareto = not any(_dominates(o, c) for o in screened)
    return candidates, notes


def _contenders(screened: list[Candidate], shipped: Candidate, limit: int) -> list[Candidate]:
    """The CONTENDERS fastest screened points within the shipped screen's max staleness, one per screening run:
    points whose screen was one run (queue capacities the queue never reached, _reuse) cannot be told apart by it,
    so a slot goes to one of them, the one whose knob is nearest the shipped one; none to the shipped setting's own."""
    runs: dict[int, list[Candidate]] = {}
    for c in screened:
        if c.screen["max_staleness"] <= limit:
            runs.setdefault(id(c.screen), []).append(c)
    runs.pop(id(shipped.screen), None)
    picks = [min(same, key=lambda c: abs(c.knob - shipped.knob) if c.knob is not None else 0) for same in runs.values()]
    return sorted(picks, key=lambda c: -c.screen["tokens_per_s"])[:CONTENDERS]


def _point(c: Candidate, steps: int, seed: int) -> tuple:
    """What a simulation depends on besides the staleness knob."""
    return c.instances, c.batch, c.train_tokens_per_s, steps, seed


def _reuse(same: dict, c: Candidate, steps: int, seed: int) -> dict | None:
    """The result of an identical run already simulated, if one is known. A queue policy's capacity acts only by
    dropping the oldest completed group when the queue holds more than it (operators/queues.py, occupy): a run whose
    queue peaked at P groups without a drop runs step for step the same with any capacity >= P (same seed, split,
    batch and length), so its result is that point's."""
    for peak, r in same.get(_point(c, steps, seed), ()):
        if c.knob is not None and peak <= c.knob:
            return r
    return None


def _looser(c: Candidate, shipped: Candidate, name: str | None) -> bool:
    """An eta above both the shipped eta and the shipped setting's max staleness (full length), off the shipped split:
    not worth a screen. Such a point is either over that staleness (the bound binds: it cannot be recommended) or
    within it (the bound never binds: it runs as a tighter eta does, which is screened). At the shipped split it is
    screened anyway, for the Pareto table."""
    return (name == "eta" and c.knob > max(shipped.knob, shipped.runs[0]["max_staleness"])
            and c.rollout_gpus != shipped.rollout_gpus)


def simulate_point(plan: dict, name: str | None, knob, instances: int, profile: str, train_tokens_per_s: float,
                    steps: int, seed: int, batch: int | None = None) -> dict:
    """One candidate simulated (a module-level function, so worker processes can run it)."""
    from rlflow.sim import simulate
    from rlflow.sim.from_plan import sim_config
    from rlflow.sim.loop import build_policy

    p = copy.deepcopy(plan)
    if name:
        p["control"]["staleness"][name] = knob
    if batch is not None:
        p["control"]["staleness"]["batch_size"] = batch
    config, _ = sim_config(p, steps=steps, mode="cost_model", instances=instances, profile=profile,
                           train_tokens_per_s=train_tokens_per_s, seed=seed)
    policy = build_policy(config)  # ours, to read its peak queue after the run
    r = simulate(config, policy)
    return {"tokens_per_s": r.trained_tokens_per_s, "mean_staleness": r.mean_staleness,
            "max_staleness": r.max_staleness, "rollout_idle": r.rollout_idle_ratio, "trainer_idle": r.trainer_idle_ratio,
            "peak_queued": getattr(policy, "peak_queued", 0)}


class _Workers:
    """`simulate_point` over a list of points, in order: in this process, or in `jobs` worker processes started on
    first use and kept for the whole search (starting one costs about a second of imports)."""

    def __init__(self, jobs: int):
        self.jobs = jobs
        self.pool = None

    def __enter__(self) -> _Workers:
        return self

    def __exit__(self, *exc) -> None:
        if self.pool is not None:
            self.pool.shutdown(cancel_futures=True)

    def map(self, args: list[tuple]) -> list[dict]:
        if self.jobs <= 1 or len(args) <= 1:
            return [simulate_point(*a) for a in args]
        if self.pool is None:
            import multiprocessing
            from concurrent.futures import ProcessPoolExecutor

            # spawn, not fork: the caller may hold threads (a Ray driver, a test runner's), which fork does not copy
            self.pool = ProcessPoolExecutor(max_workers=self.jobs, mp_context=multiprocessing.get_context("spawn"))
        return list(self.pool.map(simulate_point, *zip(*args)))


def _aggregate(runs: list[dict]) -> dict:
    """Several seeds' results as one: means, but the max staleness is the max over the seeds."""
    out = {k: sum(r[k] for r in runs) / len(runs) for k in runs[0]}
    out["max_staleness"] = max(r["max_staleness"] for r in runs)
    out["peak_queued"] = max(r["peak_queued"] for r in runs)
    return out


def _own(control: dict) -> int | None:
    name = knob_name(control["kind"])
    return control[name] if name else None


def _dominates(a: Candidate, b: Candidate) -> bool:
    """On the screening runs (every screened point has one, same length and seed)."""
    ra, rb = a.screen, b.screen
    return (ra["tokens_per_s"] >= rb["tokens_per_s"] and ra["mean_staleness"] <= rb["mean_staleness"]
            and (ra["tokens_per_s"] > rb["tokens_per_s"] or ra["mean_staleness"] < rb["mean_staleness"]))


def choose(candidates: list[Candidate]) -> Candidate:
    """The fastest simulated point whose max staleness stays within the shipped setting's (the plan's bound is a
    statement about learning, not only speed). Only the points simulated with the most seeds (the confirmed ones)
    are eligible: a point seen on one seed only may owe its lead to that seed."""
    ran = [c for c in candidates if c.result]
    most = max(len(c.runs) for c in ran)
    ran = [c for c in ran if len(c.runs) == most]
    shipped = next((c for c in ran if c.shipped), None)
    limit = shipped.result["max_staleness"] if shipped else float("inf")
    within = [c for c in ran if c.result["max_staleness"] <= limit] or ran
    fastest = max(c.result["tokens_per_s"] for c in within)
    # within 1% of the fastest is a tie: then lower staleness, then no change, then the split nearest even
    tied = [c for c in within if c.result["tokens_per_s"] >= 0.99 * fastest]
    total = tied[0].rollout_gpus + tied[0].train_gpus
    return min(tied, key=lambda c: (c.result["mean_staleness"], not c.shipped, abs(c.rollout_gpus - total / 2)))


def overrides(plan: dict, c: Candidate) -> list[str]:
    """The chosen point as `--set` overrides of the plan's pipeline."""
    out = [f"stages.{rollout_name(plan)}.replicas={c.instances}"]
    knob = knob_name(plan["control"]["staleness"]["kind"])
    if knob:
        # the edge that carries the staleness knob (not e.g. a skew-aware dispatch edge out of the data source)
        edge = next(i for i, e in enumerate(plan["pipeline"]["edges"]) if knob in e["policy"])
        out.append(f"edges.{edge}.policy.{knob}={c.knob}")
    if c.batch is not None:
        buffer = next(n for n, s in plan["pipeline"]["stages"].items() if s["kind"] == "buffer")
        out.append(f"stages.{buffer}.batch_groups={c.batch}")
    return out


def rollout_name(plan: dict) -> str:
    """The plan's rollout stage (ValueError if it has several: the simulator models one)."""
    from rlflow.sim.from_plan import plan_rollout

    return plan_rollout(plan)[0]


def table(candidates: list[Candidate], knob: str | None) -> list[str]:
    """The screened candidates (pruned splits are summarised in one line): the full-length result where there is one
    (averaged over its seeds), else the screening run's."""
    batches = any(c.batch is not None for c in candidates)  # a batch column only when batch sizes were searched
    lines = [(f"| rollout GPUs | train GPUs | {knob or 'policy'} |{' batch (groups) |' if batches else ''} bound (closed "
              "form) | trained tokens/s | mean / max staleness | rollout idle | trainer idle | |"),
             "|---:|---:|---:|" + ("---:|" if batches else "") + "---:|---:|---|---:|---:|---|"]
    shipped = next(c for c in candidates if c.shipped)
    skipped = {id(c) for c in candidates if not c.screen and _looser(c, shipped, knob)}  # not pruned: not screened
    looser = sorted({c.knob for c in candidates if id(c) in skipped})
    pruned = sorted({(c.rollout_gpus, c.bound) for c in candidates if not c.screen and id(c) not in skipped})
    for c in sorted((c for c in candidates if c.screen),
                    key=lambda c: (c.rollout_gpus, c.batch or 0, c.knob if c.knob is not None else -1)):
        mark = ", ".join(m for m, on in (("Pareto", c.pareto), ("shipped", c.shipped),
                                          (f"{len(c.runs)} seeds", len(c.runs) > 1), ("screened only", not c.runs)) if on)
        r = c.result or c.screen
        lines.append(f"| {c.rollout_gpus} | {c.train_gpus} | {c.knob if c.knob is not None else '-'} | "
                     + (f"{c.batch or 'plan'} | " if batches else "") + f"{c.bound:,.0f} | "
                     f"{r['tokens_per_s']:,.0f} | {r['mean_staleness']:.2f} / {r['max_staleness']} | "
                     f"{r['rollout_idle']:.0%} | {r['trainer_idle']:.0%} | {mark} |")
    if pruned:
        lines.append("\npruned by the closed form (bound on trained tokens/s below the shipped setting's "
                     "throughput): rollout GPUs "
                     + ", ".join(f"{r} ({b:,.0f})" for r, b in pruned))
    if looser:
        lines.append(f"\nnot screened off the shipped split: eta {', '.join(map(str, looser))}, over the shipped "
                     "setting's max staleness (eligible only where that bound never binds, and then no faster than "
                     "a tighter eta)")
    return lines
