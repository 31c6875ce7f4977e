"""Migration strategies: StaleFlow thresholds (Algorithm 5) and Laminar best-fit repack (Laminar Algorithm 1)."""

from rlflow.operators.migration import RepackMove, migrate_repack, migrate_threshold, repack_plan
from rlflow.operators.routing import CostModel
from rlflow.operators.snapshot import InstanceSnapshot, TrajView

COST = CostModel(k1=0.0, k2=1.0, k3=0.5, k4=1.0, k5=1.0, kv_budget=1000.0)


def inst(idx, run=0, wait=0, kv=0.0, kv_prev=None, version=0):
    return InstanceSnapshot(idx, kv, [TrajView(f"r{idx}.{j}") for j in range(run)],
                            [TrajView(f"w{idx}.{j}") for j in range(wait)], 0, version, kv_prev)


def test_wait_threshold_returns_excess_from_the_tail():
    insts = [inst(0, run=2, wait=5), inst(1, run=2, wait=3)]
    mig = migrate_threshold(insts, cost=COST, phi_wait=3, phi_throughput=5)
    assert [(i, [t.tid for t in ts]) for i, ts in mig] == [(0, ["w0.3", "w0.4"])]
    assert len(insts[0].wait_trajs) == 3


def test_throughput_gap_moves_everything_off_the_fastest_instance():
    # T = n / (max(1, n/2) + 1): n=1 -> 0.5, n=20 -> 20/11 ~ 1.82; gap 3.6 <= 5 keeps, > 3 moves
    insts = [inst(0, run=1), inst(1, run=20, wait=4)]
    assert migrate_threshold([i.clone() for i in insts], cost=COST, phi_wait=10, phi_throughput=5) == []
    mig = migrate_threshold(insts, cost=COST, phi_wait=3, phi_throughput=3)
    assert [i for i, _ in mig] == [1, 1]
    assert len(mig[0][1]) == 1 and len(mig[1][1]) == 23  # case 1's trajectory is not moved twice


def test_repack_best_fit_consolidates_ramping_down_instances():
    # C_max = 100, B = 10. Instance 3 is still ramping up (kv grew): not a candidate.
    insts = [inst(0, run=2, kv=10, kv_prev=20), inst(1, run=3, kv=30, kv_prev=40),
             inst(2, run=4, kv=50, kv_prev=60), inst(3, run=2, kv=10, kv_prev=5)]
    plan = repack_plan(insts, c_max=100, batch_limit=10)
    # 0 (smallest) -> densest fitting destination 2 (50 + 10 <= 100); 1 -> 2 (60 + 30 <= 100, 9 reqs)
    assert plan == [RepackMove(0, 2), RepackMove(1, 2)]


def test_repack_respects_batch_limit_and_version_groups():
    insts = [inst(0, run=6, kv=10, kv_prev=20), inst(1, run=6, kv=30, kv_prev=40),
             inst(2, run=1, kv=5, kv_prev=9, version=1)]
    assert repack_plan(insts[:2], c_max=100, batch_limit=10) == []  # 12 trajectories > B
    assert migrate_repack(insts, c_max=100, batch_limit=13) == [RepackMove(0, 1)]  # v1's lone instance stays
