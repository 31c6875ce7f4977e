"""Does `rlflow tune` earn its keep? Every shipped pipeline's own settings against the tuner's recommendation.

python benchmarks/tune_vs_shipped.py                       # 64 GPUs at 30 steps, 1,024 GPUs at 20 steps; writes
                                                           # benchmarks/results/tune_vs_shipped.md
python benchmarks/tune_vs_shipped.py --workload staleflow  # StaleFlow's response lengths instead of the pipelines';
                                                           # writes benchmarks/results/tune_vs_shipped_staleflow_lengths.md

On StaleFlow's Table 4 profile (configs/profiles/staleflow-table4-qwen3-30b-a3b.json, 2 GPUs per rollout
instance), at B = 128 groups x 16 (the README's 64-GPU `rlflow tune` example: `--set stages.buffer.batch_groups=128
--set stages.rollout.group_size=16 --set stages.rollout.max_running=256`, applied to every rollout stage; a queue's
capacity is scaled with the batch, keeping q), each pipeline keeps its own policy, staleness knob, coordination and
(by default) workload block. "Shipped" is the pipeline's own setting at an even rollout/train split, the tuner's
baseline; "tuned" is `choose(tune(...))`. Both come from the same `tune` call (same steps, means over the tuner's
seeds 0 and 1); one more column re-simulates the two points with a seed the tuner did not use, so a win that is only
seed noise shows up.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import time
from pathlib import Path

from rlflow.compiler import compile_pipeline
from rlflow.errors import PipelineInvalid
from rlflow.plan_model import Plan
from rlflow.plan_read import rollout_order, rollout_stages
from rlflow.sim.from_plan import not_simulable
from rlflow.tune import Candidate, knob_name, simulate_point, tune
from rlflow.tune_report import choose

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "tune_vs_shipped.md"
PROFILE = str(ROOT / "configs" / "profiles" / "staleflow-table4-qwen3-30b-a3b.json")
PER_INSTANCE = 2
STALEFLOW_LENGTHS = ["workload.mean_length=4096", "workload.tailness=60", "workload.length_cap=20480"]


def staleflow_lengths(path: Path) -> list[str]:
    """StaleFlow's lengths for the pipeline. A stage with lengths of its own (workload.stages: mixed.yaml) keeps its
    shape: a long-tailed stage gets StaleFlow's; a stage without a tail gets fixed lengths a quarter as long (1,024,
    cap 2,048), as mixed.yaml's sums (3 tokens) are a quarter of its repeats (12)."""
    sets = list(STALEFLOW_LENGTHS)
    for name, own in (Plan.of(compile_pipeline(path)).pipeline["workload"].get("stages") or {}).items():
        if own.get("tailness"):
            sets += [f"workload.stages.{name}.{k}" for k in ("mean_length=4096", "tailness=60", "length_cap=20480")]
        else:
            sets += [f"workload.stages.{name}.{k}" for k in ("mean_length=1024", "tailness=0", "length_cap=2048")]
    return sets


def scale_overrides(path: Path, batch: int = 128) -> list[str]:
    """B = `batch` groups x 16, up to 256 running per instance, on every rollout stage of the pipeline; a queue's
    capacity keeps its q = capacity / batch."""
    plan = Plan.of(compile_pipeline(path))
    stages = plan.pipeline["stages"]
    sets = [f"stages.{name}.batch_groups={batch}" for name, s in stages.items() if s["kind"] == "buffer"]
    control = plan.staleness
    if control.capacity is not None:
        edge = next(i for i, e in enumerate(plan.pipeline["edges"]) if "capacity" in e["policy"])
        sets.append(f"edges.{edge}.policy.capacity={control.capacity * batch // control.batch_size}")
    for name in rollout_stages(plan):
        sets += [f"stages.{name}.group_size=16", f"stages.{name}.max_running=256"]
    return sets


def resimulate(plan: Plan, c: Candidate, *, steps: int, seed: int) -> float:
    """Trained tokens/s of candidate `c` with another seed."""
    name = knob_name(plan.staleness.kind)
    instances = dict(zip(rollout_order(plan), c.stages)) if c.stages else c.instances  # the order tune uses
    return simulate_point(plan, name, c.knob, instances, PROFILE, c.train_tokens_per_s, steps, seed)["tokens_per_s"]


def _cpu() -> float:
    """CPU seconds of this process and its finished children (the tuner's worker processes)."""
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + kids.ru_utime + kids.ru_stime


def point(c: Candidate, name: str | None) -> str:
    per_stage = f" ({' + '.join(str(k * PER_INSTANCE) for k in c.stages)})" if c.stages else ""
    return f"{c.rollout_gpus}{per_stage}/{c.train_gpus}" + (f", {name} {c.knob}" if name else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="simulated steps per candidate at 64 GPUs (default 30)")
    parser.add_argument("--steps-1024", type=int, default=20, help="simulated steps per candidate at 1,024 GPUs and more (default 20)")
    parser.add_argument("--gpus", default="64,1024", help="comma-separated GPU budgets (default 64,1024)")
    parser.add_argument("--pipelines", default=None, help="comma-separated pipeline names (default: every pipelines/*.yaml)")
    parser.add_argument("--check-seed", type=int, default=7,
                        help="seed of the re-simulation (default 7; the tuner uses 0 and 1)")
    parser.add_argument("--workload", choices=("pipeline", "staleflow"), default="pipeline",
                        help="response lengths: each pipeline's workload block (default), or StaleFlow's "
                             "(lognormal, mean 4096, tailness 60, cap 20480, as in benchmarks/sim_speed.py)")
    parser.add_argument("--batch", type=int, default=128, help="groups per training step (default 128, x 16 each)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                        help="simulations at once, as `rlflow tune --jobs` (default: the CPU count)")
    parser.add_argument("--resume", action="store_true",
                        help="keep the rows of a stopped run's results file and measure only the missing ones")
    args = parser.parse_args()
    names = args.pipelines.split(",") if args.pipelines else sorted(p.stem for p in (ROOT / "pipelines").glob("*.yaml"))
    budgets = [int(g) for g in args.gpus.split(",")]
    rows, skipped, at_bound, started = [], [], [], time.perf_counter()
    if args.resume and output(args).is_file():
        old = output(args).read_text().splitlines()
        rows = [line for line in old if line.startswith("| ") and line.count("|") == 17 and not line.startswith("| pipeline")]
        at_bound = [x for line in old if line.startswith("At the closed-form bound")
                    for x in line.rsplit("): ", 1)[1].rstrip(".").split(", ")]
        args.resumed = len(rows)
    measured = {(r.split("|")[1].strip(), int(r.split("|")[3].strip().replace(",", ""))) for r in rows}
    for name in names:
        path = ROOT / "pipelines" / f"{name}.yaml"
        try:
            plan = Plan.of(compile_pipeline(path, scale_overrides(path, args.batch)
                                            + (staleflow_lengths(path) if args.workload == "staleflow" else [])))
        except PipelineInvalid as e:  # e.g. smollm2 without its extra installed
            skipped.append(f"| {name} | does not compile here: {e.problems[0].message} |")
            print(skipped[-1], flush=True)
            continue
        why = not_simulable(plan)
        if why:
            skipped.append(f"| {name} | {why} |")
            print(skipped[-1], flush=True)
            continue
        kind = plan.staleness.kind
        knob = knob_name(kind)
        for gpus in budgets:
            if (name, gpus) in measured:
                continue
            steps = args.steps_1024 if gpus >= 1024 else args.steps
            wall, cpu = time.perf_counter(), _cpu()
            candidates, _ = tune(plan, gpus=gpus, steps=steps, profile=PROFILE, per_instance=PER_INSTANCE,
                                 jobs=args.jobs, progress=lambda *a: None)
            wall, cpu = time.perf_counter() - wall, _cpu() - cpu
            shipped = next(c for c in candidates if c.shipped)
            best = choose(candidates)
            s, b = shipped.result, best.result
            if best is shipped:
                check = "1.00 (same point)"
            else:
                ratio = (resimulate(plan, best, steps=steps, seed=args.check_seed)
                         / resimulate(plan, shipped, steps=steps, seed=args.check_seed))
                check = f"{ratio:.2f}"
            ran = sum(1 for c in candidates if c.screen)
            same = [c.screen["tokens_per_s"] for c in candidates if c.screen and c.knob == shipped.knob]
            if shipped.result["tokens_per_s"] >= 0.999 * shipped.bound:
                at_bound.append(f"{name} at {gpus:,} GPUs")
            rows.append(
                f"| {name} | {kind} | {gpus:,} | {steps} | {point(shipped, knob)} | {s['tokens_per_s']:,.0f} |"
                f" {s['mean_staleness']:.2f} / {s['max_staleness']} | {point(best, knob)} | {b['tokens_per_s']:,.0f} |"
                f" {b['mean_staleness']:.2f} / {b['max_staleness']} | {b['tokens_per_s'] / s['tokens_per_s']:.2f} |"
                f" {check} | {max(same) / shipped.screen['tokens_per_s']:.3f} ({len(same)}) | {ran} / {len(candidates)} | {wall:.0f} | {cpu:.0f} |")
            print(rows[-1], flush=True)
            write(args, rows, skipped, at_bound, time.perf_counter() - started)
    write(args, rows, skipped, at_bound, time.perf_counter() - started, done=True)


def output(args) -> Path:
    return RESULTS.with_name("tune_vs_shipped" + ("_staleflow_lengths" if args.workload == "staleflow" else "")
                             + (f"_b{args.batch}" if args.batch != 128 else "") + ".md")


def write(args, rows: list[str], skipped: list[str], at_bound: list[str], total: float, done: bool = False) -> None:
    """The results file, rewritten after every row (a long run that is stopped keeps what it measured)."""
    header = (
        "# `rlflow tune` against every shipped pipeline's settings\n\n"
        f"`python benchmarks/tune_vs_shipped.py --steps {args.steps} --steps-1024 {args.steps_1024} --gpus {args.gpus}"
        f" --workload {args.workload}` on {platform.processor() or platform.machine()}, Python"
        f" {platform.python_version()}, {total:.0f} s{' in all' if done else ' so far (unfinished)'}"
        + (f" (resumed: {args.resumed} rows from a stopped run of the same command; its time not counted)"
           if getattr(args, "resumed", 0) else "")
        + f" (2 CPU cores, `--jobs {args.jobs}`; other work ran beside it at times: wall"
        " times are inflated, CPU times less so).\n\n"
        "StaleFlow's Table 4 profile (configs/profiles/staleflow-table4-qwen3-30b-a3b.json), 2 GPUs per rollout instance,"
        f" B = {args.batch} groups x 16 on every pipeline (`--set stages.buffer.batch_groups={args.batch} --set"
        " stages.<rollout>.group_size=16 --set stages.<rollout>.max_running=256`; streamrl's queue capacity 16 groups"
        f" at B = 8 becomes {16 * args.batch // 8}, q = 2). "
        + ("Response lengths: each pipeline's own workload block (8-48 tokens: the tiny model's budgets)."
           if args.workload == "pipeline" else
           "Response lengths: StaleFlow's (`--set workload.mean_length=4096 --set workload.tailness=60 --set"
           " workload.length_cap=20480`: lognormal, capped at 20,480), as in benchmarks/sim_speed.py; mixed.yaml's"
           " stages keep their shape: gen_repeat StaleFlow's, gen_arith (no tail) fixed at 1,024, capped at 2,048.")
        + " Everything else is the pipeline's own (policy, eta / capacity, coordination). Trainer speed: the tuner's"
        " assumption (balances an even split at full load; linear in GPUs). Steps: simulated training steps per"
        f" confirmed candidate: {args.steps} at 64 GPUs, {args.steps_1024} at 1,024 GPUs (fewer, to keep the wall time"
        " down); screening runs are a third as long."
        " Shipped: the pipeline's own setting at an even split. Tuned: the tuner's recommendation (the fastest point"
        " whose max staleness stays within the shipped one's; within 1% is a tie, won by lower mean staleness, then"
        " by the shipped setting). Both: means over the tuner's seeds 0 and 1 (max staleness: the max)."
        f" Ratio: tuned / shipped trained tokens/s; seed {args.check_seed}: the same two points re-simulated with"
        f" seed {args.check_seed}, which the tuner did not use. Split: rollout GPUs / train GPUs. Best split: the fastest"
        " screened split at the shipped knob over the shipped (even) split, screening runs (in brackets: splits"
        " screened); 1.01 or less: no split beats the even one by more than the 1% tie band. Tune wall /"
        " CPU s: one `tune` call (CPU: its process and its worker processes).\n\n"
        "| pipeline | policy | GPUs | steps | shipped split, knob | shipped tokens/s | mean / max staleness |"
        " tuned split, knob | tuned tokens/s | mean / max staleness | ratio |"
        f" ratio, seed {args.check_seed} | best split | screened / candidates | tune wall s | tune CPU s |\n"
        "|---|---|---:|---:|---|---:|---|---|---:|---|---:|---:|---:|---:|---:|---:|\n"
    )
    order = sorted(rows, key=lambda r: (r.split("|")[1].strip(), int(r.split("|")[3].replace(",", ""))))  # resumed rows too
    text = header + "\n".join(order) + "\n"
    if at_bound:
        text += ("\nAt the closed-form bound (the shipped point's trained tokens/s is within 0.1% of min(v_R at full load,"
                 " v_T): nothing can beat it, the tuner stops after it): " + ", ".join(at_bound) + ".\n")
    if skipped:
        text += "\nNot simulated:\n\n| pipeline | why |\n|---|---|\n" + "\n".join(skipped) + "\n"
    out = output(args)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    if done:
        print(f"wrote {out} ({total:.0f} s)")


if __name__ == "__main__":
    main()
