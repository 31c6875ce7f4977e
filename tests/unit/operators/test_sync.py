"""Synchronization strategies (StaleFlow §5.3, Algorithm 4; Laminar per-instance; global barrier)."""

from functools import partial

import pytest

from rlflow.operators.commands import Interrupt, Pull, Route
from rlflow.operators.coordinator import CoordinationConfig, Coordinator
from rlflow.operators.routing import CostModel, route_cost_model, route_least_loaded
from rlflow.operators.snapshot import InstanceSnapshot, Snapshot, TrajView
from rlflow.operators.sync import sync_global, sync_greedy, sync_per_instance, sync_throughput_aware

COST = CostModel(k1=0.001, k2=1.0, k3=0.5, k4=1.0, k5=1.0, kv_budget=1000.0)


def inst(idx, version=0, run=0):
    return InstanceSnapshot(idx, 0.0, [TrajView(f"r{idx}.{j}") for j in range(run)], [], 0, version)


def test_greedy_pulls_every_instance_behind():
    d = sync_greedy([inst(0, 0), inst(1, 2), inst(2, 1)], [], 2)
    assert d.pull == [0, 2] and not d.hold


def test_per_instance_holds_behind_and_pulls_when_drained():
    d = sync_per_instance([inst(0, 0, run=2), inst(1, 0), inst(2, 1)], [], 1)
    assert d.pull == [1] and d.hold == frozenset({0, 1})


def test_global_barrier_waits_for_all_then_pulls_all():
    insts = [inst(0, 0, run=1), inst(1, 0)]
    assert sync_global(insts, [], 1).pull == [] and sync_global(insts, [], 1).hold == {0, 1}
    assert sync_global([inst(0, 0), inst(1, 0)], [], 1).pull == [0, 1]
    assert sync_global(insts, [], 1, partial_rollout=True).pull == [0, 1]


def test_throughput_aware_pulls_only_when_blocked_and_new_work_would_route():
    # the policy only admits v1; instance 0 is at v0 and idle, instance 1 at v1 and heavily loaded
    verify = lambda v: v >= 1  # noqa: E731
    route = partial(route_cost_model, cost=COST, verify=verify, mu=0.3)
    ts = [TrajView("a", "a", None, 0.0)]
    d = sync_throughput_aware([inst(0, 0), inst(1, 1, run=8)], ts, 1, verify=verify, route=route)
    assert d.pull == [0]
    # a v0 partial trajectory is routable to instance 0 on its current weights: not eligible
    ts2 = ts + [TrajView("p", "p", 0, 0.0)]
    assert sync_throughput_aware([inst(0, 0), inst(1, 1, run=8)], ts2, 1, verify=verify, route=route).pull == []
    # instance 0 busy (8 running): after a tentative update its gain (9/5.5 - 8/5 ~ 0.036) is below
    # mu * ideal = 0.15, while idle instance 2 takes the work: no pull, it keeps draining on v0
    d = sync_throughput_aware([inst(0, 0, run=8), inst(2, 1)], ts, 1, verify=verify, route=route)
    assert d.pull == []
    # nothing waits in the TS: no synchronization is worth its cost
    assert sync_throughput_aware([inst(0, 0)], [], 1, verify=verify, route=route).pull == []


# -- throughput-aware sync on hand-worked snapshots -------------------------------------------------
# COST: T(n) = n / (0.001 * kv + max(1, 0.5 n) + 1). A TS trajectory of 0 tokens has
# Delta T_ideal = 1 / (0 + max(1, 0.5) + 1) = 0.5, so the threshold is mu * 0.5 = 0.15 (mu = 0.3).
# Marginal gains on an instance with n running and no KV: n=0: 0.5, n=1: 1 - 0.5 = 0.5,
# n=2: 3/2.5 - 1 = 0.2 (clears 0.15), n=3: 4/3 - 1.2 = 0.133 (does not), n=8: 9/5.5 - 1.6 = 0.036.
V1_ONLY = lambda v: v >= 1  # noqa: E731  the staleness manager admits new groups at v1 only
COST_ROUTE = partial(route_cost_model, cost=COST, verify=V1_ONLY, mu=0.3)
VANILLA_ROUTE = partial(route_least_loaded, cost=COST, verify=V1_ONLY)  # what Coordinator._route_fn builds


def initial(n=1, tokens=0.0):
    return [TrajView(f"t{j}", f"g{j}", None, tokens) for j in range(n)]


@pytest.mark.parametrize("route", [COST_ROUTE, VANILLA_ROUTE], ids=["cost_model", "least_loaded"])
def test_throughput_aware_pulls_exactly_when_the_gain_clears_mu_times_ideal(route):
    ts = initial()
    for running, pulled in [(0, True), (1, True), (2, True), (3, False), (8, False)]:
        d = sync_throughput_aware([inst(0, 0, run=running)], ts, 1, verify=V1_ONLY, route=route)
        assert d.pull == ([0] if pulled else []), running
        assert sync_greedy([inst(0, 0, run=running)], ts, 1).pull == [0]  # greedy ignores the load


def test_throughput_aware_differs_from_greedy_under_vanilla_routing():
    """§5.3 step 2: the tentative routing must show a gain above the threshold, not merely room.

    Instance 0 (v0) runs 3 trajectories; nothing in the TS is routable to it on v0. Least-loaded routing
    on the tentative snapshot would route to it (it has room: 3 of max_running, 0 of M KV), which made the
    sync pull it exactly as greedy does. Its marginal gain is 4/3 - 1.2 = 0.133 < 0.15 = mu * Delta T_ideal,
    so StaleFlow keeps it draining on v0 (§6.5: vanilla sync "interrupt[s] more ongoing trajectories and
    incur[s] extra KV Cache recomputation"); greedy interrupts the 3 and pulls.
    """
    busy, ts = inst(0, 0, run=3), initial()
    tentative = busy.clone()
    tentative.inst_version = 1
    assert [r.inst for r in VANILLA_ROUTE([tentative], ts)] == [0]  # "room" alone would pull it
    assert sync_throughput_aware([busy], ts, 1, verify=V1_ONLY, route=VANILLA_ROUTE).pull == []
    assert sync_greedy([busy], ts, 1).pull == [0]
    # a second, idle instance behind is pulled in the same decision; the busy one keeps draining
    d = sync_throughput_aware([busy, inst(1, 0)], ts, 1, verify=V1_ONLY, route=VANILLA_ROUTE)
    assert d.pull == [1] and not d.hold
    assert sync_greedy([busy, inst(1, 0)], ts, 1).pull == [0, 1]


def test_throughput_aware_step1_an_instance_that_can_still_take_work_is_not_eligible():
    """§5.3 step 1: an instance behind the PS is a candidate only if no TS trajectory is routable to it now."""
    ts = initial()
    # the policy still admits groups at v0: the idle v0 instance takes work without a sync (greedy pulls it)
    assert sync_throughput_aware([inst(0, 0)], ts, 1, verify=lambda v: True, route=COST_ROUTE).pull == []
    assert sync_greedy([inst(0, 0)], ts, 1).pull == [0]
    # an interrupted trajectory with V_traj = 0 may resume on v0 weights: not eligible
    resumable = ts + [TrajView("p", "gp", 0, 0.0)]
    assert sync_throughput_aware([inst(0, 0)], resumable, 1, verify=V1_ONLY, route=COST_ROUTE).pull == []
    # one with V_traj = 1 may not (inst_version >= V_traj fails), so the instance is eligible and pulls
    newer = ts + [TrajView("p", "gp", 1, 0.0)]
    assert sync_throughput_aware([inst(0, 0)], newer, 1, verify=V1_ONLY, route=COST_ROUTE).pull == [0]


def test_throughput_aware_kv_budget_work_that_would_wait_gives_no_gain():
    """Eq. 3: gamma = 0 when the trajectory does not fit M, so the gain is 0 and there is no pull."""
    heavy = InstanceSnapshot(0, 900.0, [TrajView("r", "gr", 0, 900.0)], [], 0, 0)
    # 100 tokens fit (kv 1000 <= M): gain 2/3.0 - 1/2.9 = 0.322 >= 0.3 / 2.1 = 0.143 -> pull
    assert sync_throughput_aware([heavy], initial(tokens=100.0), 1, verify=V1_ONLY, route=COST_ROUTE).pull == [0]
    # 150 tokens do not (kv 1050 > M): the trajectory would wait -> gain 0 -> keep draining
    assert sync_throughput_aware([heavy], initial(tokens=150.0), 1, verify=V1_ONLY, route=COST_ROUTE).pull == []


def test_throughput_aware_judges_each_candidate_on_its_own_tentative_snapshot():
    """Algorithm 4 lines 15-16: S_temp <- S per candidate, so two idle instances behind are both pulled
    even though one TS trajectory could only go to one of them."""
    d = sync_throughput_aware([inst(0, 0), inst(1, 0), inst(2, 1, run=8)], initial(1), 1, verify=V1_ONLY, route=COST_ROUTE)
    assert d.pull == [0, 1]


def test_throughput_aware_needs_work_to_route_and_honours_mu():
    assert sync_throughput_aware([inst(0, 0)], [], 1, verify=V1_ONLY, route=COST_ROUTE).pull == []
    # explicit cost / mu (what a coordinator may pass) override the route's: at mu = 0.1 the threshold is
    # 0.05, so 3 running (gain 0.133) now pulls
    d = sync_throughput_aware([inst(0, 0, run=3)], initial(), 1, verify=V1_ONLY, route=VANILLA_ROUTE, cost=COST, mu=0.1)
    assert d.pull == [0]
    # without any cost model the tentative pass is the given routing: room is all it can test
    no_cost = partial(route_least_loaded, cost=None, verify=V1_ONLY)
    assert sync_throughput_aware([inst(0, 0, run=8)], initial(), 1, verify=V1_ONLY, route=no_cost).pull == [0]


def test_coordinator_cycle_throughput_aware_with_vanilla_routing_keeps_busy_instance_draining():
    """Algorithm 1 with sync=throughput_aware and least_loaded routing: the idle v0 instance pulls and
    takes the new work; the busy one (3 running, gain 0.133 < 0.15) is neither interrupted nor pulled."""
    coord = Coordinator(2, CoordinationConfig(routing="least_loaded", sync="throughput_aware"), cost=COST, validate=False)
    run = [TrajView(f"r{j}", "gr", 0, 0.0) for j in range(3)]
    snap = Snapshot([InstanceSnapshot(0, 0.0, run, [], 0, 0), InstanceSnapshot(1, 0.0, [], [], 0, 0)], initial(), 1)
    cmds = coord.cycle(snap, verify=V1_ONLY)
    assert cmds[0] == Pull(1, 1)
    assert not any(isinstance(c, (Interrupt, Pull)) and c.inst == 0 for c in cmds)
    assert [c.inst for c in cmds if isinstance(c, Route)] == [1]
