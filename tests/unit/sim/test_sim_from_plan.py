"""rlflow.sim.from_plan: a compiled plan's coordination block (routing / sync / migration / dispatch) -> SimConfig.

Plans are compiled from the shipped pipelines with `--set`-style overrides (rlflow.compiler.compile_pipeline),
so every strategy name is checked as the compiler writes it, and the config is built into the simulator's
fleet to check that the coordinator really runs the mapped strategies.
"""

from dataclasses import replace
from pathlib import Path

import pytest

from rlflow.compiler import compile_pipeline
from rlflow.operators.cost_profile import CostProfile
from rlflow.plan_read import stage_coordination
from rlflow.sim import simulate
from rlflow.sim.fleet import CoordinatedFleet, Fleet
from rlflow.sim.from_plan import DEFAULT_PROFILE, plan_coordination, sim_config
from rlflow.sim.loop import Simulation
from rlflow.sim.slots import SlotPool

PIPELINES = Path(__file__).resolve().parents[3] / "pipelines"
STALEFLOW = PIPELINES / "staleflow.yaml"  # edges[4] is the weight_sync back edge, edges[0] data -> rollout
LAMINAR = PIPELINES / "laminar.yaml"  # edges[4] weight_sync per_instance
QUICKSTART = PIPELINES / "quickstart.yaml"


def _plan(path, *overrides):
    return compile_pipeline(path, list(overrides))


def _coord(plan):
    return plan["control"]["coordination"]["rollout"]


def _without_profile(plan):
    _coord(plan)["profile"] = None
    return plan


def test_staleflow_plan_maps_every_strategy_and_the_staleness_control():
    plan = _plan(STALEFLOW)
    cfg, notes = sim_config(plan, steps=4)
    assert (cfg.mode, cfg.routing, cfg.weight_sync, cfg.partial_rollout, cfg.migration, cfg.dispatch) == (
        "cost_model", "cost_model", "throughput_aware", True, "threshold", "none")
    assert cfg.coordinated and cfg.coordinator_interval_s == _coord(plan)["interval_s"] == 0.5
    assert cfg.profile == CostProfile.load(_coord(plan)["profile"])
    control = plan["control"]["staleness"]
    assert (cfg.policy, cfg.eta, cfg.batch_groups, cfg.batch_redundancy) == ("staleflow", 2, 8, 1)
    assert (cfg.policy, cfg.eta, cfg.batch_groups, cfg.batch_redundancy) == (
        control["kind"], control["eta"], control["batch_size"], control["batch_redundancy"])
    assert cfg.instances == 2 and cfg.group_size == 8 and cfg.steps == 4
    assert not any("no cost-model profile" in n for n in notes)  # the plan names its profile


@pytest.mark.parametrize("routing", ["least_loaded", "cost_model"])
def test_routing_names_map(routing):
    plan = _plan(STALEFLOW, f"stages.rollout.coordinator.routing={routing}")
    cfg, _ = sim_config(plan, steps=4)
    assert cfg.routing == routing
    fleet = Simulation(cfg).rollout
    assert isinstance(fleet, CoordinatedFleet) and fleet.coord.cfg.routing == routing


@pytest.mark.parametrize("mode, partial, coordinated", [
    ("throughput_aware", True, True),
    ("throughput_aware", False, True),
    ("global", True, True),  # still coordinated: cost_model routing + threshold migration run the cycle
    ("global", False, True),
    ("per_instance", False, True),
])
def test_weight_sync_modes_map_in_a_coordinated_plan(mode, partial, coordinated):
    plan = _plan(STALEFLOW, f"edges.4.policy.mode={mode}", f"edges.4.policy.partial_rollout={str(partial).lower()}")
    cfg, _ = sim_config(plan, steps=4)
    assert (cfg.weight_sync, cfg.partial_rollout, cfg.coordinated) == (mode, partial, coordinated)
    coord = Simulation(cfg).rollout.coord
    assert coord.cfg.sync == mode and coord.cfg.partial_rollout == partial


@pytest.mark.parametrize("mode, partial", [("global", False), ("global", True), ("per_instance", False)])
def test_vanilla_sync_modes_use_the_event_driven_fleet(mode, partial):
    """No coordination asked for: global / per_instance sync run on the least-loaded event-driven fleet."""
    plan = _plan(QUICKSTART, f"edges.4.policy.mode={mode}", f"edges.4.policy.partial_rollout={str(partial).lower()}")
    cfg, notes = sim_config(plan, steps=4)
    assert (cfg.mode, cfg.weight_sync, cfg.partial_rollout, cfg.coordinated) == ("cost_model", mode, partial, False)
    fleet = Simulation(cfg).rollout
    assert type(fleet) is Fleet and (fleet.weight_sync, fleet.partial_rollout) == (mode, partial)
    assert any(DEFAULT_PROFILE in n for n in notes)  # no profile in the plan: the default, said out loud
    default = CostProfile.load(DEFAULT_PROFILE)
    stage_cap = plan["pipeline"]["stages"]["rollout"]["max_running"]
    assert cfg.profile == replace(default, max_running=min(default.max_running, stage_cap))


@pytest.mark.parametrize("cap", [4, 100_000])
def test_the_stage_max_running_caps_the_simulated_engine(cap):
    """The runtime's engine runs at most the stage's max_running; the simulated one must too (it ran the profile's)."""
    cfg, _ = sim_config(_plan(QUICKSTART, f"stages.rollout.max_running={cap}"), steps=4)
    assert cfg.profile.max_running == min(cap, CostProfile.load(DEFAULT_PROFILE).max_running)


def test_throughput_aware_without_other_coordination_still_runs_the_coordinator():
    plan = _plan(STALEFLOW, "stages.rollout.coordinator.routing=least_loaded", "stages.rollout.coordinator.migration=none")
    cfg, _ = sim_config(plan, steps=4)
    assert (cfg.routing, cfg.migration, cfg.weight_sync) == ("least_loaded", "none", "throughput_aware")
    assert cfg.coordinated and Simulation(cfg).rollout.coord.cfg.sync == "throughput_aware"


@pytest.mark.parametrize("migration", ["none", "threshold"])
def test_staleflow_migration_names_map(migration):
    cfg, _ = sim_config(_plan(STALEFLOW, f"stages.rollout.coordinator.migration={migration}"), steps=4)
    assert cfg.migration == migration and Simulation(cfg).rollout.coord.cfg.migration == migration


def test_laminar_repack_maps_with_per_instance_sync():
    plan = _plan(LAMINAR, "stages.rollout.coordinator.interval_s=2")
    cfg, _ = sim_config(plan, steps=4)
    assert (cfg.migration, cfg.weight_sync, cfg.routing, cfg.policy) == ("repack", "per_instance", "least_loaded", "unbounded")
    assert cfg.coordinated and cfg.coordinator_interval_s == 2.0
    coord = Simulation(cfg).rollout.coord
    assert (coord.cfg.migration, coord.cfg.sync) == ("repack", "per_instance")


def test_missing_weight_sync_block_defaults_to_a_global_barrier():
    plan = _plan(QUICKSTART)
    _coord(plan)["weight_sync"] = None
    cfg, _ = sim_config(plan, steps=4)
    assert (cfg.weight_sync, cfg.partial_rollout) == ("global", False)


@pytest.mark.parametrize("ranker, sim_ranker, noted", [("oracle", "oracle", False), ("learned", "noisy", True),
                                                       ("rlflow.operators.length_ranker:OnlineLengthRanker", "noisy", True)])
def test_skew_aware_dispatch_maps_with_its_ranker(ranker, sim_ranker, noted):
    compiled = "learned" if ranker == "oracle" else ranker  # the compiler rejects oracle (`rlflow run` cannot run it)
    dispatch = f"{{kind: skew_aware_dispatch, ranker: '{compiled}', long_tail_fraction: 0.3}}"
    plan = _plan(STALEFLOW, f"edges.0.policy={dispatch}")
    _coord(plan)["dispatch"]["ranker"] = ranker
    assert _coord(plan)["dispatch"]["kind"] == "skew_aware_dispatch"
    cfg, notes = sim_config(plan, steps=4)
    assert (cfg.dispatch, cfg.ranker, cfg.long_tail_fraction) == ("skew_aware", sim_ranker, 0.3)
    assert any("noisy oracle" in n for n in notes) == noted
    assert Simulation(cfg).rollout.cfg.dispatch == "skew_aware"


def test_round_robin_dispatch_maps_to_none():
    plan = _plan(STALEFLOW)
    assert _coord(plan)["dispatch"] == {"kind": "round_robin"}
    assert sim_config(plan, steps=4)[0].dispatch == "none"


def test_slots_mode_says_what_it_does_not_model():
    """streamrl.yaml gives rollout speed; without a profile: slots mode, in-flight global sync, and a note per
    coordination choice it drops (and no claim that the ranker is simulated)."""
    plan = _without_profile(_plan(PIPELINES / "streamrl.yaml"))
    cfg, notes = sim_config(plan, steps=4)
    assert (cfg.mode, cfg.weight_sync, cfg.partial_rollout, cfg.dispatch, cfg.coordinated) == (
        "slots", "global", True, "none", False)
    assert any("routing / migration / dispatch are not modelled" in n for n in notes)
    assert not any("noisy oracle" in n for n in notes)
    assert isinstance(Simulation(cfg).rollout, SlotPool)
    plan = _without_profile(_plan(PIPELINES / "streamrl.yaml", "edges.4.policy.mode=per_instance"))
    cfg, notes = sim_config(plan, steps=4)
    assert cfg.weight_sync == "global" and any("per_instance sync is not modelled" in n for n in notes)
    # forced onto cost-model instances, the same plan keeps its dispatch and simulates the ranker
    cfg, notes = sim_config(plan, steps=4, mode="cost_model")
    assert (cfg.mode, cfg.dispatch, cfg.ranker, cfg.weight_sync) == ("cost_model", "skew_aware", "noisy", "per_instance")
    assert any("noisy oracle" in n for n in notes)


def test_slots_mode_without_a_rollout_speed_is_an_error():
    with pytest.raises(ValueError, match="rollout_tokens_per_s"):
        sim_config(_plan(STALEFLOW), steps=4, mode="slots")


def test_flags_override_the_plan():
    plan = _plan(STALEFLOW)
    cfg, notes = sim_config(plan, steps=6, instances=5, seed=7, prompt_tokens=16, train_tokens_per_s=1000.0)
    assert (cfg.instances, cfg.seed, cfg.prompt_tokens, cfg.steps) == (5, 7, 16, 6)
    assert cfg.trainer.s_per_token == pytest.approx(1e-3) and not any("trainer speed" in n for n in notes)


def test_compiled_staleflow_plan_simulates_within_its_bound():
    cfg, _ = sim_config(_plan(STALEFLOW), steps=3)
    r = simulate(cfg)
    assert r.consumed == 3 * 8 and max(r.staleness) <= 2


def test_coordinator_knobs_reach_the_simulator_and_the_runtime():
    plan = _plan(STALEFLOW, "stages.rollout.coordinator.mu=0.5", "stages.rollout.coordinator.phi_wait=1",
                 "stages.rollout.coordinator.phi_throughput=2")
    cfg, _ = sim_config(plan, steps=4)
    assert (cfg.mu, cfg.phi_wait, cfg.phi_throughput) == (0.5, 1, 2.0)
    sim_cfg = Simulation(cfg).rollout.coord.cfg
    run_cfg = stage_coordination(plan, "rollout").config()  # what `rlflow run`'s coordinator is built with
    for c in (sim_cfg, run_cfg, plan_coordination(plan).config()):
        assert (c.mu, c.phi_wait, c.phi_throughput) == (0.5, 1, 2.0)
    default = plan_coordination(_plan(STALEFLOW)).config()
    assert (default.mu, default.phi_wait, default.phi_throughput) == (0.3, 3, 5.0)  # StaleFlow §6.1


@pytest.mark.parametrize("knob, value", [("mu", "1.5"), ("phi_wait", "-1"), ("phi_throughput", "0.5")])
def test_out_of_range_coordinator_knobs_are_compile_errors(knob, value):
    from rlflow.errors import PipelineInvalid

    with pytest.raises(PipelineInvalid, match=knob):
        _plan(STALEFLOW, f"stages.rollout.coordinator.{knob}={value}")


def test_epochs_and_mini_batches_charge_the_trainer_more_time_per_batch():
    """train.epochs passes and pi_old's extra forward (issue 49): the simulated step grows as the run's does."""
    one, _ = sim_config(_plan(QUICKSTART), steps=2)
    more, _ = sim_config(_plan(QUICKSTART, "stages.train.epochs=2", "stages.train.mini_batches=2"), steps=2)
    assert (more.trainer.epochs, more.trainer.mini_batches, more.trainer.passes) == (2, 2, 2 + 1 / 3)
    tokens, rows = 4096.0, 64
    assert more.trainer.step_time(tokens, rows) == pytest.approx(one.trainer.step_time(tokens, rows) * (2 + 1 / 3))
    single = sim_config(_plan(QUICKSTART, "stages.train.mini_batches=1", "stages.train.epochs=1"), steps=2)[0]
    assert single.trainer.passes == 1  # one optimizer step: pi_old comes from the training forward itself
