"""A profile measured in a calibration run (`rlflow profile PIPELINE`, issue 47): the fit recovers the laws the
samples were drawn from, the file it writes is read by both CostProfile and the simulator, and the simulator then
takes the trainer, control costs, group filter and lengths from it, saying so; the group filter and the engine's hop
change what the simulator predicts in the way the runtime does."""

import ast
import random
from dataclasses import replace
from pathlib import Path

import pytest

from rlflow import api
from rlflow.operators.cost_profile import CostProfile
from rlflow.profile_run import ProfileRunError, fit_engine, fit_run, fit_trainer, profile_doc, write
from rlflow.sim import LengthSpec, SimConfig, TrainerModel, simulate
from rlflow.sim.from_plan import sim_config
from rlflow.sim.measured_profile import MeasuredProfile

ROOT = Path(__file__).resolve().parents[3]
QUICKSTART = ROOT / "pipelines" / "quickstart.yaml"
K2, K3, K4, HOP = 2e-3, 1e-4, 1e-3, 5e-4  # the law the synthetic engine steps follow
MB_S, TOKEN_S = 0.05, 1e-3  # and the trainer's: seconds per micro-batch and per token


def engine_rows(n_rows=200, seed=0):
    rng = random.Random(seed)
    rows = []
    for _ in range(n_rows):
        running, iters = rng.choice([1, 2, 4, 8, 16, 32, 64]), rng.choice([4, 16])
        s = (max(K2, K3 * running) + K4) * rng.uniform(0.97, 1.03)
        rows.append([running * 20.0, float(running), s, HOP, iters])
    return rows


def inputs(drop=0.25, steps=12, spread=80):
    return {"engine_steps": {"rows": engine_rows()}, "reward_latency_s": [0.05, 0.06, 0.07],
            "steps": [{"tokens": 200 + spread * i, "step_time_s": MB_S * (1 + i % 4) + TOKEN_S * (200 + spread * i),
                       "micro_batches": 1 + i % 4, "control_s": 0.03} for i in range(steps)],
            "pull_s": [0.004, 0.005], "groups_scored": 100, "groups_filtered": int(100 * drop)}


SUMMARY = {"workload_measured": {"mean_length": 6.0, "tailness": 40.0, "prompt_share": 0.5, "groups": 200}}


def test_the_fit_recovers_the_engine_law_its_hop_and_the_trainer_line():
    engine = fit_engine(engine_rows())
    for n in (1, 8, 64):
        want = max(K2, K3 * n) + K4
        assert engine["k1"] * n * 20 + max(engine["k2"], engine["k3"] * n) + engine["k4"] == pytest.approx(want, rel=0.08)
    assert engine["hop_s"] == pytest.approx(HOP)
    trainer = fit_trainer(inputs()["steps"])
    assert trainer["s_per_micro_batch"] == pytest.approx(MB_S, rel=0.01)
    assert trainer["s_per_token"] == pytest.approx(TOKEN_S, rel=0.01) and trainer["base_s"] == 0


def test_steps_of_nearly_equal_tokens_fit_seconds_per_micro_batch_alone():
    """A per-token cost fitted to a narrow spread of tokens is noise: the time goes to the micro-batches."""
    steps = inputs(spread=2)["steps"]
    trainer = fit_trainer(steps)
    assert trainer["law"] == "micro_batches" and trainer["s_per_token"] == 0 and trainer["base_s"] == 0
    total = sum(s["step_time_s"] for s in steps)
    assert trainer["s_per_micro_batch"] * sum(s["micro_batches"] for s in steps) == pytest.approx(total)


def test_a_run_too_short_to_fit_is_refused_saying_what_to_change():
    with pytest.raises(ProfileRunError, match="--steps"):
        fit_trainer(inputs(steps=2)["steps"])
    with pytest.raises(ProfileRunError, match="decode"):
        fit_engine(engine_rows()[:3])


@pytest.fixture
def measured_file(tmp_path):
    plan = api.as_plan(QUICKSTART, [])
    fit = fit_run(inputs(), SUMMARY)
    return write(profile_doc(fit, plan=plan, command="test", engine="hf", model="builtin:tiny-llama",
                             max_running=128), tmp_path / "p.json")


def test_the_written_profile_reads_as_a_cost_profile_and_as_measured_sections(measured_file):
    cost = CostProfile.load(measured_file)
    assert cost.hop_s == pytest.approx(HOP) and cost.prefill_s_per_token == 0
    m = MeasuredProfile.load(measured_file)
    assert m.filter_drop_rate == 0.25 and m.s_per_micro_batch == pytest.approx(MB_S, rel=0.01)
    assert m.step_control_s == pytest.approx(0.03) and m.reward_latency_s == pytest.approx(0.06)
    assert m.same_workload("builtin:repeat", 48) and not m.same_workload("builtin:arith", 48)
    assert MeasuredProfile.load(ROOT / "configs" / "profiles" / "tiny-llama-hf.json") is None  # not measured in a run


def test_the_simulator_takes_every_input_from_a_measured_profile_and_says_so(measured_file):
    plan = api.as_plan(QUICKSTART, [f"stages.rollout.coordinator.profile={measured_file}"])
    config, notes = sim_config(plan, steps=20)
    assert config.trainer.s_per_micro_batch == pytest.approx(MB_S, rel=0.01)
    # the plan's micro-batching (zero1.json: 8 rows per micro-batch, one rank): 32 rows are 4 micro-batches, and a
    # second rank halves each rank's share
    assert config.trainer.micro_batches(32, 100) == 4
    two, two_notes = sim_config(api.as_plan(QUICKSTART, [f"stages.rollout.coordinator.profile={measured_file}",
                                                         "stages.train.replicas=2"]), steps=20)
    assert two.trainer.micro_batches(32, 100) == 2
    # ... and says that a profile of one rank does not measure two sharing the machine
    assert any("measured at 1 rank(s); this plan trains on 2" in n for n in two_notes)
    assert not any("this plan trains on" in n for n in notes)
    assert config.step_control_s == pytest.approx(0.03) and config.filter_drop_rate == 0.25
    assert config.lengths.mean == 6.0 and config.lengths.tailness == 40.0
    assert config.profile.hop_s == pytest.approx(HOP)
    text = " ".join(notes)
    assert "calibration run" in text and "drops 25%" in text and "trainer speed assumed" not in text
    other, notes = sim_config(api.as_plan(QUICKSTART, [f"stages.rollout.coordinator.profile={measured_file}",
                                                       "data.source=builtin:arith"]), steps=20)
    assert other.lengths.mean != 6.0 and any("not this plan's builtin:arith" in n for n in notes)


BASE = SimConfig(mode="slots", slots=16, speed=100.0, lengths=LengthSpec(kind="fixed", mean=10), group_size=4,
                 batch_groups=4, policy="staleflow", eta=1, trainer=TrainerModel(t_step=0.05), steps=60,
                 warmup_steps=10, seed=3)


def test_a_group_filter_drops_its_share_and_the_trained_rate_falls_with_it():
    plain, filtered = simulate(BASE), simulate(replace(BASE, filter_drop_rate=0.5))
    share = filtered.filtered / (filtered.filtered + filtered.consumed)
    assert 0.4 < share < 0.6 and plain.filtered == 0
    assert filtered.trained_tokens_per_s < 0.8 * plain.trained_tokens_per_s  # rollout-bound: half its groups wasted


def test_the_engine_hop_slows_decoding_and_is_not_counted_busy():
    prof = CostProfile(name="t", k1=0.0, k2=0.01, k3=0.0, k4=0.0, k5=1.0, kv_budget=1e6, max_running=16,
                       prefill_s_per_token=0.0, pull_s=0.0)
    base = SimConfig(mode="cost_model", instances=1, profile=prof, lengths=LengthSpec(kind="fixed", mean=10),
                     group_size=4, batch_groups=4, policy="staleflow", eta=1, trainer=TrainerModel(t_step=0.001),
                     steps=40, warmup_steps=5, seed=1)
    fast, slow = simulate(base), simulate(replace(base, profile=replace(prof, hop_s=0.01)))
    assert slow.trained_tokens_per_s == pytest.approx(fast.trained_tokens_per_s / 2, rel=0.1)
    assert slow.rollout_idle_ratio == pytest.approx(fast.rollout_idle_ratio + (1 - fast.rollout_idle_ratio) / 2, abs=0.05)


def test_the_validation_script_sets_no_simulator_input():
    """tune_validation.py's predictions are the runs' own: it may name the profile, nothing the simulator reads."""
    source = (ROOT / "benchmarks" / "tune_validation.py").read_text()
    for forbidden in ("workload.", "train_tokens_per_s", "train-tokens-per-s", "--control-costs", "engine_scale",
                      "calibrat" + "ed on", "rollout_tokens_per_s", "--profile "):
        assert forbidden not in source, f"tune_validation.py sets {forbidden!r}: a hand-set simulator input"
    tree = ast.parse(source)
    grid = next(ast.literal_eval(node.value) for node in tree.body
                if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "GRID")
    assert len(grid) >= 12
    for _, _, sets in grid.values():
        assert not any(s.startswith("workload") or ".coordinator." in s for s in sets)


def _rollout_bound(prof, **kw):
    return SimConfig(mode="cost_model", instances=1, profile=prof, group_size=4, batch_groups=4, policy="staleflow",
                     eta=2, trainer=TrainerModel(t_step=0.001), steps=40, warmup_steps=5, seed=1,
                     **{"lengths": LengthSpec(kind="lognormal", mean=10, tailness=60, cap=64), **kw})


def test_a_stepped_engine_admits_work_only_between_its_calls():
    """hf's engine runs calls of up to chunk_size iterations; a slot freed mid-call stays empty until the call ends
    (rlflow run's routes travel in the next call), so short responses beside long ones waste decode slots."""
    prof = CostProfile(name="t", k1=0.0, k2=0.01, k3=0.0, k4=0.0, k5=1.0, kv_budget=1e6, max_running=4,
                       prefill_s_per_token=0.0, pull_s=0.0)
    continuous = simulate(_rollout_bound(prof))
    per_iteration = simulate(_rollout_bound(replace(prof, chunk_steps=1)))
    chunked = simulate(_rollout_bound(replace(prof, chunk_steps=16)))
    assert per_iteration.trained_tokens_per_s == pytest.approx(continuous.trained_tokens_per_s, rel=0.1)
    assert chunked.trained_tokens_per_s < 0.8 * continuous.trained_tokens_per_s


def test_a_coordinated_fleet_routes_a_drained_instance_without_waiting_out_the_period():
    """rlflow run's coordinator runs a cycle as soon as an instance runs out of work (rollout_coordinator.due); the
    simulated one does too, so a long period does not idle engines whose work is short."""
    prof = CostProfile(name="t", k1=0.0, k2=0.01, k3=0.0, k4=0.0, k5=1.0, kv_budget=1e6, max_running=16,
                       prefill_s_per_token=0.0, pull_s=0.0)
    fixed = {"lengths": LengthSpec(kind="fixed", mean=10)}
    short, long = (simulate(_rollout_bound(prof, coordinator=True, coordinator_interval_s=s, **fixed)) for s in (0.01, 5.0))
    assert long.trained_tokens_per_s == pytest.approx(short.trained_tokens_per_s, rel=0.15)
    assert long.rollout_idle_ratio < 0.3


@pytest.mark.parametrize("coordinator", [False, True])
def test_work_reaches_an_idle_engine_route_s_late_and_the_wait_counts_idle(coordinator):
    """A run's driver needs a round trip before an engine that reported idle decodes again (route_s, measured);
    each time an engine waits for admission it pays it, and the simulator counts it idle, as the run does."""
    prof = CostProfile(name="t", k1=0.0, k2=0.01, k3=0.0, k4=0.0, k5=1.0, kv_budget=1e6, max_running=16,
                       prefill_s_per_token=0.0, pull_s=0.0)
    base = replace(_rollout_bound(prof, lengths=LengthSpec(kind="fixed", mean=10), coordinator=coordinator), eta=0,
                   policy="synchronous")
    now, late = simulate(base), simulate(replace(base, route_s=0.05))
    assert late.rollout_idle_ratio > now.rollout_idle_ratio + 0.1
    assert late.trained_tokens_per_s < 0.85 * now.trained_tokens_per_s


def test_the_tuner_simulates_a_measured_trainer_at_one_rank_per_train_gpu(measured_file):
    """`rlflow tune` with a measured profile states no trainer speed: each split's trainer is the calibration run's,
    at as many ranks as it has train GPUs (4 GPUs: 1, 2 or 3 ranks); more ranks share a batch's micro-batches."""
    from rlflow.tune import simulate_point, tune

    plan = api.as_plan(QUICKSTART, ["stages.train.steps=8"])
    candidates, notes = tune(plan, gpus=4, steps=8, profile=str(measured_file), progress=lambda *a: None)
    assert not any("trainer speed per GPU assumed" in n for n in notes)
    assert any("one rank per train GPU" in n for n in notes)
    assert all(c.measured_trainer for c in candidates)
    by_split = {}
    for c in candidates:
        by_split.setdefault(c.train_gpus, c.train_tokens_per_s)
    assert sorted(by_split) == [1, 2, 3]
    assert by_split[1] < by_split[2] < by_split[3]  # the bound's trainer: fewer micro-batches per rank
    one = simulate_point(plan, "eta", 1, 1, str(measured_file), None, 8, 0, train_ranks=1)
    three = simulate_point(plan, "eta", 1, 1, str(measured_file), None, 8, 0, train_ranks=3)
    assert three["trainer_idle"] > one["trainer_idle"]  # the same rollout feeds a faster trainer
