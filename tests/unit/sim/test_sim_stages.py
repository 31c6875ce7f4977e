"""Several rollout stages in the simulator: one fleet per stage (its own lengths, group size and instances) under one
policy, trainer and weights version, served in the order `rlflow run` serves its fleets (pipelines/mixed.yaml)."""

from dataclasses import replace
from pathlib import Path

import pytest

from rlflow.cli import main
from rlflow.compiler import compile_pipeline
from rlflow.operators.cost_profile import CostProfile
from rlflow.plan_read import rollout_stages
from rlflow.sim import LengthSpec, SimConfig, SimConfigError, Simulation, TrainerModel, simulate
from rlflow.sim.config import StageSim
from rlflow.sim.engine import Instance
from rlflow.sim.fleet import Fleets
from rlflow.sim.from_plan import ONE_STAGE_RULE, not_simulable, plan_rollout, plan_rollouts, sim_config

PIPELINES = Path(__file__).resolve().parents[3] / "pipelines"
MIXED = PIPELINES / "mixed.yaml"  # edges[7] train -> gen_arith, edges[8] train -> gen_repeat (weight_sync)
PROFILE = CostProfile.load("staleflow-table4-qwen3-30b-a3b")


def _record_admissions(monkeypatch) -> list[tuple[int, int, int, int]]:
    """(group id, group's stage, admitting fleet's stage, instance idx) of every admission, the simulator unchanged."""
    seen = []
    admit = Instance.admit

    def recording(inst, sample):
        seen.append((sample.group.gid, sample.group.stage, inst.fleet.stage, inst.idx))
        admit(inst, sample)

    monkeypatch.setattr(Instance, "admit", recording)
    return seen


def test_mixed_runs_one_fleet_per_rollout_stage_as_declared(monkeypatch):
    plan = compile_pipeline(MIXED)
    config, notes = sim_config(plan, steps=30)
    assert (config.stage_name, [s.name for s in config.stages]) == ("gen_arith", ["gen_repeat"])
    assert (config.lengths.cap, config.lengths.mean, config.lengths.kind) == (8, 3, "fixed")  # workload.stages
    (repeat,) = config.stages
    assert (repeat.lengths.cap, repeat.lengths.mean, repeat.lengths.tailness, repeat.group_size) == (48, 12, 60, 8)
    assert any("summed over 2 rollout stages" in n for n in notes)
    admissions = _record_admissions(monkeypatch)
    sim = Simulation(config)
    assert isinstance(sim.rollout, Fleets) and [f.stage for f in sim.rollout.fleets] == [0, 1]
    r = sim.run()

    c = sim.policy.counters
    assert c.conserved() and c.consumed == 30 * config.batch_groups
    assert len(sim.groups) == c.in_flight + c.pending  # the simulator forgot exactly what the policy let go
    assert max(r.staleness) <= 1  # one staleness bound over both stages
    arith, rep = r.stages["gen_arith"], r.stages["gen_repeat"]
    assert arith["trained_samples"] > 0 and rep["trained_samples"] > 0
    assert arith["trained_share"] + rep["trained_share"] == pytest.approx(1.0)
    assert arith["trained_samples"] + rep["trained_samples"] == len(r.trained_lengths)
    assert arith["trained_samples"] % 8 == 0 and rep["trained_samples"] % 8 == 0  # whole groups
    assert arith["max_trained_length"] <= 8 and arith["mean_trained_length"] == 3
    assert rep["max_trained_length"] <= 48 and rep["mean_trained_length"] > 3
    assert arith["trained_tokens"] + rep["trained_tokens"] == pytest.approx(r.trained_tokens_per_s * r.window_s)
    # every sample runs on its own stage's fleet, and a fleet's instances are its own (idx unique over the fleets)
    assert admissions and all(group_stage == fleet_stage for _, group_stage, fleet_stage, _ in admissions)
    assert {idx for *_, fleet_stage, idx in admissions if fleet_stage == 0} == {0}
    assert {idx for *_, fleet_stage, idx in admissions if fleet_stage == 1} == {1}
    stage_of = {}
    for gid, stage, *_ in admissions:
        assert stage_of.setdefault(gid, stage) == stage
    assert len(r.timeline_running) == 2
    assert "stages" in r.summary() and "stages" not in simulate(replace(config, stages=(), steps=8)).summary()


def test_surplus_groups_are_aborted_on_their_own_stage():
    """Batch redundancy aborts the surplus wherever it runs or waits: each group leaves its own stage's TS and fleet."""
    config, _ = sim_config(compile_pipeline(MIXED, ["edges.6.policy.batch_redundancy=2"]), steps=20)
    sim = Simulation(config)
    r = sim.run()
    c = sim.policy.counters
    assert r.aborted > 0 and c.conserved() and len(sim.groups) == c.in_flight + c.pending
    for stage, (ts, fleet) in enumerate(zip(sim.tss, sim.rollout.fleets)):
        waiting = [s for q in ts._by_version.values() for s in q]
        running = [s for inst in fleet.instances for s in [*inst.running.values(), *inst.waiting]]
        assert all(s.group.gid in sim.groups and s.group.stage == stage for s in waiting + running)


def _two_stage(first: LengthSpec, second: LengthSpec, **kw) -> SimConfig:
    base = dict(mode="cost_model", instances=1, profile=PROFILE, group_size=4, batch_groups=2, lengths=first,
                stage_name="a", stages=(StageSim("b", 1, second, group_size=4),), policy="synchronous",
                trainer=TrainerModel(t_step=1.0), steps=12, warmup_steps=2, weight_sync="global")
    return SimConfig(**(base | kw))


def test_the_first_stage_in_order_is_admitted_first():
    """Synchronous, a batch of 2 groups, every instance room for both: after each publish the first stage's fleet
    takes the whole batch before the second is asked, as `rlflow run` serves its fleets in order."""
    short, long = LengthSpec(kind="fixed", mean=100, cap=100), LengthSpec(kind="fixed", mean=1000, cap=1000)
    ab = simulate(_two_stage(short, long))
    assert ab.stages["a"]["trained_share"] == 1.0 and ab.stages["b"]["trained_samples"] == 0
    assert set(ab.trained_lengths) == {100}
    ba = simulate(_two_stage(long, short))  # the same stages, the long one first
    assert ba.stages["a"]["trained_share"] == 1.0 and set(ba.trained_lengths) == {1000}


def test_a_stage_with_room_for_one_group_leaves_the_rest_to_the_next():
    """The first stage's cap (max_running = one group) leaves the batch's second group to the second stage."""
    lengths = LengthSpec(kind="fixed", mean=100, cap=100)
    r = simulate(_two_stage(lengths, lengths, profile=replace(PROFILE, max_running=4)))
    assert r.stages["a"]["trained_share"] == r.stages["b"]["trained_share"] == 0.5
    assert r.expected_length == 100 and 0 < r.stages["b"]["rollout_idle_ratio"] < 1
    r = simulate(_two_stage(lengths, lengths, profile=replace(PROFILE, max_running=4), warmup_steps=0))
    assert list(r.stages) == ["a", "b"] and r.stages["a"]["trained_share"] == 0.5  # the window starts at 0


def test_adding_a_stage_leaves_the_first_stages_lengths_as_they_were():
    lengths = LengthSpec(kind="lognormal", mean=300, tailness=60, cap=2000)
    one = Simulation(replace(_two_stage(lengths, lengths), stages=()))
    two = Simulation(_two_stage(lengths, lengths))
    assert one.sampler.draw(64) == two.samplers[0].draw(64)
    assert two.samplers[0].draw(64) != two.samplers[1].draw(64)  # the second stage draws from its own stream


@pytest.mark.parametrize("kw, match", [
    (dict(routing="cost_model"), "coordinated or multi-turn multi-stage run is not modelled yet"),
    (dict(coordinator=True), "not modelled yet"),
    (dict(turns=2), "not modelled yet"),
    (dict(mode="slots"), "mode 'cost_model'"),
    (dict(stage_name="b"), "names must differ"),
])
def test_a_multi_stage_config_the_simulator_does_not_model_is_an_error(kw, match):
    lengths = LengthSpec(kind="fixed", mean=100, cap=100)
    with pytest.raises(SimConfigError, match=match):
        _two_stage(lengths, lengths, **kw)


def test_each_stage_cap_must_fit_the_kv_budget():
    fits = LengthSpec(kind="lognormal", mean=100, tailness=60, cap=100)
    with pytest.raises(SimConfigError, match="stages.b.lengths.cap: prompt \\+ cap = 2000000 tokens exceeds the KV"):
        _two_stage(fits, replace(fits, cap=2_000_000))
    with pytest.raises(SimConfigError, match="stages.b.lengths: a 2000000-token response"):
        Simulation(_two_stage(fits, LengthSpec(kind="fixed", mean=2_000_000)))


def test_stages_are_simulated_in_the_runtime_drivers_order(tmp_path):
    """`rlflow run` serves its fleets in graph order (rlflow/runtime/driver.py), which need not be the order the
    stages are written in; the simulator follows the runtime."""
    text = MIXED.read_text()
    arith = next(line for line in text.splitlines() if line.startswith("  gen_arith:"))
    swapped = tmp_path / "mixed.yaml"
    swapped.write_text(text.replace(arith + "\n", "").replace("  score_arith:", arith + "\n  score_arith:"))
    plan = compile_pipeline(swapped)
    assert rollout_stages(plan) == ["gen_repeat", "gen_arith"]  # as written
    driver = [n["name"] for n in plan["graph"]["nodes"] if n["kind"] == "rollout"]  # as the driver reads them
    assert [n for n, _ in plan_rollouts(plan)] == driver == ["gen_arith", "gen_repeat"]
    config, _ = sim_config(plan, steps=5)
    assert [s.name for s in config.rollouts] == driver


def test_instances_per_stage():
    plan = compile_pipeline(MIXED, ["stages.gen_repeat.replicas=3"])
    config, _ = sim_config(plan, steps=5)
    assert [(s.name, s.instances) for s in config.rollouts] == [("gen_arith", 1), ("gen_repeat", 3)]
    config, _ = sim_config(plan, steps=5, instances={"gen_arith": 2})
    assert [s.instances for s in config.rollouts] == [2, 3]
    assert len(Simulation(config).timeline._t) == 5
    with pytest.raises(ValueError, match="one count for 2 rollout stages .*stages.<name>.replicas=N"):
        sim_config(plan, steps=5, instances=4)
    with pytest.raises(ValueError, match="no rollout stage 'score_arith'; the plan's rollout stages are gen_arith, gen_repeat"):
        sim_config(plan, steps=5, instances={"score_arith": 2})
    with pytest.raises(ValueError, match="slots mode models one pool"):
        sim_config(plan, steps=5, mode="slots")


def test_several_stages_that_sync_differently_are_refused_by_name():
    plan = compile_pipeline(MIXED, ["edges.8.policy.mode=per_instance"])
    why = not_simulable(plan)
    assert why and "gen_arith: global without partial rollout, gen_repeat: per_instance" in why
    with pytest.raises(ValueError, match=ONE_STAGE_RULE):
        sim_config(plan, steps=5)
    with pytest.raises(ValueError, match=f"gen_arith, gen_repeat.*{ONE_STAGE_RULE}"):
        plan_rollout(plan)  # the single-stage reader (rlflow tune's) names the stages
    assert not_simulable(compile_pipeline(MIXED)) is None


def test_rlflow_simulate_runs_mixed_and_prints_each_stage(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["compile", str(MIXED)]) == 0
    capsys.readouterr()
    assert main(["simulate", "--steps", "6"]) == 0
    out = capsys.readouterr().out
    assert "gen_arith 1, gen_repeat 1 instance(s)" in out
    assert "stage gen_arith" in out and "stage gen_repeat" in out
    assert main(["simulate", "--steps", "6", "--instances", "2"]) == 2
    err = capsys.readouterr().err
    assert "[instances-per-stage]" in err and "--set stages.gen_arith.replicas=2" in err and "Traceback" not in err
    assert main(["simulate", "--steps", "6", "--set", "edges.8.policy.mode=per_instance"]) == 2
    err = capsys.readouterr().err
    assert f"[{ONE_STAGE_RULE}]" in err and "Traceback" not in err


@pytest.mark.parametrize("stage, rule, text", [
    ("gen_arit", "unknown-workload-stage", "unknown stage 'gen_arit' (did you mean 'gen_arith'?)"),
    ("score_arith", "workload-not-rollout", "'score_arith' is a reward stage"),
])
def test_workload_stages_name_rollout_stages(tmp_path, capsys, stage, rule, text):
    rc = main(["compile", str(MIXED), "-o", str(tmp_path / "plan.json"), "--set", f"workload.stages.{stage}.mean_length=5"])
    err = capsys.readouterr().err
    assert rc == 2 and f"[{rule}]" in err and text in err and "Traceback" not in err
    assert "name a rollout stage: gen_arith, gen_repeat" in err
    assert not (tmp_path / "plan.json").exists()


def test_per_stage_lengths_reach_the_plan_and_the_closed_form_declines_differing_ones():
    plan = compile_pipeline(MIXED, ["workload.rollout_tokens_per_s=100", "workload.train_tokens_per_s=100",
                                    "edges.6.policy.queue=drop", "edges.6.policy.capacity=8"])
    assert plan["pipeline"]["workload"]["stages"]["gen_repeat"] == {"mean_length": 12, "tailness": 60, "length_cap": 48,
                                                                  "prompt_share": None}
    assert not plan["prediction"]["available"] and "lengths differ" in plan["prediction"]["reason"]
    same = compile_pipeline(MIXED, ["workload.rollout_tokens_per_s=100", "workload.train_tokens_per_s=100",
                                    "edges.6.policy.queue=drop", "edges.6.policy.capacity=8",
                                    "workload.stages.gen_repeat.mean_length=3", "workload.stages.gen_repeat.tailness=0",
                                    "workload.stages.gen_repeat.length_cap=8"])
    assert same["prediction"]["available"]


def test_rlflow_simulate_charges_the_control_costs_it_is_given(tmp_path, monkeypatch, capsys):
    """--control-costs: the shipped file by default (its note says so), none for instant hand-offs, and a name that
    is no file is refused with the shipped ones named (exit 2, no traceback)."""
    monkeypatch.chdir(tmp_path)
    assert main(["compile", str(Path(__file__).resolve().parents[3] / "pipelines" / "synchronous.yaml")]) == 0
    capsys.readouterr()
    assert main(["simulate", "--steps", "6"]) == 0
    charged = capsys.readouterr().out
    assert "note: control costs from cpu-2core.json" in charged
    assert main(["simulate", "--steps", "6", "--control-costs", "none"]) == 0
    instant = capsys.readouterr().out
    assert "note: control costs: none (hand-offs between actors take no time)" in instant
    virtual = [float(line.split()[2].replace(",", "")) for text in (charged, instant)
               for line in text.splitlines() if line.startswith("virtual time")]
    assert len(virtual) == 2 and virtual[0] > virtual[1]  # the same plan takes longer with the hops charged
    assert main(["simulate", "--steps", "6", "--control-costs", "no-such-machine"]) == 2
    err = capsys.readouterr().err
    assert "control costs: no file" in err and "cpu-2core" in err and "Traceback" not in err

