"""Does the README's "Your own task" learn? Its three files, taken from the README as written, run as a user runs them.

    python benchmarks/own_task.py [--repeats N] [--set KEY=VALUE ...]

Writes the README's `<!-- own-task: NAME -->` blocks (make_data.py, my_rewards.py, sort.yaml) into a scratch
directory, runs `python make_data.py && rlflow run sort.yaml [KEY=VALUE ...]` there as a subprocess, and reads the
run's summary.json: the policy's success rate on what it samples (reward(all): the mean of the first and of the last
10 steps), held-out greedy accuracy at each evaluation (prompts the run never trains on), and wall-clock time
including the tiny model's warm start. Prints the table and writes benchmarks/results/own_task.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "own_task.md"
BLOCK = re.compile(r"<!-- own-task: (\S+) -->\s*```\w*\n(.*?)```", re.S)


def own_task_files(readme: str) -> dict[str, str]:
    """{file name: text} of the README's own-task blocks, in order."""
    return {name: text for name, text in BLOCK.findall(readme)}


def run_once(workdir: Path, overrides: list[str]) -> dict:
    for name, text in own_task_files((ROOT / "README.md").read_text()).items():
        (workdir / name).write_text(text)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "make_data.py"], cwd=workdir, check=True)
    done = subprocess.run(["rlflow", "run", "sort.yaml", *overrides], cwd=workdir, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        sys.exit(f"rlflow run failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    summary = json.loads(next((workdir / ".rlflow" / "runs" / "sort").glob("*/summary.json")).read_text())
    return {"wall_s": wall, **summary}


def table(results: list[dict]) -> list[str]:
    head = ["run", "steps", "wall (s)", "reward(all) first 10", "last 10", "held-out sampled first", "last", "ratio",
            "held-out greedy first", "last"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for i, r in enumerate(results, 1):
        first, last = r["eval_first"], r["eval_last"]
        sampled = first["eval/sample_reward_mean"], last["eval/sample_reward_mean"]
        rows.append(f"| {i} | {r['steps']} | {r['wall_s']:.0f} | {r['reward_first']:.3f} | {r['reward_last']:.3f} | "
                    f"{sampled[0]:.3f} (step {first['step']}) | {sampled[1]:.3f} (step {last['step']}) | "
                    f"{sampled[1] / max(sampled[0], 1e-9):.2f}x | {first['eval/accuracy']:.3f} | {last['eval/accuracy']:.3f} |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=1, help="runs, one after another (each a fresh directory)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="KEY=VALUE override for sort.yaml")
    args = parser.parse_args()
    results = []
    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory(prefix="own-task-") as d:
            results.append(run_once(Path(d), args.overrides))
    command = "python benchmarks/own_task.py" + "".join(f" --set {o}" for o in args.overrides) + (
        f" --repeats {args.repeats}" if args.repeats > 1 else "")
    lines = [f"`{command}` on {platform.machine()}, Python {platform.python_version()} ({os.cpu_count()} cores; wall "
             "time includes writing the data, compiling and the tiny model's warm start on digits.jsonl).", "",
             "reward(all): the policy's success rate on the training prompts it sampled (temperature 1), the mean of "
             "the first and of the last 10 steps. Held-out: 256 prompts the run never trains on, scored at the first "
             "and the last evaluation, sampled (temperature 1, the rate RL raises) and greedy.", "",
             *table(results), ""]
    print("\n".join(lines))
    RESULTS.write_text("\n".join(lines))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
