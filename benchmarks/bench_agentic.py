"""Multi-turn agentic rollouts, synchronous vs bounded-async, with environment latency: measured and simulated.

    python benchmarks/bench_agentic.py [--steps 16] [--latency 0.5] [--modes sync,2] [--set KEY=VALUE ...]

Runs `pipelines/agentic_calc.yaml` (the calculator environment, in the sandbox, plus a simulated latency per
call: `env_kwargs.latency_s`, exponential) once per mode with `rlflow compile && rlflow run` in a scratch
directory, as a user would, one after another (bench_learning.py's harness; held-out evaluation off, so only
training runs). `sync` is a barrier (η = 0: generate the batch on the current weights, train, repeat); a number
is a staleness bound η. Steady-state throughput is trained episodes per second over steps 2..N (the first
step carries start-up); the table gives each mode as a ratio of the synchronous run's.

Then the simulator (`rlflow simulate`'s engine, rlflow/sim/) runs the same compiled plans with the rates the
synchronous run measured (rollout tokens/s inside the run, the trainer's tokens/s, mean episode length and turns,
the environment latency as configured) and predicts the same ratio: the "predicted" column. Prints the table and
writes benchmarks/results/agentic.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "agentic.md"
PIPELINE = "agentic_calc"
PROFILE = ROOT / "configs" / "profiles" / "tiny-llama-hf.json"


def _harness():
    spec = importlib.util.spec_from_file_location("bench_learning", Path(__file__).with_name("bench_learning.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def history(db: Path, run_id: str, key: str) -> list[float]:
    """The values of the run-row key `key` (`tokens`, `step_time_s`, ...), by step, under its MLflow name."""
    from mlflow.tracking import MlflowClient

    from rlflow.runtime.metric_names import mlflow_key

    client = MlflowClient(tracking_uri=f"sqlite:///{db}")
    return [m.value for m in sorted(client.get_metric_history(run_id, mlflow_key(key)), key=lambda m: m.step)]


def measure(result: dict, work: Path) -> dict:
    """Steady-state figures of one run from its summary and its MLflow history."""
    s = result["summary"]
    db, run_id = work / "mlflow.db", s["mlflow_run_id"]
    per_s = history(db, run_id, "trajectories_per_s")
    tokens, step_time = history(db, run_id, "tokens"), history(db, run_id, "step_time_s")
    batch = s["counters"]["consumed"] / s["steps"]
    walls = [batch / r for r in per_s[1:] if r > 0]  # steps 2..N
    lengths = history(db, run_id, "length_mean")
    env_tokens = s["env_tokens"] / max(1, s["episodes"])
    return {"episodes_per_s": len(walls) * batch / sum(walls), "wall_s": result["wall_s"],
            "generated_per_episode": sum(lengths) / len(lengths) - env_tokens, "prompt_tokens": prompt_tokens(work),
            "staleness": f"{s['staleness_mean']:.2f} / {s['staleness_max']}",
            "turns": s["episode_turns"] / max(1, s["episodes"]),
            "env_step_s": s["env_wait_s"] / max(1, s["episode_turns"] - s["episodes"]),  # per calculator call
            "rollout_tokens_per_s": s["engine_tokens_per_s"],
            "train_tokens_per_s": sum(tokens) / max(1e-9, sum(step_time)), "reward": s["reward_last"]}


def prompt_tokens(work: Path) -> float:
    """Mean prompt length of the task, in the run's tokenizer."""
    from transformers import AutoTokenizer

    from rlflow.stages import tasks
    from rlflow.stages.tiny_model import model_dir

    tok = AutoTokenizer.from_pretrained(model_dir("calc"))
    rows = tasks.calc(0, 256)
    return sum(len(tok(r["prompt"])["input_ids"]) for r in rows) / len(rows)


def simulate(work: Path, measured: dict, args) -> dict:
    """The simulator on the run's own compiled plan (its policy, sync, turns and latency law), with the
    engine's cost model measured alone on this machine (configs/profiles/tiny-llama-hf.json, the same tiny Llama
    architecture) and the synchronous run's measured trainer speed, prompt and episode lengths."""
    from rlflow.sim import simulate as run_sim
    from rlflow.sim.from_plan import sim_config

    plan = json.loads((work / ".rlflow" / "plan.json").read_text())
    plan["pipeline"]["workload"].update({"mean_length": measured["generated_per_episode"], "tailness": 0,
                                         "turns": max(1, round(measured["turns"])), "env_latency_s": measured["env_step_s"]})
    cfg, notes = sim_config(plan, steps=max(args.steps, 30), mode="cost_model", profile=str(PROFILE),
                            train_tokens_per_s=measured["train_tokens_per_s"],
                            prompt_tokens=round(measured["prompt_tokens"]), seed=0)
    result = run_sim(cfg)
    notes = notes + [(f"measured in the synchronous run and given to the simulator: trainer "
                     f"{measured['train_tokens_per_s']:.0f} tokens/s, {measured['generated_per_episode']:.1f} generated "
                     f"tokens per episode (fixed), {measured['prompt_tokens']:.0f}-token prompts, "
                     f"{round(measured['turns'])} turns, {measured['env_step_s']:.2f} s per calculator call "
                     "(sandbox and simulated latency together, queueing included)")]
    return {"episodes_per_s": result.trained_trajectories_per_s, "staleness": f"{result.mean_staleness:.2f}",
            "notes": notes}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", default="sync,2", help="sync and/or staleness bounds η (default: sync,2)")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--latency", type=float, default=0.5, help="mean simulated seconds per calculator call")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="passed to rlflow compile")
    ap.add_argument("--no-sim", action="store_true", help="measure only")
    args = ap.parse_args()
    harness = _harness()
    modes = args.modes.split(",")
    run_args = argparse.Namespace(steps=args.steps, sync_redundancy=4, set=[
        "data.eval=null", f"stages.rollout.env_kwargs.latency_s={args.latency}",
        "stages.rollout.env_kwargs.latency=exponential", *args.set])
    rows = {}
    with tempfile.TemporaryDirectory(prefix="bench-agentic-") as scratch:
        for mode in modes:
            result = harness.run(PIPELINE, mode, run_args, Path(scratch))
            work = Path(scratch) / f"{PIPELINE}-{mode}"
            rows[mode] = {"measured": measure(result, work), "work": work}
        base = rows[modes[0]]["measured"]
        for mode in modes:
            rows[mode]["predicted"] = None if args.no_sim else simulate(rows[mode]["work"], base, args)
    ref = rows[modes[0]]
    lines = [("| mode | wall (s) | trained episodes/s (steps 2..N) | vs sync | staleness mean / max | turns per episode | "
              "s per calculator call | final reward | simulated episodes/s | simulated vs sync |"),
             "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|"]
    for mode in modes:
        m, p = rows[mode]["measured"], rows[mode]["predicted"]
        ratio = m["episodes_per_s"] / ref["measured"]["episodes_per_s"]
        sim = (f"{p['episodes_per_s']:.1f} | {p['episodes_per_s'] / ref['predicted']['episodes_per_s']:.2f}×"
               if p else "– | –")
        lines.append(f"| {'η = 0 (sync)' if mode == 'sync' else f'η = {mode}'} | {m['wall_s']:.0f} | "
                     f"{m['episodes_per_s']:.1f} | {ratio:.2f}× | {m['staleness']} | {m['turns']:.2f} | "
                     f"{m['env_step_s']:.2f} | {m['reward']:.3f} | {sim} |")
    notes = [] if args.no_sim else rows[modes[0]]["predicted"]["notes"]
    command = " ".join(["python benchmarks/bench_agentic.py", *sys.argv[1:]])
    out = [f"# Agentic rollouts: `{PIPELINE}`, synchronous vs bounded-async, calculator latency {args.latency} s",
           "", f"`{command}` on {platform.machine()}, {os.cpu_count()} CPUs, one run at a time; {args.steps} steps.",
           "", *lines, "", *(f"- simulator: {n}" for n in notes)]
    print("\n".join(out))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text("\n".join(out) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
