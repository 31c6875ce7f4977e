"""Control costs: the simulator charges the hops between actors that `rlflow run` pays (issue #33).

reward_latency_s delays a finished group's arrival in the buffer; step_control_s lengthens every train step
without counting as trainer compute; the shipped file (configs/control_costs/cpu-2core.json) is what a plan gets
by default, and 'none' switches it off.
"""

import json
from dataclasses import replace
from pathlib import Path

import pytest

from rlflow.compiler import compile_pipeline
from rlflow.sim import LengthSpec, SimConfig, TrainerModel, simulate
from rlflow.sim.config import SimConfigError
from rlflow.sim.control_costs import CONTROL_COSTS_DIR, DEFAULT, REWARD_SEGMENTS, STEP_SEGMENTS, ControlCosts
from rlflow.sim.from_plan import sim_config

ROOT = Path(__file__).resolve().parents[3]
SYNCHRONOUS = ROOT / "pipelines" / "synchronous.yaml"

# a barrier run with nothing random: C = B samples at once, all the same length, so a step is
# generation (mean / speed) -> the group hops -> train, one after the other
T_GEN, T_TRAIN = 2.0, 1.0
BARRIER = SimConfig(mode="slots", slots=8, speed=50.0, stagger=False, lengths=LengthSpec(kind="fixed", mean=100),
                    group_size=4, batch_groups=2, policy="synchronous", trainer=TrainerModel(t_step=T_TRAIN),
                    steps=12, warmup_steps=2)


def period(result) -> float:
    return result.window_s / (result.steps - result.warmup_steps)


def test_a_barrier_step_is_generation_then_training_without_control_costs():
    assert period(simulate(BARRIER)) == pytest.approx(T_GEN + T_TRAIN)


def test_a_step_is_longer_by_step_control_but_the_trainer_is_busy_only_for_its_compute():
    result = simulate(replace(BARRIER, step_control_s=0.5))
    assert all(end - start == pytest.approx(T_TRAIN + 0.5) for start, end in result.train_steps)
    assert period(result) == pytest.approx(T_GEN + T_TRAIN + 0.5)
    assert result.trainer_idle_ratio == pytest.approx(1 - T_TRAIN / (T_GEN + T_TRAIN + 0.5))


def test_a_group_reaches_the_buffer_reward_latency_later():
    result = simulate(replace(BARRIER, reward_latency_s=0.7))
    base = simulate(BARRIER)
    # the first step starts when the batch's groups arrive: generation, then the hops
    assert result.train_steps[0][0] == pytest.approx(base.train_steps[0][0] + 0.7) == pytest.approx(T_GEN + 0.7)


def test_a_synchronous_step_grows_by_both_costs():
    result = simulate(replace(BARRIER, reward_latency_s=0.7, step_control_s=0.3))
    assert period(result) == pytest.approx(T_GEN + 0.7 + T_TRAIN + 0.3)
    assert result.max_staleness == 0 and result.consumed == BARRIER.steps * BARRIER.batch_groups


def test_an_async_run_hides_reward_latency_behind_training():
    """With one step of staleness allowed, the next batch generates (and hops) while the trainer runs: a
    reward latency shorter than the slack costs no throughput, where the barrier pays it in full."""
    base = replace(BARRIER, policy="staleflow", eta=1, trainer=TrainerModel(t_step=4.0))
    assert period(simulate(replace(base, reward_latency_s=0.5))) == pytest.approx(period(simulate(base)))


@pytest.mark.parametrize("field", ["reward_latency_s", "step_control_s"])
def test_a_negative_control_cost_is_refused(field):
    with pytest.raises(SimConfigError, match=field):
        replace(BARRIER, **{field: -0.1})


def test_the_shipped_file_is_the_benchmarks_sync_segments_summed():
    raw = json.loads((CONTROL_COSTS_DIR / f"{DEFAULT}.json").read_text())
    assert "bench_step_latency.py" in raw["source"] and "--modes sync" in raw["source"]
    assert raw["reward_latency_s"] == pytest.approx(sum(raw["segments"][s] for s in REWARD_SEGMENTS))
    assert raw["step_control_s"] == pytest.approx(sum(raw["segments"][s] for s in STEP_SEGMENTS))
    assert raw["reward_latency_s"] > 0 and raw["step_control_s"] > 0
    assert "trainer: compute" not in (*REWARD_SEGMENTS, *STEP_SEGMENTS)  # compute is the trainer model's, not a cost


def test_a_plan_gets_the_shipped_costs_by_default_and_none_switches_them_off():
    plan = compile_pipeline(SYNCHRONOUS, [])
    shipped = ControlCosts.load()
    cfg, notes = sim_config(plan, steps=4)
    assert (cfg.reward_latency_s, cfg.step_control_s) == (shipped.reward_latency_s, shipped.step_control_s)
    assert any(n.startswith(f"control costs from {DEFAULT}.json") for n in notes)
    off, notes = sim_config(plan, steps=4, control_costs="none")
    assert (off.reward_latency_s, off.step_control_s) == (0.0, 0.0)
    assert any("control costs: none" in n for n in notes)


def test_a_plan_takes_a_control_costs_file_by_path(tmp_path):
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps({"source": "a test", "reward_latency_s": 0.25, "step_control_s": 0.125}))
    cfg, notes = sim_config(compile_pipeline(SYNCHRONOUS, []), steps=4, control_costs=str(path))
    assert (cfg.reward_latency_s, cfg.step_control_s) == (0.25, 0.125)
    assert any("gpu.json (a test)" in n for n in notes)
    with pytest.raises(ValueError, match="no file"):
        sim_config(compile_pipeline(SYNCHRONOUS, []), steps=4, control_costs=str(tmp_path / "missing.json"))
