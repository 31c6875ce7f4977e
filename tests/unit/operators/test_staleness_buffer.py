"""Hand-worked scenarios for StaleFlow's staleness buffers (StaleFlow §4.2-4.3, Figures 7 and 8)."""

from dataclasses import replace

import pytest

from rlflow.operators.groups import GroupAssembler
from rlflow.operators.policy import InvariantViolation, StalenessError, staleness
from rlflow.operators.policy_kinds import make_policy
from rlflow.operators.staleness_buffer import READY, STUCK, WAITING, StaleFlowManager


def manager(eta, batch_size, batch_redundancy=0) -> StaleFlowManager:
    return make_policy("staleflow", batch_size=batch_size, eta=eta, batch_redundancy=batch_redundancy)


def reserve_all(m, gids, version):
    for g in gids:
        m.reserve(g, version)


def test_staleness_is_trainer_version_minus_first_token_version():
    assert staleness(5, 5) == 0
    assert staleness(5, 3) == 2


def test_reserve_scans_backward_from_v_traj_plus_eta():
    m = manager(eta=2, batch_size=2)
    reserve_all(m, ["a", "b", "c", "d", "e"], 0)
    assert m.layout() == {0: ([], ["e"]), 1: ([], ["c", "d"]), 2: ([], ["a", "b"])}
    assert m.verify(0)
    m.reserve("f", 0)
    assert not m.verify(0)  # every buffer V_traj .. V_traj + eta is full


def test_occupy_takes_the_earliest_empty_entry():
    m = manager(eta=2, batch_size=2)
    m.reserve("a", 0)  # reserved in buffer 2 (worst case)
    m.occupy("a")
    assert m.position("a") == (0, True)  # greedy: buffer 0, where it trains soonest


def test_figure7_left_reserve_occupy_consume_with_eta_1():
    m = manager(eta=1, batch_size=3)
    reserve_all(m, ["t1", "t2", "t3"], 0)
    assert m.layout() == {1: ([], ["t1", "t2", "t3"])}
    assert (m.state(0), m.state(1)) == (WAITING, STUCK)
    reserve_all(m, ["t4", "t5", "t6"], 0)
    assert not m.verify(0) and m.state(0) == STUCK

    m.occupy("t1")  # deletion in buffer 1 pulls t4 there; t1 occupies buffer 0
    assert m.layout() == {0: (["t1"], ["t5", "t6"]), 1: ([], ["t2", "t3", "t4"])}
    m.occupy("t2")
    m.occupy("t3")
    assert m.layout() == {0: (["t1", "t2", "t3"], []), 1: ([], ["t4", "t5", "t6"])}
    assert (m.state(0), m.state(1)) == (READY, STUCK)

    batch = m.consume()
    assert (batch.version, [e.gid for e in batch.entries], batch.staleness()) == (0, ["t1", "t2", "t3"], [0, 0, 0])
    assert m.version == 1
    assert not m.verify(0)  # buffer 1 is stuck: V_traj = 0 can go nowhere else
    assert m.verify(1)  # a newer V_traj unlocks buffer 2
    m.reserve("t7", 1)
    assert m.position("t7") == (2, False)

    m.occupy("t5", version=0)  # partial rollout on newer weights: V_traj stays the oldest
    m.occupy("t7")  # buffer 1 is full, so t7 occupies buffer 2
    assert m.layout() == {1: (["t5"], ["t4", "t6"]), 2: (["t7"], [])}
    m.occupy("t4")
    m.occupy("t6")
    batch = m.consume()
    assert (batch.version, batch.staleness()) == (1, [1, 1, 1])
    assert m.layout() == {2: (["t7"], [])}


def test_figure7_right_deletion_moves_reserved_entries_later_in_a_chain():
    m = manager(eta=2, batch_size=2)
    reserve_all(m, ["a1", "a2"], 0)
    m.occupy("a1")
    m.occupy("a2")
    m.consume()
    reserve_all(m, ["A", "A2", "B", "B2"], 1)
    m.reserve("D", 0)  # dispatched on older weights: buffers 1..2 only, and buffer 2 is full
    m.reserve("X", 1)
    m.occupy("X")
    assert m.layout() == {1: (["X"], ["D"]), 2: ([], ["B", "B2"]), 3: ([], ["A", "A2"])}
    assert m.state(1) == STUCK

    m.occupy("A")  # (2) B moves to A's place in 3; (3) D moves to B's place in 2; (4) A occupies 1
    assert m.layout() == {1: (["X", "A"], []), 2: ([], ["B2", "D"]), 3: ([], ["A2", "B"])}
    assert m.ready()
    assert [e.gid for e in m.consume().entries] == ["X", "A"]


def test_eta_0_is_synchronous():
    m = manager(eta=0, batch_size=2)
    assert m.verify(0) and not m.verify(1)
    reserve_all(m, ["a", "b"], 0)
    assert not m.verify(0)  # buffer 0 full: a barrier until it trains
    m.occupy("a")
    assert not m.ready()
    m.occupy("b")
    assert m.consume().staleness() == [0, 0]
    assert not m.verify(0) and m.verify(1)  # only groups started at the current version
    with pytest.raises(StalenessError, match="eta=0"):
        m.reserve("late", 0)


def test_synchronous_policy_is_staleflow_with_eta_0():
    m = make_policy("synchronous", batch_size=1)
    assert m.eta == 0 and m.name == "synchronous"
    m.reserve("a", 0)
    m.occupy("a")
    m.consume()
    assert not m.verify(0) and m.verify(1)


def test_eta_1_allows_exactly_one_version_behind():
    m = manager(eta=1, batch_size=1)
    m.reserve("x", 0)  # buffer 1
    m.reserve("y", 0)  # buffer 0
    m.occupy("y")
    assert m.consume().staleness() == [0]
    assert not m.verify(0)  # buffer 1 is stuck on x
    m.occupy("x")
    assert m.consume().staleness() == [1]
    assert m.verify(1)  # one version behind
    assert not m.verify(0)  # two versions behind
    with pytest.raises(StalenessError, match=r"V_traj \+ eta = 1 < trainer version 2"):
        m.reserve("z", 0)
    m.reserve("z", 1)
    m.occupy("z")
    assert m.consume().staleness() == [1]


def test_group_entry_occupies_only_when_all_members_are_done():
    # Figure 8(a): entry C stays reserved while two of its trajectories are unfinished
    m, groups = manager(eta=1, batch_size=1), GroupAssembler(group_size=4)
    m.reserve("C", 0)
    groups.open("C", 0)
    for i in range(4):
        groups.launch("C", i, 0)
    assert groups.finish("C", 0) is None and groups.finish("C", 1) is None
    assert m.position("C") == (1, False)
    groups.finish("C", 2)
    done = groups.finish("C", 3)
    assert (done.version, done.surplus) == (0, [])
    m.occupy("C", done.version)
    assert m.ready()


def test_group_version_is_the_minimum_over_members():
    m, groups = manager(eta=2, batch_size=1), GroupAssembler(group_size=2)
    reserve_all(m, ["x", "y"], 0)
    m.occupy("x")
    m.consume()
    groups.open("y", 0)
    groups.launch("y", "m0", 0)
    groups.launch("y", "m1", 1)  # started after the trainer moved on
    groups.finish("y", "m1")
    done = groups.finish("y", "m0")
    assert done.version == 0
    m.occupy("y", done.version)
    assert m.consume().staleness() == [1]


def test_batch_redundancy_aborts_the_surplus_when_a_buffer_is_ready():
    # Figure 8(b), batch level: B + r entries per buffer, the first B to finish train
    m = manager(eta=0, batch_size=2, batch_redundancy=1)
    reserve_all(m, ["a", "b", "c"], 0)
    assert not m.verify(0)
    assert m.occupy("b") == []
    aborted = m.occupy("c")
    assert [(e.gid, e.version) for e in aborted] == [("a", 0)]
    assert m.counters.aborted == 1 and m.counters.in_flight == 0 and m.counters.conserved()
    assert not m.verify(0)  # a Ready buffer takes no new reservation
    with pytest.raises(StalenessError, match="unknown group"):
        m.occupy("a")
    assert [e.gid for e in m.consume().entries] == ["b", "c"]


def test_filtering_a_slow_reserved_entry_moves_occupied_entries_forward():
    # Figure 8(c): training is stalled on a delayed trajectory; filtering it frees buffer 1 at once
    m = manager(eta=1, batch_size=2)
    reserve_all(m, ["a", "b"], 0)  # buffer 1
    reserve_all(m, ["c", "d"], 0)  # buffer 0
    m.occupy("c")
    m.occupy("d")
    m.consume()
    m.occupy("a")
    reserve_all(m, ["e", "f"], 1)
    m.occupy("e")
    m.occupy("f")
    assert m.layout() == {1: (["a"], ["b"]), 2: (["e", "f"], [])}
    assert (m.state(1), m.state(2), m.ready()) == (STUCK, READY, False)

    assert m.filter("b") == []
    assert m.layout() == {1: (["a", "e"], []), 2: (["f"], [])}
    assert m.counters.filtered == 1 and m.counters.conserved()
    batch = m.consume()
    assert [e.gid for e in batch.entries] == ["a", "e"] and batch.staleness() == [1, 0]


def test_filtering_an_occupied_entry_refills_from_later_buffers():
    m = manager(eta=2, batch_size=2)
    reserve_all(m, list("abcd"), 0)
    for g in "abcd":
        m.occupy(g)
    assert m.layout() == {0: (["a", "b"], []), 1: (["c", "d"], [])}
    m.filter("a")  # e.g. uniform rewards: no learning signal
    assert m.layout() == {0: (["b", "c"], []), 1: (["d"], [])}  # the earliest arrival moves forward
    assert m.ready()


def test_abort_frees_the_entry_for_new_work():
    m = manager(eta=0, batch_size=1)
    m.reserve("a", 0)
    assert not m.verify(0)
    assert m.abort("a") == []
    assert m.verify(0) and m.counters.aborted == 1 and m.counters.conserved()


@pytest.mark.parametrize(
    "misuse, message",
    [
        (lambda m: m.consume(), r"consume\(\): buffer V_buf=1 is waiting \(1/2 occupied"),
        (lambda m: m.occupy("ghost"), r"occupy\('ghost'\): unknown group"),
        (lambda m: m.occupy("r", version=0), r"occupy\('r', V_traj=0\): older than its reserved V_traj=1"),
        (lambda m: m.occupy("o"), r"occupy\('o'\): group is already occupied"),
        (lambda m: m.abort("o"), r"abort\('o'\): group is already occupied"),
        (lambda m: m.filter("ghost"), r"filter\('ghost'\): unknown group"),
        (lambda m: m.reserve("r", 1), r"reserve\('r'\): group is already tracked"),
        (lambda m: m.reserve("n", 2), r"V_traj=2 is not a published version \(trainer version is 1"),
        (lambda m: m.reserve("n", -1), r"V_traj=-1 is not a published version"),
    ],
)
def test_misuse_raises_a_clear_error_and_changes_nothing(misuse, message):
    m = manager(eta=1, batch_size=2)
    reserve_all(m, ["x", "y"], 0)
    m.occupy("x")
    m.occupy("y")
    m.consume()  # version 1
    m.reserve("o", 1)
    m.occupy("o")
    m.reserve("r", 1)
    before = (m.layout(), replace(m.counters), m.version)
    with pytest.raises(StalenessError, match=message):
        misuse(m)
    assert (m.layout(), m.counters, m.version) == before


def test_reserve_refuses_a_version_the_bound_forbids():
    m = manager(eta=1, batch_size=1)
    for v in range(2):
        m.reserve(f"g{v}", v)
        m.occupy(f"g{v}")
        m.consume()
    with pytest.raises(StalenessError, match=r"reserve\('old', V_traj=0\): V_traj \+ eta = 1 < trainer version 2"):
        m.reserve("old", 0)
    m.reserve("a", 1)  # buffer 2
    m.reserve("b", 2)  # buffer 3
    with pytest.raises(StalenessError, match=r"reserve\('c', V_traj=1\): buffers 2..2 are full or stuck"):
        m.reserve("c", 1)


def test_check_invariants_detects_broken_conservation():
    m = manager(eta=1, batch_size=1)
    m.reserve("a", 0)
    m.check_invariants()
    m.counters.in_flight = 0
    with pytest.raises(InvariantViolation, match="conservation broken"):
        m.check_invariants()


def test_tracked_entries_never_exceed_eta_plus_one_batches():
    m = manager(eta=2, batch_size=3, batch_redundancy=1)
    n = 0
    while m.verify(0):
        m.reserve(n, 0)
        n += 1
    assert n == (2 + 1) * (3 + 1)
