"""The simulator's coordinated fleet: every strategy combination runs, keeps eta, and every snapshot validates."""

import dataclasses

import pytest

from rlflow.operators.cost_profile import CostProfile
from rlflow.sim import LengthSpec, SimConfig, TrainerModel
from rlflow.sim.config import SimConfigError
from rlflow.sim.loop import Simulation


def _cfg(**kw):
    base = dict(mode="cost_model", instances=4, profile=CostProfile.load("staleflow-table4-qwen3-30b-a3b"),
                lengths=LengthSpec(kind="lognormal", mean=2048, tailness=60, cap=8192), prompt_tokens=128,
                group_size=4, batch_groups=8, policy="staleflow", eta=1,
                trainer=TrainerModel(base_s=2.0, s_per_token=1e-5), steps=5, warmup_steps=1)
    base.update(kw)
    return SimConfig(**base)


@pytest.mark.parametrize("extra", [
    dict(coordinator=True, weight_sync="greedy"),
    dict(coordinator=True, weight_sync="global", partial_rollout=False),
    dict(routing="cost_model", weight_sync="throughput_aware", migration="threshold", phi_wait=1),
    dict(coordinator=True, weight_sync="per_instance", migration="repack"),
    dict(coordinator=True, weight_sync="greedy", dispatch="skew_aware", ranker="noisy"),
])
def test_coordinated_runs_keep_eta_and_validate_every_snapshot(extra):
    sim = Simulation(_cfg(**extra))
    r = sim.run()
    assert r.consumed == 5 * 8 and max(r.staleness) <= 1
    assert sim.rollout.coord.rejected == 0 and sim.rollout.coord.cycles > 0


def test_coordination_needs_cost_model_mode():
    with pytest.raises(SimConfigError, match="cost_model"):
        SimConfig(mode="slots", routing="cost_model")
    assert not SimConfig().coordinated


def test_throughput_aware_sync_interrupts_less_than_greedy_when_instances_are_busy_at_a_publish():
    """§6.5: greedy sync pulls "even while many trajectories are still running" and interrupts them; the
    throughput-aware one (Algorithm 4) leaves a busy instance draining until new work clears mu * ideal.
    One instance, a fast trainer and eta = 2 keep it loaded at every publish; both use least-loaded
    routing (the ablation's "+S"), so the difference is the sync alone."""
    runs = {}
    for sync in ("greedy", "throughput_aware"):
        sim = Simulation(_cfg(coordinator=True, weight_sync=sync, instances=1, group_size=16, batch_groups=16, eta=2,
                              trainer=TrainerModel(t_step=1.0)))
        r = sim.run()
        assert max(r.staleness) <= 2 and sim.rollout.coord.rejected == 0
        runs[sync] = sim.rollout
    assert runs["throughput_aware"].interrupts < runs["greedy"].interrupts
    assert runs["throughput_aware"].pulls <= runs["greedy"].pulls


def test_skew_aware_dispatch_predicts_each_prompt_once_and_the_ts_keeps_its_lanes_apart():
    """The length ranker answers a prompt once (its error is not redrawn at each top-up) and ranks prompts, not their
    samples: every member of a group carries one prediction. Every top-up plans the whole pool again, marking alpha of
    its prompts long-tail as whole groups and queueing them longest predicted first within each lane (as `rlflow run`
    re-plans when prompts arrive, runtime/dispatch_lanes.py); and the TS's per-lane queues are, at every cycle,
    exactly the lane filter of its whole queue (what routing would have read)."""
    profile = dataclasses.replace(CostProfile.load("staleflow-table4-qwen3-30b-a3b"), max_running=4)  # work waits
    sim = Simulation(_cfg(coordinator=True, weight_sync="global", dispatch="skew_aware", ranker="noisy",
                          long_tail_fraction=0.25, instances=4, steps=6, profile=profile))
    fleet, seen, checked = sim.rollout, {}, []
    top_up, cycle = fleet._top_up, fleet.coord.cycle

    def watched_top_up():
        top_up()
        groups = list(fleet.ts.initial.values())
        for g in groups:
            (predicted,) = {s.predicted for s in g.samples}  # one prediction per prompt
            assert seen.setdefault(g.gid, predicted) == predicted  # and the same at every top-up
            assert predicted != sum(g.lengths) / len(g.lengths)  # the noisy ranker errs
        marked = [all(id(s) in fleet._long for s in g.samples) for g in groups]
        assert all(m or not any(id(s) in fleet._long for s in g.samples) for m, g in zip(marked, groups))  # whole groups
        assert sum(marked) == int(0.25 * len(groups)) and marked == sorted(marked, reverse=True)  # long-tail lane first
        for lane in (True, False):  # LPT within each lane
            order = [g.samples[0].predicted for m, g in zip(marked, groups) if m == lane]
            assert order == sorted(order, reverse=True)

    def watched_cycle(snapshot, verify, reserve=None, lanes=None, **kw):
        queue = snapshot.ts_trajs
        for member, _ in lanes or []:
            assert list(queue.only(member)) == [t for t in queue if member(t)]
            assert member in queue.parts
        checked.append(queue.partial)
        return cycle(snapshot, verify, reserve, lanes, **kw)

    fleet._top_up, fleet.coord.cycle = watched_top_up, watched_cycle
    r = sim.run()
    assert r.consumed == 6 * 8 and fleet.coord.rejected == 0 and max(checked) > 0  # partial ones waited


def test_prompts_marked_long_tail_still_run_when_the_fleet_shrinks_to_one_instance():
    """Scaled down to one instance, dispatch has no split (N_l = 0), and groups marked long-tail earlier still have
    partial trajectories waiting: both lanes then use every instance, as the runtime's lanes() does. Without that
    they would wait for a long-tail lane with no instance, and the run would never finish."""
    profile = dataclasses.replace(CostProfile.load("staleflow-table4-qwen3-30b-a3b"), max_running=4)
    sim = Simulation(_cfg(instances=3, profile=profile, steps=8, coordinator=True, weight_sync="global",
                          dispatch="skew_aware", ranker="noisy", scale=((3, 1),), max_events=50_000))
    r = sim.run()
    assert r.consumed == 8 * 8 and sim.rollout._n_long == 0 and len(sim.rollout.serving) == 1
    assert r.scale_events and r.scale_events[0][2] == 1
