"""Ablation of rollout coordination on the simulator (StaleFlow §6.5-style): policies, strategies one at a time, baselines.

python benchmarks/ablation.py --steps 8     # writes benchmarks/results/ablation.md and ablation.png
"""

from __future__ import annotations

import argparse
import time
from collections import Counter
from pathlib import Path

from rlflow.sim import CostProfile, LengthSpec, SimConfig, TrainerModel, simulate

RESULTS = Path(__file__).resolve().parent / "results"

VANILLA = dict(coordinator=True, routing="least_loaded", weight_sync="greedy", migration="none")
# name -> (policy, takes eta, coordination); "vanilla" is R/S/M = least_loaded / greedy / none on staleflow buffers
VARIANTS = {
    "synchronous": ("synchronous", False, dict(weight_sync="global", partial_rollout=False)),
    "one_step": ("one_step", False, dict(weight_sync="per_instance")),
    "in_flight_limit": ("in_flight_limit", True, dict(weight_sync="global", partial_rollout=True)),
    "vanilla R/S/M": ("staleflow", True, VANILLA),
    "+R (cost-model routing)": ("staleflow", True, {**VANILLA, "routing": "cost_model"}),
    "+S (throughput-aware sync)": ("staleflow", True, {**VANILLA, "weight_sync": "throughput_aware"}),
    "+M (threshold migration)": ("staleflow", True, {**VANILLA, "migration": "threshold"}),
    "StaleFlow R+S+M": ("staleflow", True, dict(routing="cost_model", weight_sync="throughput_aware", migration="threshold")),
    "Laminar repack": ("staleflow", True, dict(coordinator=True, weight_sync="per_instance", migration="repack")),
    "StreamRL dispatch": ("staleflow", True, {**VANILLA, "dispatch": "skew_aware", "ranker": "noisy"}),
}


def config(policy: str, eta: int | None, coordination: dict, steps: int, instances: int) -> SimConfig:
    """Table 4 profile, B = 128 groups x 16, lognormal lengths capped at 20K, 256-token prompts."""
    return SimConfig(mode="cost_model", instances=instances, profile=CostProfile.load("staleflow-table4-qwen3-30b-a3b"),
                     lengths=LengthSpec(kind="lognormal", mean=4096, tailness=60, cap=20000), prompt_tokens=256,
                     group_size=16, batch_groups=128, policy=policy, eta=eta,
                     trainer=TrainerModel(base_s=5.0, s_per_token=1.5e-5), steps=steps, warmup_steps=max(1, steps // 4),
                     seed=0, coordinator_interval_s=1.0, **coordination)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--instances", type=int, default=32)
    parser.add_argument("--etas", type=int, nargs="+", default=[1, 2, 3])
    args = parser.parse_args()
    runs = []
    for name, (policy, takes_eta, coord) in VARIANTS.items():
        for eta in (args.etas if takes_eta else [None]):
            t = time.perf_counter()
            r = simulate(config(policy, eta, coord, args.steps, args.instances))
            runs.append((name, eta, r, time.perf_counter() - t))
            print(f"{name} eta={eta}: {r.trained_tokens_per_s:,.0f} tok/s, max staleness {max(r.staleness)} ({runs[-1][3]:.1f}s)", flush=True)
    base = next(r for n, _, r, _ in runs if n == "synchronous").trained_tokens_per_s
    lines = [
        "# Rollout-coordination ablation (simulator)", "",
        f"`python benchmarks/ablation.py --steps {args.steps} --instances {args.instances}`: {args.instances} cost-model instances"
        " (configs/profiles/staleflow-table4-qwen3-30b-a3b.json), B = 128 groups x 16, lognormal lengths (mean 4096,"
        f" tailness 60, cap 20000), 256-token prompts, trainer 5 s + 1.5e-5 s/token, {args.steps} steps"
        f" (first {max(1, args.steps // 4)} excluded), coordinator cycle every 1 s of virtual time, seed 0.", "",
        "vanilla R/S/M = staleflow buffers + least_loaded routing + greedy sync (interrupt and pull as soon as a newer"
        " version exists, partial rollout) + no migration. StreamRL uses a noisy oracle ranker (lognormal error, sigma 0.5).", "",
        "| variant | eta | trained tokens/s | x synchronous | staleness 0/1/2/3 (share) | max <= eta | pulls | wall s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, eta, r, wall in runs:
        c = Counter(r.staleness)
        n = max(1, len(r.staleness))
        dist = "/".join(f"{c.get(k, 0) / n:.2f}" for k in range(4))
        bound = {"synchronous": 0, "one_step": 1}.get(name, eta)
        ok = "yes" if max(r.staleness, default=0) <= bound else "NO"
        lines.append(f"| {name} | {'-' if eta is None else eta} | {r.trained_tokens_per_s:,.0f} |"
                     f" {r.trained_tokens_per_s / base:.2f} | {dist} | {ok} (max {max(r.staleness, default=0)}) | {r.pulls} | {wall:.1f} |")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "ablation.md").write_text("\n".join(lines) + "\n")
    _plot(runs, base, args.etas)
    print(f"wrote {RESULTS / 'ablation.md'}")


def _plot(runs, base, etas) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = list(VARIANTS)
    fig, ax = plt.subplots(figsize=(11, 4.5))
    width = 0.8 / len(etas)
    for k, eta in enumerate(etas):
        ys = [next((r.trained_tokens_per_s / base for n, e, r, _ in runs if n == name and e in (eta, None)), 0) for name in names]
        ax.bar([j + k * width for j in range(len(names))], ys, width, label=f"eta={eta}")
    ax.set_xticks([j + width * (len(etas) - 1) / 2 for j in range(len(names))], names, rotation=25, ha="right", fontsize=8)
    ax.set_ylabel("trained tokens/s / synchronous")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "ablation.png", dpi=120)


if __name__ == "__main__":
    main()
