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
   shipped split only (see too_loose). (A ratio band on rho = v_R / v_T was tried first: under StaleFlow's long
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

Several rollout stages (mixed.yaml): the rollout instances of a split are divided between the stages in the plan's
replicas' proportions, then moved from one stage to another at the fastest point (SHIFT_ROUNDS). Each stage admits
work as fast as it can, so the task mix trained follows the instances; a point is eligible only if every stage's
share of trained samples stays within MIX_TOLERANCE of the shipped setting's (eligible()).

The choice, the overrides that apply it and the table are rlflow/tune_report.py.

The simulations of a step are independent: `jobs` > 1 runs them in that many worker processes.

The trainer: a profile `rlflow profile` measured (a calibration run's seconds per micro-batch and per token) is
simulated at one rank per train GPU of each split, splitting batches as the plan does (sim/from_plan.py
measured_trainer). Otherwise what the plan and profile do not say is an assumption, returned as a note: the trainer's
tokens/s per GPU (default: the value that balances an even split, rho = 1 at R = N/2), linear scaling with GPUs.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field, replace
from pathlib import Path

from rlflow.plan_model import Plan, Staleness
from rlflow.sim.lengths import expected_length
from rlflow.sim.measured_profile import MeasuredProfile

QUEUE_KINDS = ("queue_drop", "queue_max")
FIXED_KINDS = ("synchronous", "one_step", "unbounded")  # no staleness knob to tune
CONTENDERS = 3  # the fastest points re-simulated with more seeds, beside the plan's own setting
SHIFT_ROUNDS = 4  # several rollout stages: rounds of moving instances from one stage to another
SCREEN_COST = 0.5  # a screen that costs this share of a full run (in events) is run at full length instead
MIX_TOLERANCE = 0.05  # several rollout stages: how far a stage's share of trained samples may move from the shipped one's
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
    train_tokens_per_s: float = 0.0  # the trainer's tokens/s: train GPUs x tokens/s per GPU, or the measured trainer's
    measured_trainer: bool = False  # simulate the profile's measured trainer at train_gpus ranks (not a stated speed)
    shipped: bool = False  # the plan's own knob at an even split (the baseline)
    batch: int | None = None  # groups per training step; None: the plan's
    result: dict = field(default_factory=dict)  # simulated: tokens_per_s, mean/max staleness, idle ratios
    runs: list[dict] = field(default_factory=list)  # one full-length result per seed; `result` aggregates them
    screen: dict = field(default_factory=dict)  # the screening run (seed 0, screen_steps); {} if not screened
    pareto: bool = False
    stages: tuple[int, ...] = ()  # several rollout stages: instances of each, in the plan's order (they sum to instances)


def split_grid(gpus: int, per_instance: int, points: int = 9) -> list[tuple[int, int]]:
    """(rollout GPUs, train GPUs) in whole instances, at most `points` of them evenly over the range."""
    instances = [k for k in range(1, gpus // per_instance + 1) if gpus - k * per_instance >= 1]
    if len(instances) > points:
        step = (len(instances) - 1) / (points - 1)
        instances = sorted({instances[round(i * step)] for i in range(points)})
    return [(k * per_instance, gpus - k * per_instance) for k in instances]


def knob_name(kind: str) -> str | None:
    return None if kind in FIXED_KINDS else "capacity" if kind in QUEUE_KINDS else "eta"


def knob_values(control: Staleness, batch: int | None = None) -> list[int | None]:
    """The plan's own setting and its neighbours worth simulating (queue capacities: multiples of `batch`, by
    default the plan's batch)."""
    name = knob_name(control.kind)
    if name is None:
        return [None]
    if name == "capacity":
        b = batch or control.batch_size
        return sorted({control.capacity, b, 2 * b, 4 * b})
    return sorted({control.eta, 1, 2, 3, 4})


def gpus_per_instance(profile_path: str | None, given: int | None, notes: list[str]) -> int:
    if given:
        return given
    if profile_path and Path(profile_path).is_file():
        value = json.loads(Path(profile_path).read_text()).get("gpus_per_instance", {}).get("value")
        if value:
            return int(value)
    notes.append("one GPU per rollout instance assumed (the profile does not say; pass --gpus-per-instance)")
    return 1


def tune(plan: Plan | dict, *, gpus: int, steps: int = 30, profile: str | None = None, per_instance: int | None = None,
         train_tokens_per_gpu: float | None = None, seed: int = 0, seeds: int = 2, screen_steps: int | None = None,
         jobs: int = 1, batch_sizes: list[int] | None = None, progress=print) -> tuple[list[Candidate], list[str]]:
    """Every candidate (pruned ones without a screen), and the notes on what was assumed. The search screens with
    `seed` for `screen_steps` (default: a third of `steps`, at least 5); the plan's own setting and the CONTENDERS
    fastest screened points are confirmed for `steps` with seeds `seed`..`seed + seeds - 1`."""
    from rlflow.sim.from_plan import (
        ONE_STAGE_RULE,
        decode_rate,
        measured_trainer,
        not_simulable,
        plan_profiles,
        plan_rollouts,
        profile_or_default,
        share_notes,
        stage_lengths,
    )

    plan = Plan.of(plan)
    why = not_simulable(plan)
    if why:
        raise ValueError(f"{why} [{ONE_STAGE_RULE}]")
    notes: list[str] = []
    rollouts = plan_rollouts(plan)  # several: instances are split between the stages too (_divide, shift rounds)
    names = [n for n, _ in rollouts]
    control = plan.staleness
    profile = profile or next(iter(plan_profiles(plan)), None)
    prof = profile_or_default(profile, notes)
    notes += share_notes(plan)
    g = gpus_per_instance(profile, per_instance, notes)
    if gpus < len(rollouts) * g + 1:
        raise TuneArgError("--gpus", f"{gpus} GPUs cannot hold one rollout instance ({g} GPUs) per rollout stage "
                                     f"({len(rollouts)}) and a trainer GPU")
    w = plan.pipeline["workload"]
    lengths = [stage_lengths(w, name, rollout) for name, rollout in rollouts]
    replicas = [rollout["replicas"] for _, rollout in rollouts]

    def full_instance(batch: int, i: int = 0) -> float:
        """Decode tokens/s of one instance of stage i at full load (Eq. 11): at most a whole batch runs on it."""
        return decode_rate(prof, rollouts[i][1], batch, lengths[i], instances=1, prompt_tokens=0)

    def v_r(stages: tuple[int, ...], batch: int) -> float:
        return sum(k * full_instance(batch, i) for i, k in enumerate(stages))

    own_batch = control.batch_size
    batches = sorted({own_batch, *(batch_sizes or [])})
    if min(batches) < 1:
        raise TuneArgError("--batch-sizes", f"a batch is at least 1 group, got {min(batches)}")
    measured = MeasuredProfile.load(profile) if profile and train_tokens_per_gpu is None else None
    trainer = measured_trainer(plan, measured) if measured is not None else None  # the plan's batch split, read once
    group_size, mean_length = rollouts[0][1]["group_size"], expected_length(lengths[0])

    def measured_speed(train_gpus: int, batch: int) -> float:
        """The measured trainer's tokens/s on a batch of mean-length responses, one rank per train GPU."""
        rows = batch * group_size
        return rows * mean_length / replace(trainer, ranks=train_gpus).step_time(rows * mean_length, rows)

    if measured is not None:
        notes.append(f"trainer from the profile's calibration run ({measured.pipeline}, {measured.trainer_ranks or 1} "
                     "rank(s)): one rank per train GPU, each rank's seconds per micro-batch as measured")
    elif train_tokens_per_gpu is None:
        half = max(len(rollouts), gpus // (2 * g))
        train_tokens_per_gpu = v_r(_divide(half, replicas), own_batch) / max(1, gpus - half * g)
        notes.append(f"trainer speed per GPU assumed {train_tokens_per_gpu:,.0f} tokens/s (balances an even split; "
                     "pass --train-tokens-per-gpu), scaling linearly with GPUs")
    splits = [(r, t) for r, t in split_grid(gpus, g) if r >= len(rollouts) * g]
    candidates = []
    even = min(splits, key=lambda s: abs(s[0] - gpus / 2))

    def make(k: int, b: int, knob: int | None, stages: tuple[int, ...] | None = None) -> Candidate:
        """The point with k rollout instances (the rest of the GPUs train), batch b and the knob; with several
        rollout stages, `stages` instances each (default: in the plan's replicas' proportions)."""
        shares = _divide(k, replicas)
        stages = stages or shares
        r, t = k * g, gpus - k * g
        vr, vt = v_r(stages, b), (measured_speed(t, b) if measured else t * train_tokens_per_gpu)
        return Candidate(r, t, k, knob, vr / vt, min(vr, vt), vt, measured_trainer=measured is not None,
                         shipped=(r, t) == even and knob == _own(control) and b == own_batch and stages == shares,
                         batch=None if b == own_batch else b,
                         stages=stages if len(rollouts) > 1 else ())

    for r, _ in splits:
        for b in batches:
            candidates.extend(make(r // g, b, knob) for knob in knob_values(control, b))
    name = knob_name(control.kind)
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
        args = [(plan, name, c.knob, dict(zip(names, c.stages)) if c.stages else c.instances, profile,
                 None if c.measured_trainer else c.train_tokens_per_s, n, s, c.batch,
                 c.train_gpus if c.measured_trainer else None) for c, n, s in todo]
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
        run([(shipped, steps, s) for s in range(seed, seed + seeds)])
        cost = shipped.runs[0]["step_events"][screen - 1] / shipped.runs[0]["events"]  # a screen's, from the full run
        if screen < steps and cost >= SCREEN_COST:
            # A short run would cost most of a full one (the rollout's warm-up before the first batch dominates:
            # streamrl and laminar at 1,024 GPUs), so screen at full length: ranking is then exact, and a contender's
            # screen is its first seed's run, one simulation fewer each.
            progress(f"tune: a {screen}-step screen would cost {cost:.0%} of a {steps}-step run (events); screening at "
                     "full length")
            screen = steps
        if screen == steps:
            shipped.screen = shipped.runs[0]

        def fastest() -> Candidate:
            """The fastest screened point within the shipped screen's max staleness and task mix."""
            return max((c for c in candidates if c.screen and eligible(c.screen, shipped.screen, limit)),
                       key=lambda c: c.screen["tokens_per_s"])

        screen_all(([] if shipped.screen else [shipped]) + [c for c in candidates if not c.shipped and c.bound >
                    shipped.runs[0]["tokens_per_s"] and not too_loose(c, shipped, name)])
        limit = shipped.screen["max_staleness"]
        n_screened = sum(1 for c in candidates if c.screen)
        progress(f"tune: {len(splits)} splits x {len(candidates) // len(splits)} settings = {len(candidates)} candidates; "
                 f"screened {n_screened} ({screen} steps each)" + (", pruned the rest: their closed-form bound is below the "
                 "shipped setting's throughput" if n_screened < len(candidates) else ", none pruned by the closed form"))
        # Refine the split: the grid has at most 9 splits, and the best one often lies between two of them. Screen the
        # splits halfway between the fastest screened point within the staleness limit and its neighbours (same knob
        # and batch), and again around the new best if it moved: a hill climb of REFINE_ROUNDS halvings.
        for _ in range(REFINE_ROUNDS):
            best = fastest()
            have = sorted({c.instances for c in candidates})
            i = have.index(best.instances)
            mids = {(best.instances + n) // 2 for n in have[max(0, i - 1):i + 2]} - set(have)
            new = [make(k, best.batch or own_batch, best.knob) for k in sorted(mids)]
            candidates.extend(new)
            screen_all([c for c in new if c.bound > shipped.runs[0]["tokens_per_s"]])
            after = fastest()
            if after is best:
                break
            progress(f"tune: refined the split: {after.rollout_gpus} rollout GPUs screen faster than {best.rollout_gpus}")
        # Several rollout stages: move instances between them at the fastest point, a step of an eighth of its
        # instances, kept while it finds a faster point and halved when it does not (the task mix limits how far).
        best = fastest()
        step = max(1, best.instances // 8)
        for _ in range(SHIFT_ROUNDS if len(rollouts) > 1 else 0):
            have = {(c.stages, c.knob, c.batch) for c in candidates}
            new = []
            for i, j in ((i, j) for i in range(len(rollouts)) for j in range(len(rollouts)) if i != j):
                moved = list(best.stages)
                move = min(step, moved[i] - 1)
                moved[i] -= move
                moved[j] += move
                if move and (tuple(moved), best.knob, best.batch) not in have:
                    new.append(make(best.instances, best.batch or own_batch, best.knob, tuple(moved)))
            candidates.extend(new)
            screen_all([c for c in new if c.bound > shipped.runs[0]["tokens_per_s"]])
            after = fastest()
            if after is best:
                step //= 2
                if not step:
                    break
            else:
                progress(f"tune: instances per rollout stage {'/'.join(map(str, after.stages))} screen faster than "
                         f"{'/'.join(map(str, best.stages))}")
            best = after
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


def eligible(r: dict, shipped: dict, limit: int) -> bool:
    """A result that may be recommended against the shipped setting's (same length and seeds): within its max
    staleness (the plan's bound is a statement about learning, not only speed), and with several rollout stages, each
    stage's share of trained samples within MIX_TOLERANCE of the shipped one's. Stages admit work as fast as they
    can, so more instances for the stage with long answers shift the task mix toward it; a point must not win by
    training another mix of tasks than the plan's."""
    return r["max_staleness"] <= limit and all(abs(r["shares"][n] - share) <= MIX_TOLERANCE
                                               for n, share in shipped.get("shares", {}).items())


def _contenders(screened: list[Candidate], shipped: Candidate, limit: int) -> list[Candidate]:
    """The CONTENDERS fastest screened points within the shipped screen's max staleness, one per screening run:
    points whose screen was one run (queue capacities the queue never reached, _reuse) cannot be told apart by it,
    so a slot goes to one of them, the one whose knob is nearest the shipped one; none to the shipped setting's own."""
    runs: dict[int, list[Candidate]] = {}
    for c in screened:
        if eligible(c.screen, shipped.screen, limit):
            runs.setdefault(id(c.screen), []).append(c)
    runs.pop(id(shipped.screen), None)
    picks = [min(same, key=lambda c: abs(c.knob - shipped.knob) if c.knob is not None else 0) for same in runs.values()]
    return sorted(picks, key=lambda c: -c.screen["tokens_per_s"])[:CONTENDERS]


def _point(c: Candidate, steps: int, seed: int) -> tuple:
    """What a simulation depends on besides the staleness knob."""
    return c.stages or c.instances, c.batch, c.train_tokens_per_s, steps, seed


def _reuse(same: dict, c: Candidate, steps: int, seed: int) -> dict | None:
    """The result of an identical run already simulated, if one is known. A queue policy's capacity acts only by
    dropping the oldest completed group when the queue holds more than it (operators/queues.py, occupy): a run whose
    queue peaked at P groups without a drop runs step for step the same with any capacity >= P (same seed, split,
    batch and length), so its result is that point's."""
    for peak, r in same.get(_point(c, steps, seed), ()):
        if c.knob is not None and peak <= c.knob:
            return r
    return None


def too_loose(c: Candidate, shipped: Candidate, name: str | None) -> bool:
    """An eta above both the shipped eta and the shipped setting's max staleness (full length), off the shipped split:
    not worth a screen. Such a point is either over that staleness (the bound binds: it cannot be recommended) or
    within it (the bound never binds: it runs as a tighter eta does, which is screened). At the shipped split it is
    screened anyway, for the Pareto table."""
    return (name == "eta" and c.knob > max(shipped.knob, shipped.runs[0]["max_staleness"])
            and c.rollout_gpus != shipped.rollout_gpus)


def simulate_point(plan: Plan | dict, name: str | None, knob, instances: int, profile: str,
                   train_tokens_per_s: float | None, steps: int, seed: int, batch: int | None = None,
                   train_ranks: int | None = None) -> dict:
    """One candidate simulated (a module-level function, so worker processes can run it). train_tokens_per_s None:
    the profile's measured trainer, at train_ranks ranks."""
    from rlflow.sim import simulate
    from rlflow.sim.from_plan import sim_config
    from rlflow.sim.loop import build_policy

    p = copy.deepcopy(Plan.of(plan).raw)  # the plan as written, with this point's knob and batch written in
    if name:
        p["control"]["staleness"][name] = knob
    if batch is not None:
        p["control"]["staleness"]["batch_size"] = batch
    config, _ = sim_config(Plan.of(p), steps=steps, mode="cost_model", instances=instances, profile=profile,
                           train_tokens_per_s=train_tokens_per_s, seed=seed, trainer_ranks=train_ranks)
    policy = build_policy(config)  # ours, to read its peak queue after the run
    r = simulate(config, policy)
    return {"tokens_per_s": r.trained_tokens_per_s, "mean_staleness": r.mean_staleness,
            "max_staleness": r.max_staleness, "rollout_idle": r.rollout_idle_ratio, "trainer_idle": r.trainer_idle_ratio,
            "peak_queued": getattr(policy, "peak_queued", 0), "events": r.events, "step_events": r.step_events,
            "shares": {n: st["trained_share"] for n, st in r.stages.items()} if len(r.stages) > 1 else {}}


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
    out = {k: sum(r[k] for r in runs) / len(runs) for k in runs[0] if k not in ("shares", "step_events")}
    out["shares"] = {n: sum(r["shares"][n] for r in runs) / len(runs) for n in runs[0]["shares"]}
    out["max_staleness"] = max(r["max_staleness"] for r in runs)
    out["peak_queued"] = max(r["peak_queued"] for r in runs)
    return out


def _own(control: Staleness) -> int | None:
    name = knob_name(control.kind)
    return getattr(control, name) if name else None


def _dominates(a: Candidate, b: Candidate) -> bool:
    """On the screening runs (every screened point has one, same length and seed)."""
    ra, rb = a.screen, b.screen
    return (ra["tokens_per_s"] >= rb["tokens_per_s"] and ra["mean_staleness"] <= rb["mean_staleness"]
            and (ra["tokens_per_s"] > rb["tokens_per_s"] or ra["mean_staleness"] < rb["mean_staleness"]))


def _divide(k: int, weights: list[int]) -> tuple[int, ...]:
    """k instances over stages in proportion to `weights` (largest remainders), at least one each."""
    n = len(weights)
    spare = k - n
    exact = [spare * w / sum(weights) for w in weights]
    out = [int(x) for x in exact]
    for i in sorted(range(n), key=lambda i: out[i] - exact[i])[:spare - sum(out)]:
        out[i] += 1
    return tuple(1 + x for x in out)
