"""Skew-aware dispatch against how alike a prompt's samples are in length (workload.prompt_share), on the simulator.

python benchmarks/prompt_share.py    # writes benchmarks/results/prompt_share.md

StreamRL's length ranker rests on prompts having a difficulty (StreamRL §5.1: "difficulty is a property inherent
to the prompts"); its evaluation (§7) generates every sample of a prompt to that prompt's ground-truth length, a
prompt share of 1. With share 0 a group's lengths are independent draws and no prompt ranker has anything to find.
Each row is the ablation's workload (benchmarks/ablation.py: Table 4 profile, B = 128 x 16, lognormal lengths mean
4096, tailness 60, cap 20000) under one policy, with vanilla least-loaded routing or StreamRL's dispatch (Algorithm 2
over prompts, LPT within each lane), its ranker an oracle of each prompt's mean length or that times a lognormal error
(sigma 0.5). Ratios are against vanilla at the same share and policy.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

from ablation import VANILLA, config

from rlflow.sim.loop import Simulation

RESULTS = Path(__file__).resolve().parent / "results"
SHARES = (0.0, 0.5, 1.0)
POLICIES = {  # name -> (policy, eta, coordination shared by the three dispatches)
    "one_step (StreamRL's)": ("one_step", None, {**VANILLA, "weight_sync": "per_instance"}),
    "staleflow buffers, eta 2": ("staleflow", 2, VANILLA),
}
DISPATCH = {"vanilla": {}, "StreamRL, noisy ranker": {"dispatch": "skew_aware", "ranker": "noisy"},
            "StreamRL, oracle ranker": {"dispatch": "skew_aware", "ranker": "oracle"}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--instances", type=int, default=32)
    args = parser.parse_args()
    t0 = time.perf_counter()
    rows = []
    for label, (policy, eta, coord) in POLICIES.items():
        for share in SHARES:
            base = None
            for name, extra in DISPATCH.items():
                cfg = config(policy, eta, {**coord, **extra}, args.steps, args.instances)
                cfg = dataclasses.replace(cfg, lengths=dataclasses.replace(cfg.lengths, prompt_share=share))
                t = time.perf_counter()
                r = Simulation(cfg).run()
                base = base or r.trained_tokens_per_s
                rows.append((label, share, name, r, time.perf_counter() - t, r.trained_tokens_per_s / base))
                print(f"{label} share {share}: {name}: {r.trained_tokens_per_s:,.0f} tok/s ({rows[-1][-1]:.2f}x)", flush=True)
    total = time.perf_counter() - t0
    lines = [
        "# Skew-aware dispatch by prompt share (simulator)", "",
        f"`python benchmarks/prompt_share.py --steps {args.steps} --instances {args.instances}` ({total / 60:.1f} min"
        f" wall): {args.instances} cost-model instances, the ablation's workload, {args.steps} steps (first"
        f" {max(1, args.steps // 4)} excluded), seed 0. x vanilla: against least-loaded routing at the same share and policy.",
        "",
        "| policy | prompt share | dispatch | trained tokens/s | x vanilla | mean staleness | wall s |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, share, name, r, wall, ratio in rows:
        mean = sum(r.staleness) / max(1, len(r.staleness))
        lines.append(f"| {label} | {share:g} | {name} | {r.trained_tokens_per_s:,.0f} | {ratio:.2f} | {mean:.2f} | {wall:.1f} |")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "prompt_share.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {RESULTS / 'prompt_share.md'} in {total:.0f}s")


if __name__ == "__main__":
    main()
