"""What `rlflow tune` recommends and how it shows it: the choice among the confirmed points, the `--set` overrides that
apply it, and the table of what was simulated. The search itself is rlflow/tune.py."""

from __future__ import annotations

from rlflow.plan_model import Plan
from rlflow.tune import Candidate, eligible, knob_name, too_loose


def choose(candidates: list[Candidate]) -> Candidate:
    """The fastest simulated point whose max staleness (and with several rollout stages, task mix) stays within the
    shipped setting's (eligible). Only the points simulated with the most seeds (the confirmed ones)
    are eligible: a point seen on one seed only may owe its lead to that seed."""
    ran = [c for c in candidates if c.result]
    most = max(len(c.runs) for c in ran)
    ran = [c for c in ran if len(c.runs) == most]
    shipped = next((c for c in ran if c.shipped), None)
    within = [c for c in ran if not shipped or eligible(c.result, shipped.result, shipped.result["max_staleness"])] or ran
    fastest = max(c.result["tokens_per_s"] for c in within)
    # within 1% of the fastest is a tie: then lower staleness, then no change, then the split nearest even
    tied = [c for c in within if c.result["tokens_per_s"] >= 0.99 * fastest]
    total = tied[0].rollout_gpus + tied[0].train_gpus
    return min(tied, key=lambda c: (c.result["mean_staleness"], not c.shipped, abs(c.rollout_gpus - total / 2)))


def overrides(plan: Plan | dict, c: Candidate) -> list[str]:
    """The chosen point as `--set` overrides of the plan's pipeline."""
    from rlflow.sim.from_plan import plan_rollouts

    plan = Plan.of(plan)
    rollouts = [n for n, _ in plan_rollouts(plan)]
    out = [f"stages.{n}.replicas={k}" for n, k in zip(rollouts, c.stages or [c.instances])]
    knob = knob_name(plan.staleness.kind)
    if knob:
        # the edge that carries the staleness knob (not e.g. a skew-aware dispatch edge out of the data source)
        edge = next(i for i, e in enumerate(plan.pipeline["edges"]) if knob in e["policy"])
        out.append(f"edges.{edge}.policy.{knob}={c.knob}")
    if c.batch is not None:
        buffer = next(n for n, s in plan.pipeline["stages"].items() if s["kind"] == "buffer")
        out.append(f"stages.{buffer}.batch_groups={c.batch}")
    return out


def table(candidates: list[Candidate], knob: str | None) -> list[str]:
    """The screened candidates (pruned splits are summarised in one line): the full-length result where there is one
    (averaged over its seeds), else the screening run's."""
    batches = any(c.batch is not None for c in candidates)  # a batch column only when batch sizes were searched
    mixed = any(c.stages for c in candidates)  # several rollout stages: their instances and the trained task mix
    lines = [(f"| rollout GPUs{' (per stage)' if mixed else ''} | train GPUs | {knob or 'policy'} |"
              f"{' batch (groups) |' if batches else ''} bound (closed form) | trained tokens/s | mean / max staleness |"
              f"{' trained mix |' if mixed else ''} rollout idle | trainer idle | |"),
             "|---:|---:|---:|" + ("---:|" if batches else "") + "---:|---:|---|" + ("---|" if mixed else "")
             + "---:|---:|---|"]
    shipped = next(c for c in candidates if c.shipped)
    skipped = {id(c) for c in candidates if not c.screen and too_loose(c, shipped, knob)}  # not pruned: not screened
    looser = sorted({c.knob for c in candidates if id(c) in skipped})
    pruned = sorted({(c.rollout_gpus, c.bound) for c in candidates if not c.screen and id(c) not in skipped})
    g = shipped.rollout_gpus // shipped.instances
    seeds = max(len(c.runs) for c in candidates)  # a confirmed point's runs; a full-length screen is one run
    for c in sorted((c for c in candidates if c.screen),
                    key=lambda c: (c.rollout_gpus, c.stages, c.batch or 0, c.knob if c.knob is not None else -1)):
        mark = ", ".join(m for m, on in (("Pareto", c.pareto), ("shipped", c.shipped),
                                          (f"{len(c.runs)} seeds", len(c.runs) > 1), ("screened only", len(c.runs) < seeds)) if on)
        r = c.result or c.screen
        lines.append(f"| {c.rollout_gpus}" + (f" ({' + '.join(str(k * g) for k in c.stages)})" if c.stages else "")
                     + f" | {c.train_gpus} | {c.knob if c.knob is not None else '-'} | "
                     + (f"{c.batch or 'plan'} | " if batches else "") + f"{c.bound:,.0f} | "
                     f"{r['tokens_per_s']:,.0f} | {r['mean_staleness']:.2f} / {r['max_staleness']} | "
                     + (" / ".join(f"{x:.0%}" for x in r["shares"].values()) + " | " if mixed else "")
                     + f"{r['rollout_idle']:.0%} | {r['trainer_idle']:.0%} | {mark} |")
    if pruned:
        lines.append("\npruned by the closed form (bound on trained tokens/s below the shipped setting's "
                     "throughput): rollout GPUs "
                     + ", ".join(f"{r} ({b:,.0f})" for r, b in pruned))
    if looser:
        lines.append(f"\nnot screened off the shipped split: eta {', '.join(map(str, looser))}, over the shipped "
                     "setting's max staleness (eligible only where that bound never binds, and then no faster than "
                     "a tighter eta)")
    return lines
