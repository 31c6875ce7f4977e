"""Does `rlflow tune`'s advice hold in real runs? Its recommended setting run for real beside the shipped one (issue 47).

    python benchmarks/tune_advice.py [--steps 40] [--repeats 2] [--pipelines agentic_calc,learn_repeat,...]

What a user does before a run, then the run: for each pipeline, `rlflow profile PIPELINE` (its engine and trainer as
they run inside a run of that pipeline, on this machine), `rlflow tune PIPELINE --gpus 2 --profile ...` (this
machine's two cores: one rollout instance, one trainer rank; the tuner picks the staleness knob), then `rlflow run` of
the shipped setting and of the recommended one, `--repeats` times each, one at a time, alternating, each with the
profile named (so each run prints its own forecast and error). The table: the tuner's predicted tokens/s of both
points, the measured trained tokens/s (the run's own figure over the steps after the simulator's warm-up; mean and
range over the repeats) and the final reward (mean over the run's last reward window, averaged over the repeats).
Where the tuner recommends the shipped setting, the shipped runs answer for both.

Verdict: holds when the recommended point's mean tokens/s is at least the shipped one's less the runs' own noise (the
larger relative range of the two points' repeats, at least 5%; a tie at an optimum counts, a loss is a defect) and
its final reward is within 0.05 of the shipped one's or better.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

from run_output import run_summary
from tune_validation import rlflow

from rlflow import api

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "tune_advice.md"
PIPELINES = ["agentic_calc", "learn_repeat", "streamrl", "quickstart"]


def run(pipeline: str, sets: list[str], workdir: Path, timeout_s: float) -> dict:
    """One real run; its measured trained tokens/s, final reward and forecast error."""
    workdir.mkdir(parents=True, exist_ok=True)
    rlflow(["run", str(ROOT / "pipelines" / f"{pipeline}.yaml"), *[x for o in sets for x in ("--set", o)]], workdir,
           timeout_s)
    s = run_summary(workdir, f"{pipeline} ({workdir.name})")
    pred = s.get("prediction") or {}
    return {"tokens_per_s": pred.get("measured", {}).get("tokens_per_s"), "reward_last": s["reward_last"],
            "reward_first": s["reward_first"], "window": s["window"], "staleness_mean": s["staleness_mean"],
            "error": pred.get("error", {}).get("tokens_per_s"), "elapsed_s": s["elapsed_s"]}


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def spread(xs: list[float]) -> float:
    """(max - min) / mean of repeated runs' figures: the run-to-run noise."""
    return (max(xs) - min(xs)) / mean(xs)


def span(runs: list[dict]) -> str:
    xs = [r["tokens_per_s"] for r in runs]
    return f"{mean(xs):,.0f}" + (f" ({min(xs):,.0f}-{max(xs):,.0f})" if len(xs) > 1 else "")


def point(candidate) -> str:
    knob = f", {candidate.knob}" if candidate.knob is not None else ""
    return f"{candidate.rollout_gpus}/{candidate.train_gpus}{knob}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40, help="training steps per run (and simulated per point)")
    ap.add_argument("--pipelines", default=",".join(PIPELINES))
    ap.add_argument("--repeats", type=int, default=2, help="runs of each point")
    ap.add_argument("--profile-steps", type=int, default=20, help="steps of each pipeline's calibration run")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per run")
    ap.add_argument("--table-only", action="store_true", help="rewrite the table from the last results' JSON")
    args = ap.parse_args()
    if args.table_only:
        rows = json.loads(RESULTS.with_suffix(".json").read_text())
        return write(rows, args, minutes=json.loads(RESULTS.with_suffix(".json").read_text())[0].get("minutes", 0))
    scratch = Path(tempfile.mkdtemp(prefix="tune-advice-"))
    t0 = time.time()
    rows = []
    for pipeline in args.pipelines.split(","):
        profile = scratch / f"{pipeline}-profile.json"
        print(f"{pipeline}: rlflow profile --steps {args.profile_steps}", flush=True)
        (scratch / f"{pipeline}-profile-run").mkdir()
        rlflow(["profile", str(ROOT / "pipelines" / f"{pipeline}.yaml"), "--steps", str(args.profile_steps), "-o",
                str(profile)], scratch / f"{pipeline}-profile-run", args.timeout)
        base = [f"stages.train.steps={args.steps}", "stages.train.checkpoint_every=0",
                f"stages.rollout.coordinator.profile={profile}"]
        tuned = api.tune(ROOT / "pipelines" / f"{pipeline}.yaml", gpus=2, overrides=base, steps=args.steps,
                         profile=str(profile), jobs=os.cpu_count() or 1)
        (shipped,) = [c for c in tuned.candidates if c.shipped]
        best = tuned.best
        print(f"{pipeline}: shipped {point(shipped)}, recommended {point(best)}", flush=True)
        runs: list[list[dict]] = [[], []]
        for i in range(args.repeats):  # alternating, so a drift of the machine falls on both points alike
            runs[0].append(run(pipeline, base, scratch / f"{pipeline}-shipped-{i}", args.timeout))
            if best is not shipped:
                runs[1].append(run(pipeline, tuned.overrides, scratch / f"{pipeline}-tuned-{i}", args.timeout))
        rows.append({"pipeline": pipeline, "knob": tuned.plan.staleness.kind, "shipped": point(shipped),
                     "tuned": point(best), "same": best is shipped, "overrides": tuned.overrides,
                     "predicted": [shipped.result["tokens_per_s"], best.result["tokens_per_s"]],
                     "runs": [runs[0], runs[1] or runs[0]], "notes": tuned.notes})
        print(json.dumps(rows[-1]["runs"]), flush=True)
    rows[0]["minutes"] = (time.time() - t0) / 60
    write(rows, args, rows[0]["minutes"])


def write(rows: list[dict], args, minutes: float) -> None:
    lines = ["| pipeline | policy | shipped → tuned (split, knob) | predicted tokens/s shipped / tuned (ratio) "
             "| measured tokens/s shipped / tuned (ratio) | forecast error shipped / tuned "
             "| final reward shipped / tuned | verdict |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        (ps, pt), (s_runs, t_runs) = r["predicted"], r["runs"]
        ms, mt = (mean([x["tokens_per_s"] for x in rs]) for rs in (s_runs, t_runs))
        rs_, rt = (mean([x["reward_last"] for x in rs]) for rs in (s_runs, t_runs))
        noise = max(0.05, *(spread([x["tokens_per_s"] for x in rs]) for rs in (s_runs, t_runs)))
        if r["same"]:
            verdict = "same point (its runs answer for both)"
        else:
            verdict = ("LOSS" if mt < (1 - noise) * ms or rt < rs_ - 0.05 else "holds" if mt >= ms
                       else f"tie within the noise ({mt / ms:.2f}x)")
        lines.append(f"| {r['pipeline']} | {r['knob']} | {r['shipped']} → {r['tuned']} | {ps:,.0f} / {pt:,.0f} "
                     f"({pt / ps:.2f}) | {span(s_runs)} / {span(t_runs)} ({mt / ms:.2f}; noise ±{noise:.0%}) "
                     f"| {mean([x['error'] for x in s_runs]):+.0%} / {mean([x['error'] for x in t_runs]):+.0%} "
                     f"| {rs_:.3f} / {rt:.3f} | {verdict} |")
    doc = ["# `rlflow tune`'s advice in real runs (2 GPUs' worth: one rollout instance, one trainer rank)", "",
           f"`python benchmarks/tune_advice.py --steps {args.steps} --repeats {args.repeats}"
           + (f" --pipelines {args.pipelines}" if args.pipelines != ",".join(PIPELINES) else "")
           + f"` on {platform.machine()}, {os.cpu_count()} CPUs, no GPU; {minutes:.1f} min in all, one run at a time. "
           f"Profile: `rlflow profile PIPELINE --steps {args.profile_steps}` of each pipeline, "
           "once, then `rlflow tune PIPELINE --gpus 2 --profile` it; no correction. Split: rollout GPUs / train GPUs; knob: eta or queue "
           "capacity. Measured tokens/s: each run's trained tokens/s after the simulator's warm-up (summary.json "
           "`prediction.measured`), mean (range) over the repeats; forecast error: the runs' own (measured against "
           "the forecast each printed at its start); final reward: the mean over a run's last reward window, averaged "
           "over the repeats. Verdict: holds when the tuned point's tokens/s is at least the shipped one's less the "
           "noise (the larger relative range of the two points' repeats, at least 5%) and its final reward is within "
           "0.05 of the shipped one's or better (a tuned point below the shipped one within the noise: a tie).", "", *lines, ""]
    RESULTS.write_text("\n".join(doc))
    RESULTS.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")
    print("\n".join(doc))


if __name__ == "__main__":
    main()
