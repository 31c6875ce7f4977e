"""Synchronization strategies (staleflow.txt §5.3, Algorithm 4; Laminar per-instance; global barrier)."""

from functools import partial

from rlflow.operators.routing import CostModel, route_cost_model
from rlflow.operators.snapshot import InstanceSnapshot, TrajView
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
