"""Does each algorithm learn? Held-out greedy accuracy before and after, at equal steps, per `train.algo`.

    python benchmarks/bench_algorithms.py [--pipeline learn_repeat] [--algos grpo,dr_grpo,...] [--steps 60]
                                          [--mode 3] [--set KEY=VALUE ...]

For each algorithm this writes the shipped `pipelines/<pipeline>.yaml` (its buffer->train policy set by --mode: `sync`
a barrier, a number a staleness bound η) into a scratch directory and runs
`rlflow compile p.yaml --set stages.train.algo=<algo> [--set ...] && rlflow run` there as a subprocess, exactly as a
user would (benchmarks/bench_learning.py's runner). Held-out accuracy (greedy, on prompts the run never trains on) is
read back from each run's MLflow store at step 0, every --eval-every steps and at the end. The runs go one after
another. The rows are also kept in benchmarks/results/algorithms.json; --append adds rows to them (same label:
replaced), so a new algorithm joins the table without rerunning the others. An algorithm name may carry extra overrides after a colon, `;`-separated, e.g.
`grpo-lora:algo=grpo;lora.rank=8` (the part before the colon labels the row). Prints the table and writes
benchmarks/results/algorithms.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

from bench_learning import run

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "algorithms.md"
DEFAULT_ALGOS = "grpo,dr_grpo,rloo,reinforce_pp,gspo,cispo,ppo,grpo_lora:algo=grpo;lora={rank: 8};lr=1.0e-3"


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
    ap.add_argument("--append", action="store_true",
                    help="keep the rows already in --out's JSON beside it (a row of the same label is replaced)")
    args = ap.parse_args()
    out = Path(args.out)
    command = shlex.join(["python", "benchmarks/bench_algorithms.py", *sys.argv[1:]])
    saved = json.loads(out.with_suffix(".json").read_text()) if args.append and out.with_suffix(".json").exists() else {}
    rows = {r["label"]: r for r in saved.get("rows", [])}
    with tempfile.TemporaryDirectory(prefix="bench-algorithms-") as scratch:
        for spec in args.algos.split(","):
            label, sets = variant(spec)
            opts = SimpleNamespace(sync_redundancy=16, steps=args.steps,
                                   set=[*args.set, f"stages.train.eval_every={args.eval_every}", *sets])
            r = run(args.pipeline, args.mode, opts, Path(scratch), label=label)
            rows[label] = {"label": label, "sets": sets, "wall_s": r["wall_s"], "curve": r["curve"],
                           "reward_last": r["summary"].get("reward_last", float("nan")), "command": command}
    commands = list(dict.fromkeys([*saved.get("commands", []), command]))
    lines = [f"# Algorithms: held-out accuracy of `{args.pipeline}` before and after training", "",
             f"{' then '.join(f'`{c}`' for c in commands)} on {platform.machine()}, {os.cpu_count()} CPUs, one run at a "
             f"time; buffer->train {'a barrier' if args.mode == 'sync' else f'η = {args.mode}'}; each algorithm with "
             "its defaults (docs/guides/algorithms.md).", "",
             "| algorithm | overrides | steps | wall (s) | accuracy at step 0 | final accuracy | change (points) | "
             "best (step) | training reward, last steps |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows.values():
        (_, _, first), (last_step, _, last) = r["curve"][0], r["curve"][-1]
        best_step, _, best = max(r["curve"], key=lambda p: p[2])
        lines.append(f"| {r['label']} | `{' '.join(s.removeprefix('stages.train.') for s in r['sets'])}` | {last_step} | "
                     f"{r['wall_s']:.0f} | {first:.3f} | {last:.3f} | {100 * (last - first):+.1f} | "
                     f"{best:.3f} ({best_step}) | {r['reward_last']:.3f} |")
    lines += ["", "Curves (held-out greedy accuracy at each evaluated step):", ""]
    lines += [f"- {r['label']}: " + ", ".join(f"{s}: {a:.3f}" for s, _, a in r["curve"]) for r in rows.values()]
    print("\n".join(lines))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    out.with_suffix(".json").write_text(json.dumps({"commands": commands, "rows": list(rows.values())}, indent=1))
    print(f"wrote {out} and {out.with_suffix('.json')}")


if __name__ == "__main__":
    main()
