"""A run's own forecast and its error: what the simulator predicts for this plan, said when the run starts, and the
measured figures beside it when the run ends, in the log, the summary and MLflow (`predicted/...`), so a user sees
at once whether the simulator can be trusted for their workload (issue 47).

The forecast needs a profile measured on this machine (`rlflow profile PIPELINE`, named in the rollout stage's
coordinator.profile): without one the simulator's inputs would be assumptions (a published GPU profile, the trainer
as fast as rollout), and a forecast from assumptions is not printed as one; the run says how to get one instead.
Both sides cover the same window: every step after the simulator's warm-up, w = min(10, steps // 5).
"""

from __future__ import annotations

from rlflow.plan_model import Plan

MAX_SIM_STEPS = 200  # a longer run is forecast from its first 200 steps (the steady state is reached long before)
FIGURES = (("tokens_per_s", "trained tokens/s"), ("staleness_mean", "mean staleness"),
           ("rollout_idle", "rollout idle"), ("trainer_idle", "trainer idle"))


def warmup(steps: int) -> int:
    return min(10, steps // 5)


def forecast(plan: Plan) -> tuple[dict | None, str]:
    """(the simulator's figures for this plan, or None; a line for the log)."""
    from rlflow.sim import simulate
    from rlflow.sim.from_plan import not_simulable, plan_profiles, sim_config
    from rlflow.sim.measured_profile import MeasuredProfile

    profiles = plan_profiles(plan) if not not_simulable(plan) else []
    measured = MeasuredProfile.load(profiles[0]) if profiles else None
    if measured is None:
        return None, ("prediction: none (the plan names no profile measured in a run: rlflow profile PIPELINE "
                      "measures one; name it in coordinator.profile)")
    steps = min(plan.trainer.steps, MAX_SIM_STEPS)
    try:
        config, _ = sim_config(plan, steps=steps)
        result = simulate(config)
    except Exception as e:  # a forecast never stops a run; say why there is none
        return None, f"prediction: none (the simulator could not run this plan: {type(e).__name__}: {e})"
    pred = {"tokens_per_s": result.trained_tokens_per_s, "staleness_mean": result.mean_staleness,
            "rollout_idle": result.rollout_idle_ratio, "trainer_idle": result.trainer_idle_ratio,
            "profile": str(measured.path), "warmup_steps": warmup(plan.trainer.steps), "steps_simulated": steps}
    return pred, (f"prediction (simulator, profile {measured.path.name}) for steps {pred['warmup_steps'] + 1}-"
                  f"{plan.trainer.steps}: {describe(pred)}")


def describe(figures: dict) -> str:
    return (f"{figures['tokens_per_s']:,.0f} trained tokens/s, mean staleness {figures['staleness_mean']:.2f}, "
            f"rollout idle {figures['rollout_idle']:.0%}, trainer idle {figures['trainer_idle']:.0%}")


def measured(history: list[dict], skip: int) -> dict | None:
    """The same figures over the run's steps after `skip` (None if none are left)."""
    rows = [r for r in history[skip:] if r.get("tokens") and r.get("tokens_per_s")]
    if not rows:
        return None
    walls = [r["tokens"] / r["tokens_per_s"] for r in rows]
    wall = sum(walls)
    return {"tokens_per_s": sum(r["tokens"] for r in rows) / wall,
            "staleness_mean": sum(r["staleness_mean"] for r in rows) / len(rows),
            "rollout_idle": sum(r["rollout_idle_ratio"] * w for r, w in zip(rows, walls)) / wall,
            "trainer_idle": max(0.0, 1 - sum(r.get("step_time_s", 0.0) for r in rows) / wall)}


def errors(pred: dict, meas: dict) -> dict:
    """tokens/s relative, staleness absolute, idle shares in points (as issue 47's goals are stated)."""
    return {"tokens_per_s": pred["tokens_per_s"] / meas["tokens_per_s"] - 1 if meas["tokens_per_s"] else None,
            "staleness_mean": pred["staleness_mean"] - meas["staleness_mean"],
            "rollout_idle": pred["rollout_idle"] - meas["rollout_idle"],
            "trainer_idle": pred["trainer_idle"] - meas["trainer_idle"]}


def report(pred: dict, history: list[dict]) -> tuple[dict | None, list[str]]:
    """(summary block, log lines) at the run's end."""
    meas = measured(history, pred["warmup_steps"])
    if meas is None:
        return None, ["prediction: no steps after the warm-up to compare with"]
    err = errors(pred, meas)
    block = {"predicted": {k: pred[k] for k, _ in FIGURES}, "measured": meas, "error": err,
             "profile": pred["profile"], "window": f"steps {pred['warmup_steps'] + 1}-{len(history)}"}
    tok = err["tokens_per_s"]
    return block, [f"measured over {block['window']}: {describe(meas)}",
                   f"prediction error: tokens/s {tok:+.0%}" if tok is not None else "prediction error: tokens/s -",
                   f"  staleness {err['staleness_mean']:+.2f}, rollout idle {err['rollout_idle'] * 100:+.0f} points, "
                   f"trainer idle {err['trainer_idle'] * 100:+.0f} points (simulator minus run)"]


def mlflow_metrics(block: dict) -> dict:
    """predicted/<figure>, predicted/measured_<figure>, predicted/error_<figure>."""
    out = {}
    for key, _ in FIGURES:
        out[f"predicted/{key}"] = block["predicted"][key]
        out[f"predicted/measured_{key}"] = block["measured"][key]
        out[f"predicted/error_{key}"] = block["error"][key]
    return out
