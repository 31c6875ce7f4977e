"""Elastic rollout: StreamRL's scaling rule (operators/elastic_rule.py), instances joining and leaving a simulated run."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlflow.operators.cost_profile import CostProfile
from rlflow.operators.elastic_rule import ElasticMonitor, ElasticRule, decide
from rlflow.sim import LengthSpec, SimConfig, SimConfigError, Simulation, TrainerModel

PROFILE = CostProfile(name="elastic", k1=1e-6, k2=2e-3, k3=1e-4, k4=1e-2, k5=1.0, kv_budget=50_000.0,
                      max_running=32, prefill_s_per_token=1e-5, pull_s=0.2)


# ---------------------------------------------------------------------------------------------- the rule
def test_adds_an_instance_when_the_gap_exceeds_what_one_more_saves():
    rule = ElasticRule(1, 4)
    # 2 instances, T_gen 12 s: a third saves 12/3 = 4 s; the gap to a 7 s trainer is 5 s >= 4 s
    assert decide(2, 12.0, 7.0, rule) == 3
    assert decide(2, 12.0, 9.0, rule) == 2  # gap 3 s < 4 s: one more would overshoot the balance


def test_removes_one_only_when_one_fewer_still_keeps_up():
    rule = ElasticRule(1, 4)
    assert decide(3, 6.0, 9.0, rule) == 2  # 2 instances: 9 s per batch, no slower than the trainer
    assert decide(3, 6.5, 9.0, rule) == 3  # 2 would take 9.75 s: the trainer would wait


def test_bounds_hold():
    assert decide(4, 100.0, 1.0, ElasticRule(1, 4)) == 4
    assert decide(2, 1.0, 100.0, ElasticRule(2, 4)) == 2


@given(n=st.integers(1, 30), gen=st.floats(0.01, 1e4), train=st.floats(0.01, 1e4))
def test_a_decision_is_not_undone_by_the_next_on_the_same_workload(n, gen, train):
    """The band between the thresholds: after a step to n +- 1 (T_gen rescaled by n / n'), the rule stays put."""
    rule = ElasticRule(1, 64)
    m = decide(n, gen, train, rule)
    assert abs(m - n) <= 1
    if m != n:
        assert decide(m, gen * n / m, train, rule) in (m, m + (m - n))  # the same direction or nothing, never back


def test_monitor_measures_a_window_and_restarts_when_the_fleet_changes():
    mon = ElasticMonitor(ElasticRule(1, 3, window_steps=2), batch_trajectories=40)
    assert mon.observe({0: (0.0, 0)}, 1.0) is None  # the window starts
    assert mon.observe({0: (10.0, 20)}, 1.0) is None
    m = mon.observe({0: (20.0, 40)}, 1.0)  # 40 finished in 20 busy s: 2/s; a batch of 40 takes 20 s >> 1 s
    assert (m.instances, m.gen_s, m.train_s, m.target) == (1, 20.0, 1.0, 2)
    assert "add one" in m.describe()
    assert mon.observe({0: (21.0, 41), 1: (0.0, 0)}, 1.0) is None  # a new instance: a fresh window
    assert mon.observe({0: (22.0, 42), 1: (1.0, 2)}, 1.0) is None
    assert mon.observe({0: (23.0, 43), 1: (2.0, 4)}, 1.0).gen_s == pytest.approx(40 / (1 + 2))


def test_monitor_makes_no_decision_on_nothing_finished():
    mon = ElasticMonitor(ElasticRule(1, 3, window_steps=1), batch_trajectories=8)
    mon.observe({0: (0.0, 0)}, 1.0)
    assert mon.observe({0: (5.0, 0)}, 1.0) is None


# ---------------------------------------------------------------------------------------------- the simulator
def _cfg(**kw) -> SimConfig:
    base = dict(mode="cost_model", coordinator=True, instances=1, profile=PROFILE, prompt_tokens=50,
                lengths=LengthSpec(kind="lognormal", mean=200, tailness=60, cap=1000), group_size=4, batch_groups=8,
                policy="staleflow", eta=2, trainer=TrainerModel(t_step=1.0), steps=30, warmup_steps=4, seed=3,
                max_events=400_000)  # a lost sample stalls the run: fail fast
    return SimConfig(**(base | kw))


def _check_places(sim: Simulation) -> None:
    """Every unfinished sample of a reserved, untrained group is in exactly one place: the TS, or one instance
    (running, waiting, or on its environment); a retired instance holds none but episodes on an environment."""
    fleet = sim.rollout
    where: dict[int, int] = {}
    for inst in fleet.instances:
        held = list(inst.env.values()) if inst.retired else list(inst.running.values()) + list(inst.waiting) + list(inst.env.values())
        assert not (inst.retired and (inst.running or inst.waiting))
        for s in held:
            where[id(s)] = where.get(id(s), 0) + 1
    for s in fleet.ts.waiting:
        where[id(s)] = where.get(id(s), 0) + 1
    assert all(v == 1 for v in where.values()), "a sample in two places"
    for group in sim.groups.values():
        if group.gid in fleet.ts.initial:
            continue
        assert sum(where.get(id(s), 0) for s in group.samples) == group.remaining, f"group {group.gid} lost a sample"


def _run(cfg: SimConfig) -> Simulation:
    sim = Simulation(cfg)
    result = sim.run()
    c = sim.policy.counters
    assert c.conserved() and c.consumed == cfg.steps * cfg.batch_groups  # every step trained a whole batch
    assert result.max_staleness <= cfg.eta
    assert sim.rollout.coord.rejected == 0  # P stayed exact through joins and departures
    _check_places(sim)
    sim.result = result
    return sim


def test_scale_one_two_one_conserves_and_uses_the_added_instance():
    sim = _run(_cfg(scale=((3, 2), (12, 1)), turns=2, env_latency_s=0.3))
    events = [(after, n) for _, after, n, _ in sim.result.scale_events]
    assert events == [(3, 2), (12, 1)]
    added = sim.rollout.instances[1]
    assert added.finished_total > 0 and added.retired and added.left_at > added.joined_at
    assert [i.retired for i in sim.rollout.instances] == [False, True]
    assert len(sim.result.timeline_running) == 2


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plan=st.lists(st.tuples(st.integers(1, 14), st.integers(1, 4)), min_size=1, max_size=4),
       turns=st.sampled_from([1, 2]), sync=st.sampled_from(["global", "per_instance", "greedy"]),
       start=st.sampled_from([0.0, 2.0]))
def test_any_scale_plan_conserves_and_keeps_the_bound(plan, turns, sync, start):
    cfg = _cfg(scale=tuple(plan), turns=turns, env_latency_s=0.2 * (turns - 1), weight_sync=sync, steps=16,
               instance_start_s=start)
    _run(cfg)


def test_automatic_rule_adds_instances_to_a_rollout_bound_run_and_it_trains_faster():
    slow_trainer = dict(trainer=TrainerModel(t_step=0.3), steps=40, warmup_steps=20)
    fixed = _run(_cfg(**slow_trainer)).result
    sim = _run(_cfg(**slow_trainer, elastic_min=1, elastic_max=4))
    grew = [n for _, _, n, _ in sim.result.scale_events]
    assert grew and grew == sorted(grew) and grew[-1] > 1
    assert sim.result.trained_tokens_per_s > 1.3 * fixed.trained_tokens_per_s


def test_automatic_rule_gives_back_instances_a_trainer_bound_run_does_not_need():
    sim = _run(_cfg(instances=4, elastic_min=1, elastic_max=4, trainer=TrainerModel(t_step=30.0), steps=20))
    shrank = [n for _, _, n, _ in sim.result.scale_events]
    assert shrank and shrank == sorted(shrank, reverse=True) and shrank[-1] < 4


def test_elastic_needs_instances():
    with pytest.raises(SimConfigError, match="cost_model"):
        SimConfig(mode="slots", scale=((2, 2),))
    with pytest.raises(SimConfigError, match="elastic_min <= instances <= elastic_max"):
        _cfg(instances=3, elastic_min=1, elastic_max=2)
