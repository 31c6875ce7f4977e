"""Elastic rollout in the simulator: StreamRL's automatic rule against fixed fleets, on StaleFlow's Table 4 cost model.

python benchmarks/bench_elastic.py        # prints the table, writes benchmarks/results/elastic.md

A run that starts with too few rollout instances (rollout-bound) and one that starts with too many (trainer-bound):
each is simulated with its fixed starting fleet, with `auto` (operators/elastic_rule.py, within [1, 16]) and with the
fleet the rule ends at, fixed from the start (what a perfect plan would have picked).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from rlflow.operators.cost_profile import CostProfile
from rlflow.sim import LengthSpec, SimConfig, TrainerModel, simulate

RESULTS = Path(__file__).resolve().parent / "results" / "elastic.md"
SCENARIOS = [("rollout-bound", 2, 60.0), ("trainer-bound", 16, 400.0)]  # (name, starting instances, train step s)


def config(instances: int, t_step: float, steps: int, elastic: bool) -> SimConfig:
    """B = 32 groups x 16 of lognormal lengths (mean 4,096, cap 20k) on Table 4 instances; eta = 2 (staleflow)."""
    bounds = {"elastic_min": 1, "elastic_max": 16} if elastic else {}
    return SimConfig(mode="cost_model", coordinator=True, instances=instances,
                     profile=CostProfile.load("staleflow-table4-qwen3-30b-a3b"),
                     lengths=LengthSpec(kind="lognormal", mean=4096, tailness=60, cap=20480), prompt_tokens=256,
                     group_size=16, batch_groups=32, policy="staleflow", eta=2, trainer=TrainerModel(t_step=t_step),
                     steps=steps, warmup_steps=steps // 2, seed=0, **bounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="train steps; statistics over the second half")
    args = parser.parse_args()
    rows = []
    for name, start, t_step in SCENARIOS:
        wall = time.perf_counter()
        auto = simulate(config(start, t_step, args.steps, elastic=True))
        end = auto.scale_events[-1][2] if auto.scale_events else start
        fixed = simulate(config(start, t_step, args.steps, elastic=False))
        best = simulate(config(end, t_step, args.steps, elastic=False))
        path = " → ".join([str(start)] + [str(n) for _, _, n, _ in auto.scale_events])
        for label, r in (("fixed at start", fixed), (f"auto ({path})", auto), (f"fixed at {end} from the start", best)):
            rows.append(f"| {name} | {label} | {r.trained_tokens_per_s:,.0f} | {r.trained_tokens_per_s / fixed.trained_tokens_per_s:.2f}× "
                        f"| {r.mean_staleness:.2f} / {r.max_staleness} | {r.rollout_idle_ratio:.0%} | {r.trainer_idle_ratio:.0%} |")
        print(f"{name}: {time.perf_counter() - wall:.1f} s", flush=True)
    head = [f"Elastic rollout, simulated: Table 4 profile, B = 32 x 16, eta = 2, {args.steps} steps (statistics over the "
            "second half), auto within [1, 16] instances. Command: `python benchmarks/bench_elastic.py`.", "",
            "| workload | fleet | trained tokens/s | vs fixed at start | staleness mean / max | rollout idle | trainer idle |",
            "|---|---|---:|---:|---|---:|---:|"]
    text = "\n".join(head + rows) + "\n"
    print(text)
    RESULTS.write_text(text)
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
