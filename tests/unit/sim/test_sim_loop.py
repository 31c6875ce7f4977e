"""The event loop driving the real policies (make_policy): bounds, barriers, sync modes, conservation, reports."""

from __future__ import annotations

from dataclasses import replace

import pytest

from rlflow.operators.cost_profile import CostProfile
from rlflow.sim import LengthSpec, SimConfig, Simulation, SimulationStalled, TrainerModel, simulate
from rlflow.sim.fleet import Fleet
from rlflow.sim.report import plot_report, text_report, write_report
from rlflow.sim.slots import closed_form_config

PROFILE = CostProfile.load("staleflow-table4-qwen3-30b-a3b")


def _cost_model(**kw) -> SimConfig:
    base = dict(
        mode="cost_model", instances=4, profile=PROFILE, prompt_tokens=128, group_size=4, batch_groups=8,
        lengths=LengthSpec(kind="lognormal", mean=600, tailness=60, cap=3000),
        trainer=TrainerModel(base_s=2.0, s_per_token=2e-4), steps=12, warmup_steps=2,
        policy="staleflow", eta=2, weight_sync="per_instance",
    )
    base.update(kw)
    return SimConfig(**base)


def _slots(**kw) -> SimConfig:
    base = dict(rho=1.5, q=2, tailness=60, c_over_b=1, batch_groups=8, group_size=4, steps=40, warmup_steps=5)
    base.update(kw)
    return closed_form_config(**base)


@pytest.mark.parametrize(
    "config",
    [
        _cost_model(policy="synchronous", eta=None, weight_sync="global"),
        _cost_model(policy="synchronous", eta=None, weight_sync="global", partial_rollout=False),
        _cost_model(policy="synchronous", eta=None, weight_sync="per_instance"),
        _slots(policy="synchronous", q=None),
    ],
    ids=["cost-global", "cost-barrier", "cost-per-instance", "slots"],
)
def test_synchronous_generates_nothing_while_training(config):
    sim = Simulation(config)
    result = sim.run()
    assert result.steps == len(result.train_steps)
    assert all(sim.timeline.peak(start, end) == 0 for start, end in result.train_steps)
    assert set(result.staleness) == {0}
    assert result.trainer_idle_ratio > 0.2  # it waits for every batch


@pytest.mark.parametrize(
    "config",
    [
        _cost_model(policy="staleflow", eta=1),
        _cost_model(policy="staleflow", eta=2, weight_sync="global"),
        _cost_model(policy="staleflow", eta=2, weight_sync="global", partial_rollout=False),
        _cost_model(policy="one_step", eta=None),
        _cost_model(policy="in_flight_limit", eta=2),
        _cost_model(policy="queue_max", eta=1),
        _slots(policy="staleflow", eta=1, q=None),
        _slots(policy="queue_max", eta=2, q=None, rho=2.0),
    ],
    ids=["sf1", "sf2-global", "sf2-barrier", "one-step", "in-flight", "queue-max", "slots-sf1", "slots-queue-max"],
)
def test_bounded_policies_never_train_beyond_eta(config):
    result = simulate(config)
    eta = {"one_step": 1}.get(config.policy, config.eta)
    assert result.max_staleness <= eta
    assert max(result.step_max_staleness) <= eta
    assert result.consumed == config.steps * config.batch_groups
    assert len(result.trained_lengths) == (config.steps - config.warmup_steps) * config.batch_samples


def test_async_policies_beat_the_synchronous_baseline_on_throughput():
    sync = simulate(_cost_model(policy="synchronous", eta=None, weight_sync="global"))
    stale = simulate(_cost_model(policy="staleflow", eta=2))
    assert stale.trained_tokens_per_s > sync.trained_tokens_per_s
    assert stale.mean_staleness > sync.mean_staleness


def test_conservation_holds_with_redundancy_aborts():
    config = _cost_model(policy="staleflow", eta=1, batch_redundancy=3)
    sim = Simulation(config)
    result = sim.run()
    c = sim.policy.counters
    assert c.conserved()
    assert result.aborted > 0
    assert c.consumed == config.steps * config.batch_groups
    assert len(sim.groups) == c.in_flight + c.pending  # the simulator forgot exactly what the policy let go


def _record_pulls(monkeypatch, sim):
    pulls = []
    original = Fleet._pull

    def spy(fleet, inst, version):
        if inst.version != version:
            pulls.append((inst.idx, inst.empty(), all(i.empty() for i in fleet.instances)))
        original(fleet, inst, version)

    monkeypatch.setattr(Fleet, "_pull", spy)
    return pulls


def test_barrier_pulls_only_when_every_instance_drained(monkeypatch):
    sim = Simulation(_cost_model(weight_sync="global", partial_rollout=False))
    pulls = _record_pulls(monkeypatch, sim)
    sim.run()
    assert pulls and all(everyone_empty for _, _, everyone_empty in pulls)


def test_per_instance_pulls_when_itself_drained_without_waiting_for_others(monkeypatch):
    sim = Simulation(_cost_model(weight_sync="per_instance"))
    pulls = _record_pulls(monkeypatch, sim)
    sim.run()
    assert pulls and all(self_empty for _, self_empty, _ in pulls)
    assert any(not everyone_empty for _, _, everyone_empty in pulls)


def test_global_partial_rollout_pulls_everywhere_at_once_mid_flight(monkeypatch):
    config = _cost_model(weight_sync="global", partial_rollout=True)
    sim = Simulation(config)
    pulls = _record_pulls(monkeypatch, sim)
    result = sim.run()
    assert len(pulls) == config.instances * (config.steps - 1)  # every publish but the last
    assert any(not self_empty for _, self_empty, _ in pulls)
    assert result.pulls == len(pulls)


def test_queue_drop_drops_when_train_bound_and_not_when_rollout_bound():
    assert simulate(_slots(rho=2.0)).dropped > 0
    assert simulate(_slots(rho=0.5)).dropped == 0


def test_slot_throughput_and_idle_ratios_follow_utilization():
    config = _slots(rho=0.5, tailness=0, steps=60, warmup_steps=10)
    rollout_bound = simulate(config)
    v_r = config.slots * config.speed
    assert rollout_bound.trained_tokens_per_s == pytest.approx(v_r, rel=0.02)
    assert rollout_bound.trainer_idle_ratio == pytest.approx(0.5, abs=0.02)
    train_bound = simulate(_slots(rho=2.0, tailness=0, steps=60, warmup_steps=10))
    assert train_bound.trainer_idle_ratio == pytest.approx(0.0, abs=1e-9)
    assert train_bound.trained_tokens_per_s == pytest.approx(v_r / 2, rel=0.02)
    assert train_bound.rollout_idle_ratio == pytest.approx(0.0, abs=1e-9)


def test_runs_are_deterministic_per_seed():
    a, b = simulate(_cost_model(seed=7)), simulate(_cost_model(seed=7))
    c = simulate(_cost_model(seed=8))
    strip = lambda r: {k: v for k, v in r.summary().items() if k != "wall_s"}  # noqa: E731
    assert strip(a) == strip(b) and a.staleness == b.staleness
    assert strip(a) != strip(c)


def test_event_budget_reports_a_stall():
    with pytest.raises(SimulationStalled, match="event budget"):
        simulate(replace(_cost_model(), max_events=50))


def test_report_renders_text_and_png(tmp_path):
    result = simulate(_slots())
    text = text_report(result)
    assert "predicted staleness" in text and "staleness mean / max" in text
    assert f"{result.mean_staleness:.3f}" in text
    txt, png = write_report(result, tmp_path / "out")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert txt.read_text().strip() == text.strip()
    many = simulate(_cost_model(instances=20))
    assert len(many.timeline_running) == 20 and len(many.timeline_t) == many.timeline_running[0].__len__()
    assert plot_report(many, tmp_path / "many.png").stat().st_size > 0
