"""`rlflow profile PIPELINE`: run the pipeline a few steps and write one profile file with everything the simulator
needs, measured as the run did it (issue 47).

The standalone profile (`rlflow profile --model`, profile.py) times the engine alone. Inside a run the same engine
shares the cores (or the GPU) with the trainer, the reward stream and the driver, runs the batch the coordinator
forms, and waits on a round trip to the driver between steps: on 2 CPU cores it decoded 4-11x slower than alone
(benchmarks/results/tune_validation.md before this command existed). So this command fits every input on a real
run of the user's own pipeline (runtime/sim_inputs.py records them):

- the engine: StaleFlow's Eq. 11 (k1..k4, Appendix B) fitted to the run's engine steps (seconds per decode
  iteration at the KV and batch each had), and hop_s, the seconds per iteration an instance waited outside its
  engine while it held work;
- the trainer: seconds per step = s_per_micro_batch * micro-batches + s_per_token * trained tokens, least squares
  over the run's steps;
- the control costs: a group's last token to scored, and a step's time beyond its compute;
- the group filter's drop rate, the weights pull, and the response lengths trained on.

The result is a configs/profiles/ file: `coordinator.profile: FILE` in the rollout stage names it, `rlflow simulate`,
`rlflow tune` and `rlflow run`'s own prediction read it.
"""

from __future__ import annotations

import json
import statistics
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

from rlflow.profile import Sample, _nonnegative_lstsq, fit_profile, machine

MIN_STEPS = 4  # trainer and control fits need this many steps past the warm-up
MIN_SPREAD = 0.25  # tokens per step must vary this much (std / mean) to fit a per-token cost


class ProfileRunError(ValueError):
    """The calibration run did not measure enough to fit an input; the message says which and what to change."""


def fit_engine(rows: list[list[float]]) -> dict:
    """k1..k4 from in-run samples (kv tokens, running, s per iteration, hop s per iteration, iterations), and
    hop_s."""
    if len(rows) < 6:
        raise ProfileRunError(f"the run's engines reported {len(rows)} decode steps with a decode count (at least 6 "
                              "are needed): run more steps (--steps), or use an engine that counts its decode "
                              "iterations (hf; vllm decodes in the background: profile it alone with "
                              "rlflow profile --engine vllm --model DIR)")
    samples = [Sample(kv, running, s) for kv, running, s, *_ in rows]
    try:
        # in seconds, each step weighted by its iterations: the fit must get the engine's total time right where it
        # spends it (in-run steps are noisy; a relative fit leans low on the slow, crowded steps)
        fit = fit_profile(samples, weights=[r[4] for r in rows], relative=False)
    except ValueError:  # every step ran the same batch: the cost is one number at that batch
        per = statistics.median(r[2] for r in rows)
        fit = {"k1": 0.0, "k2": per, "k3": 0.0, "k4": 0.0, "k5": 1.0, "crossover": 0.0, "r2": 0.0}
    # the hop is paid per engine.step call, which runs up to chunk_size iterations: its share per iteration is the
    # total over the total, not the mean of per-call ratios (a call that drained its batch after 2 iterations)
    iters = sum(r[4] for r in rows)
    fit["hop_s"] = sum(r[3] * r[4] for r in rows) / iters
    # the engine is stepped in calls of up to chunk_size iterations (hf); work routed to it joins between calls
    fit["chunk_steps"] = int(max(r[4] for r in rows))
    fit["samples"] = len(rows)
    fit["running_range"] = [min(r[1] for r in rows), max(r[1] for r in rows)]
    return fit


def fit_trainer(steps: list[dict]) -> dict:
    """Seconds per step = s_per_micro_batch * micro-batches (per rank) + s_per_token * tokens, both >= 0, least
    squares relative to each step's time.

    No fixed cost per step: a run's steps all run about the same micro-batches, so a fixed cost cannot be told from a
    per-micro-batch one, and the per-micro-batch one is what scales with the batch. Measured (issue 47): the
    quickstart's steps (16 micro-batches of 8 rows) took 0.27-0.46 s whatever their tokens (430-780), and laminar's
    batch of half the rows trained in about half the time; a line in tokens alone had fitted 0.30 s + 0 per token,
    and predicted laminar's steps as long as the quickstart's. Where the tokens per step varied less than
    MIN_SPREAD, the per-token cost is not fitted at all (it would be noise): seconds per micro-batch alone."""
    if len(steps) < MIN_STEPS:
        raise ProfileRunError(f"{len(steps)} train steps measured past the warm-up (at least {MIN_STEPS}): run more "
                              "steps (--steps)")
    tokens = np.array([s["tokens"] for s in steps], dtype=float)
    micro = np.array([max(1, s.get("micro_batches", 1)) for s in steps], dtype=float)
    t = np.array([s["step_time_s"] for s in steps], dtype=float)
    spread = float(tokens.std() / tokens.mean()) if tokens.mean() else 0.0
    per_micro = float(t.sum() / micro.sum())
    if spread < MIN_SPREAD:
        return {"base_s": 0.0, "s_per_token": 0.0, "s_per_micro_batch": per_micro, "steps": len(steps),
                "tokens_spread": spread, "law": "micro_batches"}
    a = np.column_stack([micro, tokens])
    per_mb, per_token = _nonnegative_lstsq(a / t[:, None], np.ones_like(t))
    if per_mb == 0 and per_token == 0:
        per_mb = per_micro
    return {"base_s": 0.0, "s_per_token": float(per_token), "s_per_micro_batch": float(per_mb), "steps": len(steps),
            "tokens_spread": spread, "law": "micro_batches_and_tokens"}


def fit_run(inputs: dict, summary: dict) -> dict:
    """Every measured input of the profile, from a run's sim_inputs.json and summary.json."""
    engine = fit_engine(inputs["engine_steps"]["rows"])
    trainer = fit_trainer(inputs["steps"])
    control = {"reward_latency_s": statistics.median(inputs["reward_latency_s"]) if inputs["reward_latency_s"] else 0.0,
               "step_control_s": statistics.median(s["control_s"] for s in inputs["steps"]),
               "route_s": statistics.median(inputs["route_delay_s"]) if inputs.get("route_delay_s") else 0.0}
    scored = inputs["groups_scored"]
    drop = inputs["groups_filtered"] / scored if scored else 0.0
    workload = summary.get("workload_measured") or {}
    if not workload:
        raise ProfileRunError("the run trained fewer than two groups: no response lengths measured; run more steps")
    pull = statistics.median(inputs["pull_s"]) if inputs["pull_s"] else 0.0
    return {"engine": engine, "trainer": trainer, "control": control, "filter_drop_rate": drop, "workload": workload,
            "pull_s": pull}


def profile_doc(fit: dict, *, plan, command: str, engine: str, model: str, max_running: int) -> dict:
    """The profile JSON: the engine in CostProfile's keys, the rest in sim/measured_profile.py's sections."""
    e, tr, c = fit["engine"], fit["trainer"], fit["control"]
    rollout = plan.pipeline["stages"][plan.rollout_stages()[0]]
    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    how = "rlflow profile PIPELINE (in the calibration run)"
    return {
        "name": f"{plan.name}-in-run",
        "engine": engine,
        "model": model,
        "source": f"measured {when} by `{command}` on {machine()}; engine fit R^2 = {e['r2']:.3f} over {e['samples']} "
                  f"in-run decode steps (running {e['running_range'][0]:.1f}-{e['running_range'][1]:.1f})",
        "latency": "per decode step: k1 * kv_cache + max(k2, k3 * n) + k4 + hop_s seconds",
        **{k: {"value": e[k], "from": f"{how}: least squares over the run's engine steps"} for k in ("k1", "k2", "k3", "k4")},
        "k5": {"value": 1.0, "unit": "KV units per token", "from": "engine reports KV in tokens"},
        "hop_s": {"value": e["hop_s"], "unit": "s per decode step",
                  "from": f"{how}: time an instance held work outside engine.step, per decode iteration"},
        "chunk_steps": {"value": e["chunk_steps"], "unit": "decode iterations per engine.step call",
                        "from": f"{how}: the most iterations one call ran; routed work joins between calls"},
        "kv_budget": {"value": max_running * plan.model["max_model_len"], "unit": "KV units",
                      "from": "the stage's max_running x the model's max_model_len"},
        "max_running": {"value": max_running, "from": "the stage's max_running"},
        "prefill_s_per_token": {"value": 0.0, "from": f"{how}: prefill is inside the in-run decode steps' times"},
        "pull_s": {"value": fit["pull_s"], "unit": "s per pull", "from": f"{how}: median weights load"},
        "fit": {"crossover": e["crossover"], "r2": e["r2"]},
        "measured_in_run": {"pipeline": plan.name, "data_source": plan.pipeline["data"]["source"],
                            "max_new_tokens": rollout["max_new_tokens"], "steps": plan.trainer.steps,
                            "trainer_ranks": plan.trainer.replicas, "rollout_instances": len(plan.rollouts()),
                            "source": f"{when}, {machine()}"},
        "trainer": {"base_s": {"value": tr["base_s"], "from": f"{how}: not separable from the per-micro-batch cost (every step ran "
                                                  "about the same micro-batches)"},
                    "s_per_micro_batch": {"value": tr["s_per_micro_batch"],
                                          "from": f"{how}: least squares over {tr['steps']} steps"},
                    "s_per_token": {"value": tr["s_per_token"], "from": f"{how}: the same fit"
                                    if tr["law"] != "micro_batches" else f"{how}: 0, tokens per step varied too little "
                                    f"({tr['tokens_spread']:.0%}) to fit a per-token cost"},
                    "tokens_spread": tr["tokens_spread"]},
        "control_costs": {"reward_latency_s": {"value": c["reward_latency_s"], "from": f"{how}: median per group"},
                          "step_control_s": {"value": c["step_control_s"], "from": f"{how}: median per step"},
                          "route_s": {"value": c["route_s"], "from": f"{how}: median, idle engine -> the step call "
                                                                     "carrying its next work"}},
        "filter_drop_rate": {"value": fit["filter_drop_rate"], "from": f"{how}: filtered / scored groups"},
        "workload": {k: {"value": fit["workload"][k], "from": f"{how}: trained groups"}
                     for k in ("mean_length", "tailness", "prompt_share")},
    }


def write(doc: dict, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2) + "\n")
    return path


def describe(fit: dict) -> list[str]:
    """What was measured, one line per input, for the terminal."""
    e, tr, c = fit["engine"], fit["trainer"], fit["control"]
    w = fit["workload"]
    return [f"engine (in the run): k1={e['k1']:.3g} k2={e['k2']:.3g} k3={e['k3']:.3g} k4={e['k4']:.3g} s, "
            f"hop {e['hop_s'] * 1000:.2f} ms per decode step, calls of up to {e['chunk_steps']} steps, "
            f"R^2 {e['r2']:.2f} over {e['samples']} steps",
            f"trainer: {tr['s_per_micro_batch'] * 1000:.1f} ms per micro-batch + {tr['s_per_token'] * 1000:.3f} ms per "
            f"token a step ({tr['steps']} steps)",
            f"control: {c['reward_latency_s'] * 1000:.0f} ms last token -> scored, {c['step_control_s'] * 1000:.0f} ms "
            f"per step beyond compute, {c['route_s'] * 1000:.0f} ms before an idle engine gets its work",
            f"group filter drops {fit['filter_drop_rate']:.0%}; weights pull {fit['pull_s'] * 1000:.0f} ms; lengths "
            f"mean {w['mean_length']:g}, tailness {w['tailness']:g}, prompt_share {w['prompt_share']:g}"]
