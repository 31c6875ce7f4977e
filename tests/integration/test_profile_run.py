"""A profile measured in a real run, then a real run that names it forecasts itself and reports its error (issue 47):
the calibration run leaves sim_inputs.json with engine steps, train steps and groups; the fit of it is a profile
every reader takes; the second run's summary and MLflow hold the forecast, the measured figures and the error."""

import json

import pytest
from runs import plan_for, run_plan

from rlflow.operators.cost_profile import CostProfile
from rlflow.profile_run import fit_run, profile_doc, write
from rlflow.runtime.sim_inputs import FILE
from rlflow.sim.measured_profile import MeasuredProfile

STEPS = ["stages.train.steps=9", "stages.buffer.batch_groups=4", "stages.train.checkpoint_every=0"]


@pytest.mark.usefixtures("ray_cluster")
def test_a_profile_measured_in_a_run_makes_the_next_run_forecast_itself(workdir):
    calibration = run_plan(plan_for("quickstart", *STEPS))
    inputs = json.loads((calibration.out_dir / FILE).read_text())
    assert inputs["engine_steps"]["rows"] and len(inputs["steps"]) == 9 - 2  # past the two warm-up steps
    assert inputs["groups_scored"] >= 9 * 4 and inputs["reward_latency_s"]
    fit = fit_run(inputs, calibration.summary())
    plan = calibration.plan
    path = write(profile_doc(fit, plan=plan, command="test", engine="hf", model=plan.model["path"],
                             max_running=plan.pipeline["stages"]["rollout"]["max_running"]), workdir / "profile.json")
    assert CostProfile.load(path).k2 + CostProfile.load(path).k4 > 0
    assert MeasuredProfile.load(path).s_per_token + MeasuredProfile.load(path).s_per_micro_batch > 0

    lines = []
    run = run_plan(plan_for("quickstart", *STEPS, f"stages.rollout.coordinator.profile={path}"), log=lines.append)
    said = "\n".join(map(str, lines))
    assert "prediction (simulator, profile profile.json)" in said and "prediction error: tokens/s" in said
    block = run.summary()["prediction"]
    assert block["window"] == "steps 2-9"
    for figure in ("tokens_per_s", "staleness_mean", "rollout_idle", "trainer_idle"):
        assert block["predicted"][figure] is not None and block["measured"][figure] is not None
    assert block["measured"]["tokens_per_s"] > 0 and block["predicted"]["tokens_per_s"] > 0
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=run.tracker.uri)
    logged = client.get_run(run.tracker.run_id).data.metrics
    assert logged["predicted/tokens_per_s"] == pytest.approx(block["predicted"]["tokens_per_s"])
    assert logged["predicted/error_staleness_mean"] == pytest.approx(block["error"]["staleness_mean"])
