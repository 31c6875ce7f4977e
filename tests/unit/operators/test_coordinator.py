"""The snapshot -> command cycle: speculative state (Table 1, Eq. 1) and Algorithm 1's order."""

import pytest

from rlflow.operators.commands import Abort, Interrupt, Pull, Route
from rlflow.operators.coordinator import CoordinationConfig, Coordinator, SpeculativeState
from rlflow.operators.routing import CostModel
from rlflow.operators.snapshot import InstanceSnapshot, Snapshot, TrajView

COST = CostModel(k1=0.001, k2=1.0, k3=0.5, k4=1.0, k5=1.0, kv_budget=1000.0)


def test_table1_effects_and_eq1_validation():
    P = SpeculativeState(2)
    P.issue(Route(0, ("a", "b", "c")))
    P.issue(Interrupt(0, ("a",)))
    P.issue(Abort(0, ("b",)))
    P.issue(Route(1, ("d",)))
    P.issue(Pull(1, 3))
    assert P.accum_traj_num == [1, 0] and P.inst_version == [0, 3]
    # the snapshot still shows 'b' running on 0: the abort has not taken effect -> rejected
    stale = Snapshot([InstanceSnapshot(0, run_trajs=["b", "c"]), InstanceSnapshot(1, inst_version=3)])
    assert not P.accepts(stale)
    # 'c' completed: it still counts (complete_trajs), so the snapshot is accepted
    ok = Snapshot([InstanceSnapshot(0, complete_trajs=1), InstanceSnapshot(1, inst_version=3)])
    assert P.accepts(ok)
    assert not P.accepts(Snapshot([InstanceSnapshot(0, complete_trajs=1), InstanceSnapshot(1, inst_version=2)]))


def test_cycle_rejects_outdated_snapshot_until_commands_take_effect():
    coord = Coordinator(2, CoordinationConfig(routing="least_loaded"))
    a, b = TrajView("a", "g"), TrajView("b", "g")
    snap = Snapshot([InstanceSnapshot(0), InstanceSnapshot(1)], [a, b], 0)
    cmds = coord.cycle(snap, verify=lambda v: True)
    assert cmds == [Route(0, (a,)), Route(1, (b,))]
    assert coord.cycle(snap, verify=lambda v: True) is None  # routes not visible yet
    done = Snapshot([InstanceSnapshot(0, run_trajs=[a], kv_cache=0), InstanceSnapshot(1, complete_trajs=1)], [], 0)
    assert coord.cycle(done, verify=lambda v: True) == [] and coord.rejected == 1


def test_algorithm1_sync_interrupts_then_pulls_then_reroutes_with_v_traj_kept():
    coord = Coordinator(2, CoordinationConfig(routing="least_loaded", sync="greedy"), cost=COST, validate=False)
    p = TrajView("p", "g", v_traj=0, tokens=10)
    snap = Snapshot([InstanceSnapshot(0, 10.0, [p], [], 0, 0), InstanceSnapshot(1, 0.0, [], [], 0, 1)], [], 1)
    cmds = coord.cycle(snap, verify=lambda v: False)  # the policy admits nothing new
    assert cmds[:2] == [Interrupt(0, (p,)), Pull(0, 1)]
    # the interrupted trajectory keeps V_traj = 0 and resumes on a v1 instance (both now v1; least loaded, lower idx)
    assert cmds[2:] == [Route(0, (p,))]
    assert p.v_traj == 0


def test_migration_then_routing_redistributes_excess_waiting_work():
    cfg = CoordinationConfig(routing="least_loaded", migration="threshold", phi_wait=1, phi_throughput=100)
    coord = Coordinator(2, cfg, cost=COST, validate=False)
    w = [TrajView(f"w{j}", "g", 0, 5) for j in range(3)]
    snap = Snapshot([InstanceSnapshot(0, 900.0, [TrajView("r", "g", 0, 900)], w, 0, 0),
                     InstanceSnapshot(1, 0.0, [], [], 0, 0)], [], 0)
    cmds = coord.cycle(snap, verify=lambda v: True)
    assert cmds[0] == Interrupt(0, (w[1], w[2]))
    assert cmds[1:] == [Route(1, (w[1], w[2]))]


def test_repack_moves_source_work_and_released_source_pulls():
    cfg = CoordinationConfig(routing="least_loaded", sync="per_instance", migration="repack", batch_limit=10)
    coord = Coordinator(3, cfg, cost=COST, validate=False)
    t0 = [TrajView(f"a{j}", "g", 0, 5) for j in range(2)]
    t1 = [TrajView(f"b{j}", "g", 0, 10) for j in range(3)]
    snap = Snapshot([InstanceSnapshot(0, 10.0, t0, [], 0, 0, kv_prev=20.0),
                     InstanceSnapshot(1, 30.0, t1, [], 0, 0, kv_prev=40.0),
                     InstanceSnapshot(2, 0.0, [], [], 0, 1)], [], 1)
    cmds = coord.cycle(snap, verify=lambda v: True)
    assert cmds == [Interrupt(0, tuple(t0)), Route(1, tuple(t0)), Pull(0, 1)]


def test_cost_model_strategies_need_a_profile():
    with pytest.raises(ValueError, match="cost model"):
        Coordinator(1, CoordinationConfig(routing="cost_model"))
    with pytest.raises(ValueError, match="routing"):
        CoordinationConfig(routing="random")
