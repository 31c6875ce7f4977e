"""The simulator's prediction against real `rlflow run`s on this machine, from one profile and no correction (issue 47).

    python benchmarks/tune_validation.py [--steps 30] [--profile-steps 20] [--points base,ifl1,...] [--keep DIR]

1. `rlflow profile pipelines/quickstart.yaml` measures, once, everything the simulator needs (the engine as it decodes
   inside a run, the trainer's seconds per step, the hops between actors, the group filter's drop rate, the
   response lengths; rlflow/profile_run.py) into one profile file, kept beside the results.
2. Every point is a real `rlflow run` of a shipped pipeline with that profile named in its rollout stage
   (`coordinator.profile`): the run prints the simulator's forecast at its start and its own measured figures and
   the error at its end (rlflow/runtime/prediction.py); this script reads them from the run's summary.json. The
   forecast is the one `rlflow simulate` makes of the same plan: no input comes from this script, none from the run
   it predicts (a test, tests/unit/test_tune_validation_inputs.py, checks that this file sets no simulator input).
3. Prints the table and writes benchmarks/results/tune_validation.md. Goals: trained tokens/s within ±15%, mean
   staleness within ±0.3, trainer and rollout idle within 15 points. Where a point misses, the simulator's notes
   for it (what it assumed rather than measured) are listed under the table.

The grid: quickstart's staleness bound (staleflow η=1, in_flight_limit η=1 and 3), queue_drop capacity (q = 1, 4), the
rollout/train ratio (max_running 4: rollout-bound; two rollout instances), length tailness (builtin:arith), a 2-rank
trainer, and the synchronous, laminar and streamrl pipelines. Runs one at a time (2 cores; each ~1 min).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from run_output import run_summary

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "tune_validation.md"
PROFILE_COPY = ROOT / "benchmarks" / "results" / "tune_validation_profile.json"
GOALS = {"tokens_per_s": 0.15, "staleness_mean": 0.3, "rollout_idle": 0.15, "trainer_idle": 0.15}
# name: (pipeline, label, --set overrides); every run also gets its step count and no periodic checkpoints
GRID = {
    "base": ("quickstart", "staleflow η=1 (quickstart)", []),
    "ifl1": ("quickstart", "in_flight_limit η=1", ["edges.3.policy.kind=in_flight_limit", "edges.3.policy.eta=1"]),
    "ifl3": ("quickstart", "in_flight_limit η=3", ["edges.3.policy.kind=in_flight_limit", "edges.3.policy.eta=3"]),
    "q1": ("quickstart", "queue_drop Q=16 (q=1)", ["edges.3.policy.queue=drop", "edges.3.policy.eta=null",
                                                   "edges.3.policy.capacity=16"]),
    "q4": ("quickstart", "queue_drop Q=64 (q=4)", ["edges.3.policy.queue=drop", "edges.3.policy.eta=null",
                                                   "edges.3.policy.capacity=64"]),
    "mr4": ("quickstart", "max_running 4 (rollout-bound)", ["stages.rollout.max_running=4"]),
    "rep2": ("quickstart", "2 rollout instances", ["stages.rollout.replicas=2", "stages.rollout.num_cpus=0.5"]),
    "arith": ("quickstart", "builtin:arith, max_new_tokens 8", ["data.source=builtin:arith",
                                                                "stages.rollout.max_new_tokens=8"]),
    "ranks2": ("quickstart", "2 trainer ranks", ["stages.train.replicas=2", "stages.train.num_cpus=0.5"]),
    "sync": ("synchronous", "synchronous pipeline", []),
    "laminar": ("laminar", "laminar pipeline", []),
    "streamrl": ("streamrl", "streamrl pipeline", []),
}


def rlflow(args: list[str], cwd: Path, timeout_s: float) -> str:
    """Run an rlflow command in `cwd`; exits with its output if it fails."""
    cmd = [str(Path(sys.executable).with_name("rlflow")), *args]  # the console script beside this interpreter
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode:
        sys.exit(f"{' '.join(args[:2])} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc.stdout


def run_point(name: str, steps: int, profile: Path, scratch: Path, timeout_s: float) -> dict:
    pipeline, label, sets = GRID[name]
    workdir = scratch / name
    workdir.mkdir(parents=True, exist_ok=True)
    train = "train"  # every pipeline of the grid names its train stage `train` and its rollout stage `rollout`
    overrides = [*sets, f"stages.{train}.steps={steps}", f"stages.{train}.checkpoint_every=0",
                 f"stages.rollout.coordinator.profile={profile}"]
    t0 = time.time()
    out = rlflow(["run", str(ROOT / "pipelines" / f"{pipeline}.yaml"), *[x for o in overrides for x in ("--set", o)]],
                 workdir, timeout_s)
    summary = run_summary(workdir, f"point {name}")
    if not summary.get("prediction"):
        sys.exit(f"point {name}: the run made no prediction; its output:\n{out[-2000:]}")
    notes = [line.removeprefix("note: ") for line in
             rlflow(["simulate", str(ROOT / "pipelines" / f"{pipeline}.yaml"), "--steps", str(steps), "-o",
                     str(workdir / "sim"), *[x for o in overrides for x in ("--set", o)]], workdir, timeout_s).splitlines()
             if line.startswith("note: ")]
    return {"name": name, "label": label, "pipeline": pipeline, "sets": sets, "wall_s": time.time() - t0,
            **summary["prediction"], "notes": notes}


def held(point: dict) -> dict[str, bool]:
    e = point["error"]
    return {k: e[k] is not None and abs(e[k]) <= GOALS[k] for k in GOALS}


def table(points: list[dict]) -> list[str]:
    lines = ["| point | trained tokens/s meas / pred (error) | mean staleness meas / pred | rollout idle meas / pred "
             "| trainer idle meas / pred | goals held |", "|---|---|---|---|---|---|"]
    for p in points:
        m, q, e, h = p["measured"], p["predicted"], p["error"], held(p)
        lines.append(f"| {p['label']} | {m['tokens_per_s']:,.0f} / {q['tokens_per_s']:,.0f} ({e['tokens_per_s']:+.0%}) "
                     f"| {m['staleness_mean']:.2f} / {q['staleness_mean']:.2f} "
                     f"| {m['rollout_idle']:.0%} / {q['rollout_idle']:.0%} | {m['trainer_idle']:.0%} / "
                     f"{q['trainer_idle']:.0%} | {sum(h.values())}/4" + ("" if all(h.values()) else " (missed: " +
                     ", ".join(k for k, ok in h.items() if not ok) + ")") + " |")
    return lines


def misses(points: list[dict]) -> list[str]:
    """For each point off a goal, what the simulator assumed there rather than measured (its notes)."""
    out = []
    for p in points:
        if all(held(p).values()):
            continue
        assumed = [n for n in p["notes"] if "measured in the profile" not in n and "from the profile" not in n]
        out.append(f"- **{p['label']}**: " + ("; ".join(assumed) if assumed else
                                             "every input was measured; the model itself misses here"))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30, help="training steps per point")
    ap.add_argument("--profile-steps", type=int, default=20, help="steps of the calibration run")
    ap.add_argument("--points", default=",".join(GRID), help=f"comma-separated, of {', '.join(GRID)}")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per command")
    ap.add_argument("--keep", help="work in this directory and keep it (default: a temporary one, removed)")
    args = ap.parse_args()
    names = args.points.split(",")
    unknown = [n for n in names if n not in GRID]
    if unknown:
        sys.exit(f"unknown points {unknown}; choose from {', '.join(GRID)}")
    scratch = Path(args.keep or tempfile.mkdtemp(prefix="tune-validation-"))
    scratch.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    profile = scratch / "profile.json"
    print(f"profiling: rlflow profile pipelines/quickstart.yaml --steps {args.profile_steps}", flush=True)
    (scratch / "profile-run").mkdir(exist_ok=True)
    out = rlflow(["profile", str(ROOT / "pipelines" / "quickstart.yaml"), "--steps", str(args.profile_steps),
                  "-o", str(profile)], scratch / "profile-run", args.timeout)
    print("\n".join(out.strip().splitlines()[-5:]), flush=True)
    shutil.copy(profile, PROFILE_COPY)
    points = []
    for name in names:
        print(f"point {name}: {GRID[name][1]}", flush=True)
        points.append(run_point(name, args.steps, profile, scratch, args.timeout))
        print("\n".join(table(points[-1:])[2:]), flush=True)
    minutes = (time.time() - t0) / 60
    all_held = sum(all(held(p).values()) for p in points)
    doc = [f"# The simulator's forecast vs real `rlflow run`s ({args.steps} steps a point, one profile, no correction)",
           "", f"`python benchmarks/tune_validation.py --steps {args.steps} --profile-steps {args.profile_steps}"
           + (f" --points {args.points}" if args.points != ",".join(GRID) else "") + f"` on {platform.machine()}, "
           f"{os.cpu_count()} CPUs, no GPU; one run at a time; {minutes:.1f} min in all. The profile: "
           f"`rlflow profile pipelines/quickstart.yaml --steps {args.profile_steps}` once "
           "(benchmarks/results/tune_validation_profile.json); each point is `rlflow run` with it named "
           "(`--set stages.rollout.coordinator.profile=...`), and its forecast and error are the run's own "
           "(summary.json `prediction`, MLflow `predicted/...`), over the steps after the simulator's warm-up.", "",
           f"Goals: trained tokens/s within ±{GOALS['tokens_per_s']:.0%}, mean staleness within ±"
           f"{GOALS['staleness_mean']}, rollout and trainer idle within {GOALS['trainer_idle'] * 100:.0f} points. "
           f"**{all_held} of {len(points)} points hold all four.**", "", *table(points), ""]
    miss = misses(points)
    if miss:
        doc += ["## Where a point misses: what the simulator assumed there instead of measuring it", "", *miss, ""]
    RESULTS.write_text("\n".join(doc))
    (RESULTS.with_suffix(".json")).write_text(json.dumps(points, indent=1) + "\n")
    print("\n".join(doc))
    if not args.keep:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
