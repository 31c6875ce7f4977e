"""A run's own measurements for the simulator (runtime/sim_inputs.py) and its forecast's error
(runtime/prediction.py), on recorded reports and rows: the samples, the hop, the control cost and the window
are what the modules say they are (issue 47)."""

import time
from pathlib import Path

import pytest

from rlflow import api
from rlflow.runtime import prediction
from rlflow.runtime.sim_inputs import SimInputs
from rlflow.stages.engine import EngineSnapshot

QUICKSTART = Path(__file__).resolve().parents[3] / "pipelines" / "quickstart.yaml"


def snap(kv, steps, tokens):
    return EngineSnapshot(instance=0, version=0, kv_cache=kv, run_trajs=["a"], wait_trajs=[], complete_trajs=0,
                          max_running=8, decode_steps=steps, decoded_tokens=tokens)


def steady():
    m = SimInputs(warmup_steps=0)
    return m


def test_the_wait_before_an_idle_engine_gets_work_is_kept_past_the_warm_up_and_written():
    m = SimInputs(warmup_steps=1)
    m.routed_idle(0.5)  # the first step pays one-off costs: not a route delay
    m.step_done({})
    m.routed_idle(0.02)
    m.routed_idle(0.04)
    assert list(m.route_delay) == [0.02, 0.04] and m.as_json(0)["route_delay_s"] == [0.02, 0.04]


def test_an_engine_step_is_one_sample_and_its_hop_counts_only_while_it_held_work():
    m = steady()
    m.engine_step("rollout", 0, snap(100, 0, 0), busy_s=0.0, pull_s=0.0, idle=False)
    time.sleep(0.05)
    m.engine_step("rollout", 0, snap(180, 10, 80), busy_s=0.02, pull_s=0.0, idle=True)
    kv, running, s_per_it, hop_per_it, iters = m.engine[-1]
    assert (kv, running, iters) == (140, 8, 10) and s_per_it == pytest.approx(0.002)
    assert hop_per_it == pytest.approx((0.05 - 0.02) / 10, abs=0.002)  # ~30 ms outside the step, with work held
    time.sleep(0.05)  # it reported idle: the wait before the next call is for work, not a hop
    m.engine_step("rollout", 0, snap(200, 20, 160), busy_s=0.02, pull_s=0.0, idle=False)
    assert m.engine[-1][3] == 0.0
    m.engine_step("rollout", 0, snap(200, 20, 160), busy_s=0.0, pull_s=0.01, idle=False)  # no decoding: no sample
    assert len(m.engine) == 2 and list(m.pulls) == [0.01]


def test_warm_up_steps_are_left_out_and_a_step_control_cost_is_its_time_beyond_compute():
    m = SimInputs(warmup_steps=1)
    for step in range(3):
        m.consumed()
        time.sleep(0.03)
        m.step_done({"step_time_s": 0.01, "tokens": 100 + step})
    assert [s["tokens"] for s in m.steps] == [101, 102]
    assert all(0.015 < s["control_s"] < 0.1 for s in m.steps)
    m.group_completed("g-1")
    time.sleep(0.01)
    m.group_scored("g-1")
    m.group_scored("g-2")  # completed before the measurements started: counted, no latency
    assert m.groups_scored == 2 and len(m.reward_latency) == 1 and m.reward_latency[0] >= 0.01
    assert m.as_json(filtered_groups=1)["groups_filtered"] == 1


ROWS = [{"tokens": 100, "tokens_per_s": 100.0, "staleness_mean": 1.0, "rollout_idle_ratio": 0.5, "step_time_s": 0.5}
        for _ in range(3)] + [{"tokens": 300, "tokens_per_s": 100.0, "staleness_mean": 0.0, "rollout_idle_ratio": 0.0,
                               "step_time_s": 3.0}]


def test_measured_figures_weigh_steps_by_their_wall_and_errors_are_in_the_goals_units():
    meas = prediction.measured(ROWS, skip=1)  # walls 1, 1, 3 s
    assert meas["tokens_per_s"] == pytest.approx(100.0)
    assert meas["rollout_idle"] == pytest.approx(0.2) and meas["trainer_idle"] == pytest.approx(0.2)
    assert meas["staleness_mean"] == pytest.approx(2 / 3)
    pred = {"tokens_per_s": 115.0, "staleness_mean": 1.0, "rollout_idle": 0.3, "trainer_idle": 0.1,
            "profile": "p.json", "warmup_steps": 1}
    block, lines = prediction.report(pred, ROWS)
    assert block["error"]["tokens_per_s"] == pytest.approx(0.15)
    assert block["error"]["rollout_idle"] == pytest.approx(0.1) and block["window"] == "steps 2-4"
    assert "+15%" in " ".join(lines)
    assert prediction.mlflow_metrics(block)["predicted/error_trainer_idle"] == pytest.approx(-0.1)


def test_a_plan_without_a_measured_profile_gets_no_forecast_and_the_way_to_one():
    pred, line = prediction.forecast(api.as_plan(QUICKSTART, []))
    assert pred is None and "rlflow profile PIPELINE" in line
