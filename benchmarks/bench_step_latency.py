"""One step's latency budget: where a training step's time goes, hop by hop, from a traced run.

    python benchmarks/bench_step_latency.py [--steps 14] [--modes sync,async] [--pipeline quickstart]

Each mode runs `pipelines/<pipeline>.yaml` as a user runs it (`rlflow compile` and `rlflow run` in a scratch
directory) with RLFLOW_HOP_TRACE set, so every process of the run writes a timestamp each time a group or a
weight version crosses a hop (rlflow/runtime/hop_trace.py lists them). sync: the buffer->train edge a barrier
(eta = 0, on-policy); async: the pipeline as shipped (the quickstart's eta = 1).

For each steady step (the first two are warm-up) the critical path runs from the driver hearing that step
s - 1 finished to it hearing that step s did: the new weights' dispatch and load, generation of the step's groups
(first member taken by the engine to last member finished, across every round of generation the group filter
asked for), the payload store, the reward stream (Ray Data: the source's pull, Score with the group filter, the output),
the driver's queue and buffer, the trainer (payloads taken from the store, compute, publish) and the result back.
A segment's time is between the last of the step's groups (or the version) crossing one hop and the next, so the
segments add up to the step. Printed per mode, with each segment's share of the step, and:

- engine compute: seconds of engine.step calls in the step's window (all instances);
- trainer compute: the trainer's forward, backward and update (taken -> computed);
- control overhead: step time less what compute cannot avoid: sync, where generation and training follow each
  other, step - (engine + trainer compute); async, where they overlap, step - max(engine, trainer compute).

Writes benchmarks/results/step_latency.md, and step_latency.json (per-hop seconds per step) for the simulator's
control cost (rlflow/sim/config.py). After each mode's table, the simulator runs the same compiled plan and its
step is set beside the measured one (`simulated step s vs measured step s, ratio`); `--write-control-costs PATH`
writes the sync mode's control costs (rlflow/sim/control_costs.py) the simulator charges by default.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from results_table import publish_table

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "step_latency.md"
WARMUP_STEPS = 2

#: the critical path of a step, in order: (segment, from hop, to hop); keys "v-" are the previous version
PATH = [
    ("weights: dispatch to the instances", "trained-", "pulling-"),
    ("weights: load into the engine", "pulling-", "loaded-"),
    ("prompts: route to the engine", "loaded-", "routed"),
    ("generation (all rounds)", "routed", "generated"),
    ("payload store: put", "generated", "stored"),
    ("reward stream: source pull", "stored", "pulled"),
    ("reward stream: Score (reward + filter)", "pulled", "scored"),
    ("reward stream: output", "scored", "streamed"),
    ("driver: stream host -> queue", "streamed", "received"),
    ("driver: buffer -> train step", "received", "consumed"),
    ("trainer: call + payload take", "consumed", "taken"),
    ("trainer: compute", "taken", "computed"),
    ("trainer: publish", "computed", "published"),
    ("driver: result + refresh", "published", "trained"),
]


def pipeline_text(pipeline: str, mode: str, steps: int) -> str:
    text = (ROOT / "pipelines" / f"{pipeline}.yaml").read_text()
    if mode == "sync" and "policy: {kind: barrier" not in text:
        import re

        text, n = re.subn(r"policy: \{kind: staleness_bound, eta: \d+\}", "policy: {kind: barrier}", text)
        if n != 1:
            raise SystemExit(f"pipelines/{pipeline}.yaml: no staleness_bound edge to make a barrier")
    return text


def run_traced(pipeline: str, mode: str, steps: int, workdir: Path) -> tuple[Path, float]:
    """compile + run in `workdir` with the hop trace on; (trace dir, wall seconds)."""
    (workdir / "p.yaml").write_text(pipeline_text(pipeline, mode, steps))
    trace = workdir / "trace"
    env = {**os.environ, "RLFLOW_HOP_TRACE": str(trace), "PYTHONUNBUFFERED": "1"}
    cli = [sys.executable, "-m", "rlflow.cli"]
    overrides = [f"stages.train.steps={steps}", "stages.train.checkpoint_every=0", "tracking.progress=false"]
    subprocess.run(cli + ["compile", "p.yaml", *overrides, "-o", "plan.json"], cwd=workdir, env=env, check=True,
                   stdout=subprocess.DEVNULL)
    t0 = time.monotonic()
    proc = subprocess.run(cli + ["run", "plan.json"], cwd=workdir, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"rlflow run ({mode}) failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return trace, time.monotonic() - t0


def read_trace(trace: Path) -> list[dict]:
    marks = []
    for f in trace.glob("*.jsonl"):
        marks += [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
    return sorted(marks, key=lambda m: m["t"])


def step_paths(marks: list[dict]) -> list[dict]:
    """Per trained step: each PATH hop's time on the critical path, plus engine compute in its window."""
    first = {"routed"}  # a group starts when its first member is taken; every other hop counts its last member
    group_t: dict[tuple[str, str], float] = {}
    version_t: dict[tuple[str, int], float] = {}
    consumed: list[tuple[float, list[str]]] = []
    decode: list[tuple[float, float]] = []
    open_decode: dict = {}
    for m in marks:
        hop, key, t = m["hop"], m["key"], m["t"]
        if hop == "consumed":
            if consumed and consumed[-1][0] == t:
                consumed[-1][1].append(key)
            else:
                consumed.append((t, [key]))
        elif hop == "decoding":
            open_decode[key] = t
        elif hop == "decoded" and key in open_decode:
            decode.append((open_decode.pop(key), t))
        elif isinstance(key, int):
            version_t.setdefault((hop, key), t) if hop in ("pulling", "loaded") else version_t.__setitem__((hop, key), t)
        else:
            k = (hop, key)
            group_t[k] = min(group_t.get(k, t), t) if hop in first else max(group_t.get(k, t), t)
    trained = sorted((k[1], t) for k, t in version_t.items() if k[0] == "trained")
    steps = []
    for (t_consumed, gids), (version, t_trained) in zip(consumed, trained, strict=False):
        prev = version - 1
        times = {}
        for hop in ("trained", "pulling", "loaded"):
            times[f"{hop}-"] = version_t.get((hop, prev))
        for hop in ("routed", "generated", "stored", "pulled", "scored", "streamed", "received"):
            vals = [group_t[(hop, g)] for g in gids if (hop, g) in group_t]
            times[hop] = (min(vals) if hop in first else max(vals)) if vals else None
        times["consumed"] = t_consumed
        for hop in ("taken", "computed", "published"):
            times[hop] = version_t.get((hop, version))
        times["trained"] = t_trained
        if any(v is None for v in times.values()):
            continue  # the first step (no previous version), or a hop this run did not cross
        start, end = times["trained-"], times["trained"]
        engine = sum(max(0.0, min(b, end) - max(a, start)) for a, b in decode)
        steps.append({"version": version, "times": times, "step_s": end - start, "engine_s": engine,
                      "trainer_s": times["computed"] - times["taken"], "groups": len(gids)})
    return steps


def summarize(steps: list[dict], mode: str) -> dict:
    steady = [s for s in steps if s["version"] > WARMUP_STEPS]
    if not steady:
        raise SystemExit(f"{mode}: no steady step traced (raise --steps)")
    seg = {}
    for name, a, b in PATH:
        # in the async mode a step's generation may start before the previous step ended: a segment is never negative
        seg[name] = statistics.mean(max(0.0, s["times"][b] - s["times"][a]) for s in steady)
    step = statistics.mean(s["step_s"] for s in steady)
    engine = statistics.mean(s["engine_s"] for s in steady)
    trainer = statistics.mean(s["trainer_s"] for s in steady)
    compute = engine + trainer if mode == "sync" else max(engine, trainer)
    return {"mode": mode, "steps": len(steady), "step_s": step, "engine_s": engine, "trainer_s": trainer,
            "overhead_s": step - compute, "segments": seg}


def table(s: dict) -> list[str]:
    lines = [f"\n### {s['mode']}: {s['step_s'] * 1000:.0f} ms per step (mean of {s['steps']} steady steps)\n",
             "| segment of the critical path | ms per step | share of the step |", "|---|---:|---:|"]
    for name, v in s["segments"].items():
        lines.append(f"| {name} | {v * 1000:.0f} | {v / s['step_s']:.0%} |")
    lines += ["", "| summary | ms per step |", "|---|---:|",
              f"| step | {s['step_s'] * 1000:.0f} |",
              f"| engine compute (engine.step, in the step's window) | {s['engine_s'] * 1000:.0f} |",
              f"| trainer compute | {s['trainer_s'] * 1000:.0f} |",
              f"| **control overhead** ({'step - engine - trainer' if s['mode'] == 'sync' else 'step - max(engine, trainer)'}) "
              f"| **{s['overhead_s'] * 1000:.0f}** |"]
    return lines


SIM_PROFILE = "tiny-llama-hf"  # the hf engine's measured cost model of builtin:tiny-llama, the shipped pipelines' model
SIM_STEPS = 50  # simulated steps (the first 10 warm-up): deterministic and cheap, so more than the run's


def simulated(plan_path: Path, s: dict, control_costs: str | None) -> dict:
    """The simulator's step on the run's own compiled plan, as `rlflow simulate` sees it (the plan's cost-model
    profile, else SIM_PROFILE; the trainer's speed from the workload block, else rho = 1) and again with the run's
    measured trainer compute per step, which leaves generation and the control costs to the simulator. Each with
    its step split as a synchronous step is: generation, reward hops, trainer compute, step control."""
    import dataclasses

    from rlflow.sim.config import TrainerModel
    from rlflow.sim.from_plan import plan_profiles, sim_config
    from rlflow.sim.loop import simulate

    plan = json.loads(plan_path.read_text())
    profile = None if plan_profiles(plan) else SIM_PROFILE
    cfg, notes = sim_config(plan, steps=SIM_STEPS, mode="cost_model", profile=profile, control_costs=control_costs)
    out = {"profile": profile or plan_profiles(plan)[0], "notes": notes}
    for key, c in (("plan", cfg), ("measured_trainer", dataclasses.replace(cfg, trainer=TrainerModel(t_step=s["trainer_s"])))):
        r = simulate(c)
        step = r.window_s / (r.steps - r.warmup_steps)
        train = statistics.mean(b - a for a, b in r.train_steps[r.warmup_steps:]) - c.step_control_s
        out[key] = {"step_s": step, "ratio": step / s["step_s"], "trainer_s": train, "reward_s": c.reward_latency_s,
                    "control_s": c.step_control_s, "generation_s": step - train - c.step_control_s - c.reward_latency_s}
    return out


def measured_parts(s: dict) -> dict:
    """A synchronous step's segments summed as the simulator splits it (they add up to the step)."""
    from rlflow.sim.control_costs import REWARD_SEGMENTS, STEP_SEGMENTS

    seg = s["segments"]
    return {"generation_s": seg["generation (all rounds)"], "reward_s": sum(seg[k] for k in REWARD_SEGMENTS),
            "trainer_s": seg["trainer: compute"], "control_s": sum(seg[k] for k in STEP_SEGMENTS)}


PARTS = [("generation_s", "generation", "the cost-model profile's decode rate"),
         ("reward_s", "group -> buffer (reward_latency_s)", "the control costs"),
         ("trainer_s", "trainer compute", "the trainer's speed"),
         ("control_s", "step control (step_control_s)", "the control costs")]


def sim_lines(s: dict) -> list[str]:
    sim = s["sim"]
    lines = [f"\n**Simulated** (`rlflow.sim` on this run's plan.json, profile {sim['profile']}, {SIM_STEPS} steps):\n"]
    rho = any(n.startswith("trainer speed assumed") for n in sim["notes"])
    for key, what in (("plan", "as compiled (trainer " + ("as fast as rollout, rho = 1" if rho else "at the workload block's speed")
                       + ")"), ("measured_trainer", f"with the run's trainer compute ({s['trainer_s'] * 1000:.0f} ms per step)")):
        p = sim[key]
        lines.append(f"- {what}: simulated step {p['step_s']:.3f} s vs measured step {s['step_s']:.3f} s, "
                     f"ratio {p['ratio']:.2f}")
    lines += [f"- {n}" for n in sim["notes"] if n.startswith("control costs")]
    if s["mode"] != "sync":
        return lines  # generation and training overlap: the parts do not add up to the step
    meas = measured_parts(s)
    lines += ["", "| part of a synchronous step | simulated, as compiled (ms) | simulated, run's trainer (ms) | measured (ms) |",
              "|---|---:|---:|---:|"]
    for key, name, _ in PARTS:
        lines.append(f"| {name} | {sim['plan'][key] * 1000:.0f} | {sim['measured_trainer'][key] * 1000:.0f} | "
                     f"{meas[key] * 1000:.0f} |")
    for key, what in (("plan", "as compiled"), ("measured_trainer", "with the run's trainer compute")):
        p = sim[key]
        worst = max(PARTS, key=lambda part: abs(p[part[0]] - meas[part[0]]))
        verdict = "within 20% of the measured step" if abs(p["ratio"] - 1) <= 0.2 else "off by more than 20%"
        lines.append(f"\n{what}: {verdict}; the largest gap is {worst[1]} ({p[worst[0]] * 1000:.0f} ms "
                     f"simulated, {meas[worst[0]] * 1000:.0f} ms measured), which comes from {worst[2]}"
                     + ("." if worst[2] == "the control costs" else ", not from the control costs."))
    return lines


def write_control_costs(path: Path, s: dict, args: argparse.Namespace) -> None:
    """The sync mode's segments as the simulator's control costs (rlflow/sim/control_costs.py)."""
    from rlflow.sim.control_costs import ControlCosts

    command = (f"python benchmarks/bench_step_latency.py --pipeline {args.pipeline} --steps {args.steps} --modes sync "
               f"--write-control-costs {path}")
    source = (f"`{command}`, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
              f"{platform.machine()} {os.cpu_count()} CPUs, sync mode, mean of {s['steps']} steady steps")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(ControlCosts.from_segments(s["segments"], source).as_json(s["segments"]), indent=1) + "\n")
    print(f"control costs written to {path}", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pipeline", default="quickstart")
    ap.add_argument("--steps", type=int, default=14)
    ap.add_argument("--modes", default="sync,async")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--write-control-costs", type=Path, metavar="PATH",
                    help="write the sync mode's control costs here (e.g. configs/control_costs/cpu-2core.json)")
    args = ap.parse_args(argv)
    if args.write_control_costs and "sync" not in args.modes.split(","):
        raise SystemExit("--write-control-costs: the control costs are measured in the sync mode; add it to --modes")
    summaries = []
    for mode in args.modes.split(","):
        with tempfile.TemporaryDirectory(prefix=f"rlflow-latency-{mode}-") as tmp:
            print(f"{mode}: running {args.steps} steps of {args.pipeline} with the hop trace on ...", flush=True)
            trace, wall = run_traced(args.pipeline, mode, args.steps, Path(tmp))
            s = summarize(step_paths(read_trace(trace)), mode)
            s["wall_s"] = wall
            if mode == "sync" and args.write_control_costs:
                write_control_costs(args.write_control_costs, s, args)
            s["sim"] = simulated(Path(tmp) / "plan.json", s, args.write_control_costs and str(args.write_control_costs))
            summaries.append(s)
            print("\n".join(table(s) + sim_lines(s)), flush=True)
    lines = ["# Step latency: where a step's time goes\n",
             f"`python benchmarks/bench_step_latency.py --pipeline {args.pipeline} --steps {args.steps} --modes {args.modes}`  ",
             f"{platform.machine()}, {os.cpu_count()} CPUs, Python {sys.version.split()[0]}; pipelines/{args.pipeline}.yaml, "
             f"steps 1-{WARMUP_STEPS} left out as warm-up. Segments are between the last of the step's consumed groups "
             "(or the version) crossing one hop and the next; they add up to the step.\n"]
    for s in summaries:
        lines += table(s) + sim_lines(s)
    publish_table(args.out, lines)
    args.out.with_suffix(".json").write_text(json.dumps(
        {"pipeline": args.pipeline, "modes": {s["mode"]: {k: v for k, v in s.items() if k != "mode"} for s in summaries}},
        indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
