"""Does each algorithm learn? Held-out greedy accuracy before and after, at equal steps, per `train.algo`.

    python benchmarks/bench_algorithms.py [--pipeline learn_repeat] [--algos grpo,dr_grpo,...] [--steps 60]
                                          [--mode 3] [--set KEY=VALUE ...]

For each algorithm this writes the shipped `pipelines/<pipeline>.yaml` (its buffer->train policy set by --mode: `sync`
a barrier, a number a staleness bound η) into a scratch directory and runs
`rlflow compile p.yaml --set stages.train.algo=<algo> [--set ...] && rlflow run` there as a subprocess, exactly as a
user would (benchmarks/bench_learning.py's runner). Held-out accuracy (greedy, on prompts the run never trains on) is
read back from each run's MLflow store at step 0, every --eval-every steps and at the end. The runs go one after
another. An algorithm name may carry extra overrides after a colon, `;`-separated, e.g.
`grpo-lora:algo=grpo;lora.rank=8` (the part before the colon labels the row). Prints the table and writes
benchmarks/results/algorithms.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

from bench_learning import run

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "algorithms.md"
DEFAULT_ALGOS = "grpo,dr_grpo,rloo,reinforce_pp,gspo,cispo"


def variant(spec: str) -> tuple[str, list[str]]:
    """'name' or 'label:key=value;key=value' -> (label, rlflow compile overrides under stages.train)."""
    label, _, rest = spec.partition(":")
    pairs = [kv for kv in rest.split(";") if kv] if rest else [f"algo={label}"]
    return label, [f"stages.train.{kv}" for kv in pairs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pipeline", default="learn_repeat", help="a pipeline in pipelines/ (default: learn_repeat)")
    ap.add_argument("--algos", default=DEFAULT_ALGOS, help=f"comma-separated (default: {DEFAULT_ALGOS})")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--eval-every", type=int, default=20)
    ap.add_argument("--mode", default="3", help="sync, or a staleness bound η (default 3, the pipeline's)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="passed to every rlflow compile")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-algorithms-") as scratch:
        for spec in args.algos.split(","):
            label, sets = variant(spec)
            opts = SimpleNamespace(sync_redundancy=16, steps=args.steps,
                                   set=[*args.set, f"stages.train.eval_every={args.eval_every}", *sets])
            rows.append((label, sets, run(args.pipeline, args.mode, opts, Path(scratch), label=label)))
    command = " ".join(["python benchmarks/bench_algorithms.py", *sys.argv[1:]])
    lines = [f"# Algorithms: held-out accuracy of `{args.pipeline}` before and after {args.steps} steps", "",
             f"`{command}` on {platform.machine()}, {os.cpu_count()} CPUs, one run at a time; buffer->train "
             f"{'a barrier' if args.mode == 'sync' else f'η = {args.mode}'}; each algorithm with its defaults "
             "(docs/guides/algorithms.md).", "",
             "| algorithm | overrides | steps | wall (s) | accuracy at step 0 | final accuracy | change (points) | "
             "best (step) | training reward, last steps |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for label, sets, r in rows:
        (_, _, first), (last_step, _, last) = r["curve"][0], r["curve"][-1]
        best_step, _, best = max(r["curve"], key=lambda p: p[2])
        reward = r["summary"].get("reward_last", float("nan"))  # mean over the last few steps (run_summary.py)
        lines.append(f"| {label} | `{' '.join(s.removeprefix('stages.train.') for s in sets)}` | {last_step} | "
                     f"{r['wall_s']:.0f} | {first:.3f} | {last:.3f} | {100 * (last - first):+.1f} | "
                     f"{best:.3f} ({best_step}) | {reward:.3f} |")
    lines += ["", "Curves (held-out greedy accuracy at each evaluated step):", ""]
    lines += [f"- {label}: " + ", ".join(f"{s}: {a:.3f}" for s, _, a in r["curve"]) for label, _, r in rows]
    print("\n".join(lines))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
