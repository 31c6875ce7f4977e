"""The simpler staleness policies and the registry that builds every policy by name."""

from dataclasses import replace

import pytest

from rlflow.operators.policy import StalenessError
from rlflow.operators.policy_kinds import POLICIES, make_policy
from rlflow.operators.queues import InFlightLimit, OneStep, QueueDrop, QueueMax, Unbounded
from rlflow.operators.staleness_buffer import StaleFlowManager, Synchronous

# kind -> make_policy keywords giving staleness bound `eta` (None where the policy fixes it)
BOUNDED = {
    "staleflow": lambda eta: {"eta": eta},
    "in_flight_limit": lambda eta: {"eta": eta},
    "queue_drop": lambda eta: {"eta": eta, "capacity": 1000},
    "queue_max": lambda eta: {"eta": eta},
}
QUEUES = ["unbounded", "one_step", "in_flight_limit", "queue_drop", "queue_max"]
QUEUE_ARGS = {"in_flight_limit": {"eta": 1}, "queue_drop": {"capacity": 4, "eta": 1}, "queue_max": {"eta": 1}}


def advance(p, steps):
    """Train `steps` batches of fresh groups started at the current version."""
    for _ in range(steps):
        gids = [("fresh", p.version, i) for i in range(p.batch_size)]
        for g in gids:
            p.reserve(g, p.version)
        for g in gids:
            p.occupy(g)
        p.consume()


# -- registry ------------------------------------------------------------------------------------
def test_registry_names_are_exact():
    assert POLICIES == {
        "staleflow": StaleFlowManager,
        "synchronous": Synchronous,
        "one_step": OneStep,
        "in_flight_limit": InFlightLimit,
        "queue_drop": QueueDrop,
        "queue_max": QueueMax,
        "unbounded": Unbounded,
    }
    assert all(cls.name == kind for kind, cls in POLICIES.items())


@pytest.mark.parametrize(
    "kind, kwargs, eta",
    [
        ("staleflow", {"eta": 3, "batch_redundancy": 2}, 3),
        ("synchronous", {}, 0),
        ("synchronous", {"eta": 0}, 0),
        ("one_step", {}, 1),
        ("one_step", {"eta": 1}, 1),
        ("in_flight_limit", {"eta": 2}, 2),
        ("queue_drop", {"capacity": 8}, None),
        ("queue_drop", {"capacity": 8, "eta": 2}, 2),
        ("queue_max", {"eta": 2}, 2),
        ("queue_max", {"eta": 2, "capacity": 8}, 2),
        ("unbounded", {}, None),
    ],
)
def test_make_policy_builds_each_kind(kind, kwargs, eta):
    p = make_policy(kind, batch_size=4, **kwargs)
    assert (type(p), p.eta, p.batch_size) == (POLICIES[kind], eta, 4)


@pytest.mark.parametrize(
    "kind, kwargs, message",
    [
        (
            "stalefow",
            {},
            r"unknown staleness policy 'stalefow'; valid: in_flight_limit, one_step, queue_drop, queue_max,"
            r" staleflow, synchronous, unbounded",
        ),
        ("staleflow", {}, r"staleflow needs eta"),
        ("in_flight_limit", {}, r"in_flight_limit needs eta"),
        ("queue_max", {"capacity": 8}, r"queue_max needs eta"),
        ("queue_drop", {"eta": 1}, r"queue_drop needs capacity"),
        ("staleflow", {"eta": 1, "capacity": 8}, r"staleflow does not take capacity \(it takes batch_redundancy, eta\)"),
        ("unbounded", {"eta": 1}, r"unbounded does not take eta \(it takes only batch_size\)"),
        ("queue_drop", {"capacity": 8, "batch_redundancy": 1}, r"batch redundancy needs staleflow or synchronous"),
        ("one_step", {"eta": 2}, r"one_step has eta = 1 by definition, got eta=2"),
        ("synchronous", {"eta": 1}, r"synchronous has eta = 0 by definition"),
        ("staleflow", {"eta": -1}, r"eta must be >= 0"),
        ("queue_drop", {"capacity": 3}, r"capacity 3 < batch_size 4"),
        ("staleflow", {"eta": 1, "batch_redundancy": -1}, r"batch_redundancy must be >= 0"),
    ],
)
def test_make_policy_rejects_bad_parameters(kind, kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_policy(kind, batch_size=4, **kwargs)


def test_make_policy_rejects_an_empty_batch():
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        make_policy("unbounded", batch_size=0)


# -- off-by-one: the same bound for every policy that has one -------------------------------------
@pytest.mark.parametrize("eta", [0, 1, 2])
@pytest.mark.parametrize("kind", sorted(BOUNDED))
def test_admission_window_is_exactly_eta_versions(kind, eta):
    p = make_policy(kind, batch_size=2, **BOUNDED[kind](eta))
    advance(p, 3)
    assert p.verify(3 - eta)
    assert not p.verify(3 - eta - 1)
    assert not p.verify(4)  # weights that do not exist yet


@pytest.mark.parametrize("kind, eta", [("synchronous", 0), ("one_step", 1)])
def test_fixed_eta_policies_admit_exactly_their_window(kind, eta):
    p = make_policy(kind, batch_size=2)
    advance(p, 3)
    assert p.verify(3 - eta) and not p.verify(3 - eta - 1)


@pytest.mark.parametrize("eta", [0, 1, 2])
@pytest.mark.parametrize("kind", ["in_flight_limit", "queue_drop", "queue_max"])
def test_a_group_started_eta_plus_one_versions_ago_is_never_trained(kind, eta):
    p = make_policy(kind, batch_size=1, **BOUNDED[kind](eta))
    p.reserve("slow", 0)
    advance(p, eta)
    p.occupy("slow")  # staleness eta at the next step: still trainable
    batch = p.consume()
    assert [e.gid for e in batch.entries] == ["slow"] and batch.staleness() == [eta]

    p.reserve("slower", p.version)
    if kind == "in_flight_limit" and eta == 0:  # a limit of B in flight is itself a barrier: nothing overtakes
        assert not p.verify(p.version)
        return
    advance(p, eta + 1)
    assert [(e.gid, p.version - e.version) for e in p.occupy("slower")] == [("slower", eta + 1)]
    assert p.counters.dropped == 1 and p.counters.conserved()


def test_staleflow_holds_the_buffer_until_a_slow_group_arrives():
    p = make_policy("staleflow", batch_size=1, eta=2)
    p.reserve("slow", 0)  # worst case: buffer 2
    advance(p, 2)
    assert not p.ready() and not p.verify(0)
    p.occupy("slow")
    assert p.consume().staleness() == [2]


# -- each policy's own rule ------------------------------------------------------------------------
def test_unbounded_admits_anything_and_trains_first_come_first_served():
    p = make_policy("unbounded", batch_size=1)
    p.reserve("old", 0)
    advance(p, 5)
    assert p.verify(0) and p.verify(5) and not p.verify(6)
    p.reserve("new", 5)
    p.occupy("new")
    p.occupy("old")
    assert [e.gid for e in p.consume().entries] == ["new"]
    batch = p.consume()
    assert [e.gid for e in batch.entries] == ["old"] and batch.staleness() == [6]


@pytest.mark.parametrize("kind, eta", [("in_flight_limit", 2), ("one_step", None)])
def test_in_flight_limit_admits_eta_plus_one_batches(kind, eta):
    p = make_policy(kind, batch_size=2, eta=eta)
    limit = (p.eta + 1) * 2
    for i in range(limit):
        p.reserve(i, 0)
    assert not p.verify(0)
    with pytest.raises(StalenessError, match=rf"{limit} groups in flight or queued = limit"):
        p.reserve("more", 0)
    p.occupy(0)
    p.occupy(1)
    assert not p.verify(0)  # completed but not consumed still counts
    p.consume()
    assert p.verify(1)


def test_in_flight_limit_trains_the_stalest_first_and_evicts_at_consume():
    p = make_policy("in_flight_limit", batch_size=1, eta=1)
    advance(p, 1)
    p.reserve("p", 0)  # one version behind: allowed
    p.reserve("q", 0)
    p.occupy("q")
    p.occupy("p")
    batch = p.consume()
    assert [e.gid for e in batch.entries] == ["q"] and batch.staleness() == [1]
    assert [e.gid for e in batch.dropped] == ["p"]  # would be two versions behind at the next step
    assert p.counters.dropped == 1 and p.counters.pending == 0 and p.counters.conserved()


def test_queue_drop_drops_the_oldest_by_position_and_trains_fifo():
    p = make_policy("queue_drop", batch_size=2, capacity=3)
    for g in "abcde":
        p.reserve(g, 0)
    for g in "abc":
        assert p.occupy(g) == []
    assert [e.gid for e in p.occupy("d")] == ["a"]
    assert p.counters.dropped == 1
    assert [e.gid for e in p.consume().entries] == ["b", "c"]


def test_queue_drop_is_fifo_by_arrival_but_queue_max_trains_the_stalest_first():
    for kind, first in [("queue_drop", "new"), ("queue_max", "old")]:
        p = make_policy(kind, batch_size=1, eta=3, capacity=4)
        p.reserve("old", 0)
        advance(p, 1)
        p.reserve("new", 1)
        p.occupy("new")
        p.occupy("old")
        assert p.consume().entries[0].gid == first, kind


def test_queue_drop_with_eta_evicts_groups_that_would_exceed_it():
    p = make_policy("queue_drop", batch_size=1, capacity=2, eta=0)
    p.reserve("a", 0)
    p.reserve("b", 0)
    p.occupy("a")
    p.occupy("b")
    batch = p.consume()
    assert ([e.gid for e in batch.entries], [e.gid for e in batch.dropped]) == (["a"], ["b"])


def test_queue_max_capacity_drops_the_stalest():
    p = make_policy("queue_max", batch_size=1, eta=3, capacity=2)
    p.reserve("v0", 0)
    advance(p, 1)
    p.reserve("v1", 1)
    p.reserve("v1b", 1)
    p.occupy("v1")
    p.occupy("v0")
    assert [e.gid for e in p.occupy("v1b")] == ["v0"]


# -- misuse ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", QUEUES)
@pytest.mark.parametrize(
    "misuse, message",
    [
        (lambda p: p.consume(), r"consume\(\): 1/2 completed groups queued; not ready"),
        (lambda p: p.occupy("ghost"), r"occupy\('ghost'\): unknown group"),
        (lambda p: p.occupy("r", version=0), r"occupy\('r', V_traj=0\): must lie in reserved V_traj=1 .. trainer version 1"),
        (lambda p: p.occupy("r", version=2), r"occupy\('r', V_traj=2\): must lie in reserved"),
        (lambda p: p.occupy("o"), r"occupy\('o'\): already occupied"),
        (lambda p: p.abort("o"), r"abort\('o'\): already occupied"),
        (lambda p: p.filter("ghost"), r"filter\('ghost'\): unknown group"),
        (lambda p: p.reserve("r", 1), r"reserve\('r'\): group is already tracked"),
        (lambda p: p.reserve("o", 1), r"reserve\('o'\): group is already tracked"),
        (lambda p: p.reserve("n", 2), r"reserve\('n', V_traj=2\): not a published version"),
    ],
)
def test_misuse_raises_a_clear_error_and_changes_nothing(kind, misuse, message):
    p = make_policy(kind, batch_size=2, **QUEUE_ARGS.get(kind, {}))
    advance(p, 1)
    p.reserve("o", 1)
    p.occupy("o")
    p.reserve("r", 1)
    before = (replace(p.counters), p.version, p.verify(1))
    with pytest.raises(StalenessError, match=message):
        misuse(p)
    assert (p.counters, p.version, p.verify(1)) == before
    p.occupy("r")  # the policy still works
    assert [e.gid for e in p.consume().entries] == ["o", "r"]


@pytest.mark.parametrize("kind", ["one_step", "in_flight_limit", "queue_drop", "queue_max"])
def test_reserving_beyond_eta_is_refused(kind):
    p = make_policy(kind, batch_size=1, **QUEUE_ARGS.get(kind, {}))
    advance(p, 2)
    with pytest.raises(StalenessError, match=r"reserve\('late', V_traj=0\): staleness 2 already exceeds eta=1"):
        p.reserve("late", 0)


def test_abort_and_filter_are_counted():
    p = make_policy("queue_max", batch_size=1, eta=1)
    for g in "abc":
        p.reserve(g, 0)
    p.abort("a")
    p.filter("b")  # reserved
    p.occupy("c")
    p.filter("c")  # occupied
    c = p.counters
    assert (c.aborted, c.filtered, c.in_flight, c.pending, c.conserved()) == (1, 2, 0, 0, True)
    assert not p.ready()


def test_auto_redundancy_builds_a_staleness_buffer_with_none_and_only_a_staleness_buffer():
    """batch_redundancy 'auto' (the runtime's buffer adapts it) starts at 0; policies without redundancy refuse it."""
    assert make_policy("synchronous", batch_size=4, batch_redundancy="auto").capacity == 4
    assert make_policy("staleflow", batch_size=4, eta=2, batch_redundancy="auto").batch_redundancy == 0
    with pytest.raises(ValueError, match="batch redundancy needs staleflow or synchronous"):
        make_policy("queue_drop", batch_size=4, capacity=8, batch_redundancy="auto")
    with pytest.raises(ValueError, match="a whole number >= 0 or 'auto'"):
        make_policy("synchronous", batch_size=4, batch_redundancy="lots")
