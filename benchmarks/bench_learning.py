"""Does RL learn? Held-out greedy accuracy over a run, synchronous vs bounded staleness, on built-in tasks.

    python benchmarks/bench_learning.py [--pipeline learn_repeat] [--modes sync,3,10] [--steps N] [--set KEY=VALUE ...]

For each mode this writes the shipped `pipelines/<pipeline>.yaml` with its buffer->train policy replaced (`sync`
is a barrier, η = 0; a number is a staleness bound η) into a scratch directory and runs
`rlflow compile p.yaml [--set ...] && rlflow run` there as a subprocess, exactly as a user would. Held-out accuracy is read
back from the run's MLflow store (eval/accuracy at each evaluated step, greedy decoding on held-out prompts the
run never trains on), with wall-clock seconds since the run started. The runs go one after another, so each has
the machine to itself. Prints the curves and the comparison table (η = N's final accuracy as a ratio of the
synchronous run's at equal steps) and writes benchmarks/results/learning.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from run_output import run_summary

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "learning.md"
POLICY = re.compile(r"\{from: buffer, +to: train, +policy: \{[^}]*\}\}")


def pipeline_text(name: str, mode: str, sync_redundancy: int = 0) -> str:
    """The shipped pipeline `name` with the buffer->train policy for `mode`."""
    text = (ROOT / "pipelines" / f"{name}.yaml").read_text()
    policy = (f"{{kind: barrier, batch_redundancy: {sync_redundancy}}}" if mode == "sync"
              else f"{{kind: staleness_bound, eta: {int(mode)}}}")
    text, n = POLICY.subn(f"{{from: buffer, to: train, policy: {policy}}}", text)
    if n != 1:
        sys.exit(f"pipelines/{name}.yaml: expected one buffer->train edge written on one line")
    return text


def run(name: str, mode: str, args, scratch: Path, label: str | None = None) -> dict:
    """One `rlflow run` (in scratch/<name>-<label or mode>); returns {wall_s, curve: [(step, seconds since start,
    accuracy)], summary}. args: sync_redundancy, steps and set (KEY=VALUE overrides for rlflow compile)."""
    work = scratch / f"{name}-{label or mode}"
    work.mkdir(parents=True)
    (work / "p.yaml").write_text(pipeline_text(name, mode, args.sync_redundancy))
    os.symlink(ROOT / "configs", work / "configs")  # the pipelines' relative paths (configs/deepspeed/...)
    sets = [*args.set, *([f"stages.train.steps={args.steps}"] if args.steps else [])]
    log = work / "run.log"
    t0 = time.perf_counter()
    with log.open("w") as out:
        cmd = [sys.executable, "-m", "rlflow.cli", "compile", "p.yaml", *(a for kv in sets for a in ("--set", kv))]
        rc = subprocess.run(cmd, cwd=work, stdout=out, stderr=subprocess.STDOUT, check=False).returncode
        if rc == 0:
            rc = subprocess.run([sys.executable, "-m", "rlflow.cli", "run"], cwd=work, stdout=out,
                                stderr=subprocess.STDOUT, check=False).returncode
    wall = time.perf_counter() - t0
    text = log.read_text()
    if rc != 0:
        sys.exit(f"{name}/{mode}: rlflow exited {rc}; see {log}\n" + "\n".join(text.splitlines()[-15:]))
    summary = run_summary(work, f"{name}/{mode}")
    curve = eval_curve(work / "mlflow.db", summary["mlflow_run_id"])
    print(f"  {name} {label or mode:>5s}: {wall:5.0f} s, accuracy " + " → ".join(f"{a:.3f}" for _, _, a in curve),
          flush=True)
    return {"wall_s": wall, "curve": curve, "summary": summary}


def eval_curve(db: Path, run_id: str) -> list[tuple[int, float, float]]:
    """(step, seconds since the run's first logged metric, eval/accuracy) from the run's MLflow store."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{db}")
    start = client.get_run(run_id).info.start_time
    history = sorted(client.get_metric_history(run_id, "eval/accuracy"), key=lambda m: m.step)
    return [(m.step, (m.timestamp - start) / 1000, m.value) for m in history]


def tables(results: dict, modes: list[str]) -> list[str]:
    lines = [("| pipeline | mode | steps | wall (s) | accuracy at step 0 | final accuracy | change (points) | "
              "final / sync's | staleness mean / max |"), "|---|---|---|---|---|---|---|---|---|"]
    for task, by_mode in results.items():
        base = by_mode.get("sync")
        for mode in modes:
            r = by_mode[mode]
            (_, _, first), (last_step, _, last) = r["curve"][0], r["curve"][-1]
            ratio = f"{last / base['curve'][-1][2]:.2f}" if base and base["curve"][-1][2] else "–"
            s = r["summary"]
            lines.append(f"| {task} | {'η = 0 (sync)' if mode == 'sync' else f'η = {mode}'} | {last_step} | "
                         f"{r['wall_s']:.0f} | {first:.3f} | {last:.3f} | {100 * (last - first):+.1f} | {ratio} | "
                         f"{s['staleness_mean']:.2f} / {s['staleness_max']} |")
    lines += ["", "Curves (held-out greedy accuracy at each evaluated step; seconds since the run started):", ""]
    for task, by_mode in results.items():
        for mode in modes:
            points = ", ".join(f"{step}: {acc:.3f} ({sec:.0f} s)" for step, sec, acc in by_mode[mode]["curve"])
            lines.append(f"- {task}, {mode}: {points}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pipeline", default="learn_repeat", help="a pipeline in pipelines/ (default: learn_repeat)")
    ap.add_argument("--modes", default="sync,3,10", help="sync and/or staleness bounds η")
    ap.add_argument("--sync-redundancy", type=int, default=16, metavar="N",
                    help="sync: extra groups per batch, so the groups a filter drops are covered in one generation round "
                         "instead of one round each (default 16; 0: a plain barrier, several rounds per step)")
    ap.add_argument("--steps", type=int, default=None, help="default: the pipeline's")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="passed to rlflow compile")
    ap.add_argument("--out", default=None, help="default: benchmarks/results/learning_<pipeline>.md")
    args = ap.parse_args()
    modes = args.modes.split(",")
    with tempfile.TemporaryDirectory(prefix="bench-learning-") as scratch:
        results = {args.pipeline: {mode: run(args.pipeline, mode, args, Path(scratch)) for mode in modes}}
    command = " ".join(["python benchmarks/bench_learning.py", *sys.argv[1:]])
    out = [f"# Learning: held-out accuracy of `{args.pipeline}`, synchronous vs bounded staleness", "",
           f"`{command}` on {platform.machine()}, {os.cpu_count()} CPUs, one run at a time. "
           f"Sync is a barrier with batch_redundancy {args.sync_redundancy} (the groups its filter drops are covered "
           "in the same generation round).", "", *tables(results, modes)]
    print("\n".join(out))
    path = Path(args.out or RESULTS.with_name(f"learning_{args.pipeline}.md"))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(out) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
