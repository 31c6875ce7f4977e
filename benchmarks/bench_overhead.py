"""Fixed costs and the control plane: time to the first step (10 vs 1,000 planned steps), the start-up
breakdown, time to exit, and what the driver costs in steady state.

    python benchmarks/bench_overhead.py [--pipeline quickstart] [--steps 10,1000] [--run-steps 12]

Each plan is `pipelines/<pipeline>.yaml` with `stages.train.steps` set to N, run as a user runs it
(`rlflow compile ... && rlflow run` in a scratch directory, one at a time). A plan of more than --run-steps
steps is stopped with Ctrl-C (SIGINT) after --run-steps steps, which also times a Ctrl-C exit (checkpoint,
export, MLflow, Ray shut down). Columns:

- first step: seconds from `rlflow run` launching (before Ray starts) to the end of the first training step,
  and the start-up timeline the run reports (run_clock.py): Ray up, model ready, MLflow open, rollout
  engines / trainer ready, initial weights published, first scored group;
- exit: seconds from the last step's progress line to the process's exit;
- control: the share of steady-state wall time the driver loop spent working (not waiting for an event);
- driver CPU: the driver process's CPU time over steady-state wall time, in cores; 2 cores here;
- stream CPU: the reward stream's host actor (Ray Data's streaming executor, moved out of the driver) over its
  life, in cores;
- engine tokens/s: completion tokens the rollout engine finished per second of its engine.step calls, per instance,
  to compare with its bare decode loop alone (`benchmarks/bench_engines.py`, the same count).
"""

from __future__ import annotations

import argparse
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from run_output import run_summary

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "overhead.md"
PHASES = ("ray", "model", "tracker", "rollout", "trainer", "publish", "first_scored", "first_step")


def run(pipeline: str, steps: int, run_steps: int, scratch: Path) -> dict:
    work = scratch / f"{pipeline}-{steps}"
    work.mkdir(parents=True)
    os.symlink(ROOT / "pipelines", work / "pipelines")
    os.symlink(ROOT / "configs", work / "configs")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cli = [sys.executable, "-m", "rlflow.cli"]
    subprocess.run([*cli, "compile", f"pipelines/{pipeline}.yaml", "--set", f"stages.train.steps={steps}"], cwd=work,
                   env=env, check=True, stdout=subprocess.DEVNULL)
    log = (work / "run.log").open("w")
    proc = subprocess.Popen([*cli, "run"], cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    last_step_t, text, stopped = None, [], False
    for line in proc.stdout:  # read as it comes: the exit is timed from the last step's line
        log.write(line)
        text.append(line)
        if line.startswith("step "):
            last_step_t = time.monotonic()
            done = int(line.split()[1].split("/")[0])
            if steps > run_steps and done >= run_steps and not stopped:
                proc.send_signal(signal.SIGINT)
                stopped = True
    rc = proc.wait()
    exit_s = time.monotonic() - last_step_t if last_step_t else float("nan")
    log.close()
    out = "".join(text)
    if rc not in ((0, 130) if stopped else (0,)):  # 130: stopped by the Ctrl-C we sent
        sys.exit(f"{pipeline} with {steps} steps: rlflow run exited {rc}; see {work / 'run.log'}")
    summary = run_summary(work, f"{pipeline} with {steps} steps")
    return {"steps": steps, "summary": summary, "exit_s": exit_s, "stopped": stopped,
            "traceback": "Traceback (most recent call last)" in out}


def table(results: list[dict]) -> list[str]:
    lines = ["| planned steps | ran | first step (s) | " + " | ".join(PHASES[:-1]) + " | exit (s) | control | driver CPU | stream CPU | engine tokens/s |",
             "|---|---|---|" + "---|" * (len(PHASES) - 1) + "---|---|---|---|---|"]
    for r in results:
        s, marks = r["summary"], r["summary"].get("startup_s", {})
        cells = [f"{marks[p]:.1f}" if p in marks else "–" for p in PHASES[:-1]]
        lines.append(f"| {r['steps']} | {s['steps']}{' (Ctrl-C)' if r['stopped'] else ''} | {marks.get('first_step', float('nan')):.1f} | "
                     + " | ".join(cells) + f" | {r['exit_s']:.1f}{' traceback!' if r['traceback'] else ''} | "
                     f"{100 * s.get('control_share', float('nan')):.2f}% | {s.get('driver_cpu_share', float('nan')):.3f} | "
                     f"{s.get('reward_stream_cpu_share') or float('nan'):.3f} | {s.get('engine_tokens_per_s') or float('nan'):.0f} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pipeline", default="quickstart")
    ap.add_argument("--steps", default="10,1000", help="planned steps, comma-separated")
    ap.add_argument("--run-steps", type=int, default=12, help="a longer plan is stopped with Ctrl-C after this many")
    args = ap.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="bench-overhead-"))  # kept: each run's log is in it
    results = []
    for n in map(int, args.steps.split(",")):
        results.append(run(args.pipeline, n, args.run_steps, scratch))
        print(f"  {n} steps: first step {results[-1]['summary'].get('startup_s', {}).get('first_step')} s, "
              f"exit {results[-1]['exit_s']:.1f} s (log: {scratch / f'{args.pipeline}-{n}' / 'run.log'})", flush=True)
    command = " ".join(["python benchmarks/bench_overhead.py", *sys.argv[1:]])
    out = [f"# Overhead: start-up, exit and the control plane (`{args.pipeline}`)", "",
           (f"`{command}` on {platform.machine()}, {os.cpu_count()} CPUs, one run at a time. Times in seconds since "
            "`rlflow run` began launching; control and driver CPU over the steady state (after the first step)."), "",
           *table(results)]
    print("\n".join(out))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text("\n".join(out) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
