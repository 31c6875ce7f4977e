"""The trajectory server (runtime/trajectory_server.py): what waits to be routed, and the V_traj each waits with."""

from __future__ import annotations

from rlflow.runtime.trajectory_server import TrajectoryServer, row_tokens
from rlflow.stages.trajectory import Trajectory


def group(gid: str, n: int = 2, prompt_len: int = 3) -> list[Trajectory]:
    return [Trajectory(group_id=gid, index=i, prompt="p", answer="a", prompt_ids=list(range(prompt_len)))
            for i in range(n)]


def test_an_initial_group_waits_without_a_version_until_routing_reserves_it():
    ts = TrajectoryServer()
    ts.add_group("g0", group("g0"))
    ts.add_group("g1", group("g1"))
    assert ts.initial_groups == 2
    assert [r.traj_id for r in ts.initial_rows()] == ["g0/0", "g1/0"]  # one per group, in draw order
    assert {v.tid: v.v_traj for v in ts.views()} == {"g0/0": None, "g0/1": None, "g1/0": None, "g1/1": None}

    ts.reserve("g0", 5)
    assert ts.initial_groups == 1 and ts.reserved == {"g0": 5}
    assert {v.tid: v.v_traj for v in ts.views() if v.gid == "g0"} == {"g0/0": 5, "g0/1": 5}
    assert ts.pop("g0/1").version == 5  # the row routed carries its V_traj too
    assert "g0/1" not in ts and "g0/0" in ts


def test_a_returned_partial_keeps_its_oldest_version_and_a_fresh_member_takes_the_groups():
    ts = TrajectoryServer()
    ts.add_group("g", group("g"))
    ts.reserve("g", 2)
    partial, fresh = ts.pop("g/0"), ts.pop("g/1")
    partial.completion_ids, partial.version = [7, 8], 1  # generated on version 1 before an interrupt
    fresh.version = 9
    ts.queue(partial)
    ts.queue(fresh)
    views = {v.tid: v for v in ts.views()}
    assert views["g/0"].v_traj == 1 and views["g/1"].v_traj == 2
    assert views["g/0"].tokens == row_tokens(partial) == 5.0  # prompt + generated so far: the KV it brings


def test_forgetting_a_group_removes_its_waiting_members_only():
    ts = TrajectoryServer()
    ts.add_group("a", group("a", 3))
    ts.add_group("b", group("b"))
    ts.reserve("a", 0)
    ts.pop("a/0")  # routed: not waiting any more
    assert ts.forget_group("a") == {"a/1", "a/2"}
    assert "a" not in ts.reserved
    assert sorted(v.tid for v in ts.views()) == ["b/0", "b/1"]
    ts.drop("b/1")
    ts.drop("b/1")  # an abort of something no longer here is a no-op
    assert [v.tid for v in ts.views()] == ["b/0"]
