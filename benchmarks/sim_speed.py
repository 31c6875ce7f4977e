"""Wall time of the simulator at StaleFlow's scale: 100 steps of B = 128 groups x 16 over 64 instances.

python benchmarks/sim_speed.py            # prints the table, writes benchmarks/results/sim_speed.md
"""

from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path

from rlflow.operators.cost_profile import CostProfile
from rlflow.sim import LengthSpec, SimConfig, TrainerModel, simulate

RESULTS = Path(__file__).resolve().parent / "results" / "sim_speed.md"

VARIANTS = [  # (policy, eta, weight_sync, partial_rollout, coordination): coordination = the coordinator's cycle
    ("staleflow", 3, "per_instance", True, {}),
    ("staleflow", 3, "global", True, {}),
    ("staleflow", 3, "global", False, {}),
    ("synchronous", None, "global", True, {}),
    # the coordinator's snapshot -> command cycle every 0.5 s, as the shipped pipelines declare it
    ("staleflow", 3, "throughput_aware", True, {"routing": "cost_model", "migration": "threshold"}),  # staleflow.yaml
    ("staleflow", 3, "per_instance", True, {"migration": "repack"}),  # laminar.yaml's coordination
    ("staleflow", 3, "global", True, {"dispatch": "skew_aware"}),  # streamrl.yaml's coordination
]


def config(policy: str, eta: int | None, sync: str, partial: bool, steps: int, instances: int = 64,
           coordination: dict | None = None) -> SimConfig:
    """StaleFlow §6.5-like workload on the Table 4 cost model (response cap 20k, lognormal lengths)."""
    return SimConfig(
        mode="cost_model",
        instances=instances,
        profile=CostProfile.load("staleflow-table4-qwen3-30b-a3b"),
        lengths=LengthSpec(kind="lognormal", mean=4096, tailness=60, cap=20480),
        prompt_tokens=256,
        group_size=16,
        batch_groups=128,
        policy=policy,
        eta=eta,
        weight_sync=sync,
        partial_rollout=partial,
        trainer=TrainerModel(base_s=5.0, s_per_token=1.5e-5),
        steps=steps,
        warmup_steps=10,
        seed=0,
        **(coordination or {}),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--instances", type=int, default=64,
                        help="cost-model instances (Table 4: 2 GPUs each; 512 = 1,024 GPUs)")
    args = parser.parse_args()
    rows = []
    for policy, eta, sync, partial, coordination in VARIANTS:
        cfg = config(policy, eta, sync, partial, args.steps, args.instances, coordination)
        wall, cpu = time.perf_counter(), time.process_time()
        r = simulate(cfg)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        sync_name = sync if sync != "global" else ("global (partial)" if partial else "global (barrier)")
        coordinated = ", ".join(f"{k} {v}" for k, v in coordination.items()) or "-"
        rows.append(
            f"| {policy} | {'-' if eta is None else eta} | {sync_name} | {coordinated} | {wall:.2f} | {cpu:.2f} | {r.events:,} |"
            f" {r.consumed * cfg.group_size:,} | {r.sim_time_s:,.0f} | {r.trained_tokens_per_s:,.0f} |"
            f" {r.mean_staleness:.2f} | {r.trainer_idle_ratio:.0%} | {r.rollout_idle_ratio:.0%} |"
        )
        print(rows[-1], flush=True)
    header = (
        f"# Simulator speed\n\n`python benchmarks/sim_speed.py --steps {args.steps} --instances {args.instances}` on {platform.processor() or platform.machine()},"
        f" Python {platform.python_version()}.\n\n{args.steps} train steps of B = 128 groups x 16 = 2048 trajectories,"
        f" {args.instances} cost-model instances = {2 * args.instances:,} GPUs"
        " (configs/profiles/staleflow-table4-qwen3-30b-a3b.json, 2 GPUs per instance), lognormal lengths"
        " (mean 4096, tailness 60, cap 20480), 256-token prompts, trainer 5 s + 1.5e-5 s/token.\n\n"
        "Coordinator: '-' is the fleet's own least-loaded routing; otherwise the coordinator's snapshot -> command cycle"
        " every 0.5 simulated s (StaleFlow Algorithm 1) with the strategies named, as the shipped pipelines declare"
        " them (staleflow.yaml, laminar.yaml, streamrl.yaml).\n\n"
        "| policy | eta | weight sync | coordinator | wall s | CPU s | events | trajectories trained | virtual s |"
        " trained tokens/s | mean staleness | trainer idle | rollout idle |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    out = RESULTS if args.instances == 64 else RESULTS.with_name(f"sim_speed_{2 * args.instances}gpus.md")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(header + "\n".join(rows) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
