"""Random interleavings of dispatch, completion, abort, filter and consume for every staleness policy.

Checked after every step: conservation, counters match what the driver saw, no trajectory trained
above eta or twice, batches in version order; at the end, completing all in-flight work leaves the
pipeline able to progress. 2,000 schedules per policy; RLFLOW_HYPOTHESIS_PROFILE=staleness-thorough runs 15,000.
"""

import os
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlflow.operators.groups import GroupAssembler
from rlflow.operators.policy import StalenessError, staleness
from rlflow.operators.policy_kinds import POLICIES, make_policy

settings.register_profile(
    "staleness", max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True
)
settings.register_profile("staleness-thorough", parent=settings.get_profile("staleness"), max_examples=15000)
PROFILE = settings.get_profile(os.environ.get("RLFLOW_HYPOTHESIS_PROFILE", "staleness"))

FIFO = {"unbounded", "queue_drop"}  # train in completion order; the other queues train the stalest first
OPS = ["round"] * 4 + ["dispatch", "finish", "abort", "filter", "consume", "drain", "redundancy"]


@st.composite
def setups(draw, kind):
    """(make_policy keywords, group_size, group-level redundancy) for one policy kind."""
    b = draw(st.integers(1, 3))
    eta = draw(st.integers(0, 5))
    kw = {"batch_size": b}
    if kind in ("staleflow", "in_flight_limit", "queue_max"):
        kw["eta"] = eta
    if kind in ("staleflow", "synchronous"):
        kw["batch_redundancy"] = draw(st.integers(0, 2))
    if kind == "queue_drop":
        kw["capacity"] = draw(st.integers(b, 3 * b))
        kw["eta"] = draw(st.none() | st.just(eta))
    if kind == "queue_max":
        kw["capacity"] = draw(st.none() | st.integers(b, 3 * b))
    return kw, draw(st.integers(1, 3)), draw(st.integers(0, 2))


class Driver:
    """An executor in miniature: groups of members, a policy, and a ledger to check the policy against."""

    def __init__(self, kind, kw, group_size, group_redundancy):
        self.kind = kind
        self.p = make_policy(kind, **kw)
        self.groups = GroupAssembler(group_size, group_redundancy)
        self.members = group_size + group_redundancy
        self.in_flight: dict = {}  # gid -> reserved V_traj
        self.pending: dict = {}  # gid -> occupied V_traj, in completion order
        self.consumed: set = set()
        self.running: list = []  # (gid, member)
        self.finished: dict = {}  # gid -> V_traj of finished members, in order
        self.launched: dict = {}  # (gid, member) -> V_traj
        self.admitted = 0
        self.next_gid = 0

    # -- operations ---------------------------------------------------------------------------------
    def dispatch(self, rng):
        """Start 1..B + 1 groups, each at the current version or up to one version past the bound."""
        reach = 2 if self.p.eta is None else self.p.eta
        for _ in range(rng.randint(1, self.p.batch_size + 1)):
            self.start(self.p.version - rng.randint(0, reach + 1), rng)  # below 0 too, early on

    def start(self, v, rng):
        gid, self.next_gid = self.next_gid, self.next_gid + 1
        if not self.p.verify(v):
            refused(self.p.reserve, gid, v)  # verify() is exactly "would reserve() succeed"
            return
        self.p.reserve(gid, v)
        self.admitted += 1
        self.in_flight[gid] = v
        self.groups.open(gid, v)
        self.finished[gid] = []
        for m in range(self.members):  # members may start on newer weights than the reservation
            self.launched[gid, m] = rng.randint(v, self.p.version)
            self.groups.launch(gid, m, self.launched[gid, m])
            self.running.append((gid, m))

    def finish(self, rng):
        """Up to two groups' worth of members finish and are rewarded, picked from the running ones."""
        for _ in range(rng.randint(1, 2 * self.members)):
            if self.running:
                self.complete(self.running.pop(rng.randrange(len(self.running))))

    def complete(self, member):
        gid, m = member
        self.finished[gid].append(self.launched[gid, m])
        done = self.groups.finish(gid, m)
        if done is None:
            return
        assert done.version == min(self.finished.pop(gid)[: self.groups.group_size])
        self.running = [r for r in self.running if r[0] != gid]  # surplus members aborted
        self.pending[gid] = done.version
        del self.in_flight[gid]
        self.removed(self.p.occupy(gid, done.version))

    def abort(self, rng):
        if self.in_flight:
            gid = rng.choice(list(self.in_flight))
            returned = self.p.abort(gid)
            self.forget_in_flight(gid)
            self.removed(returned)

    def filter(self, rng):
        pool = list(self.in_flight) + list(self.pending)
        if pool:
            gid = rng.choice(pool)
            returned = self.p.filter(gid)
            if gid in self.in_flight:
                self.forget_in_flight(gid)
            else:
                del self.pending[gid]
            self.removed(returned)

    def redundancy(self, rng):
        """batch_redundancy auto (rlflow/runtime/buffer.py) changes a staleness buffer's capacity between any calls."""
        if hasattr(self.p, "set_batch_redundancy"):
            self.p.set_batch_redundancy(rng.randint(0, 2 * self.p.batch_size))

    def round(self, rng):
        """A steady-state slice: new groups start, some members finish, the trainer takes a batch if it can."""
        self.dispatch(rng)
        self.finish(rng)
        if self.p.ready():
            self.consume()

    def consume(self, rng=None):
        if not self.p.ready():
            refused(self.p.consume)
            return
        version, eta = self.p.version, self.p.eta
        first_done = list(self.pending)[: self.p.batch_size]
        batch = self.p.consume()
        assert batch.version == version and self.p.version == version + 1  # buffers in version order
        assert len(batch.entries) == self.p.batch_size
        for e in batch.entries:
            assert e.gid not in self.consumed, f"{e.gid} trained twice"
            assert self.pending.pop(e.gid) == e.version
            assert 0 <= staleness(version, e.version) and (eta is None or staleness(version, e.version) <= eta)
            self.consumed.add(e.gid)
        if self.kind in FIFO:
            assert [e.gid for e in batch.entries] == first_done, "not first come first served"
        elif self.kind in ("one_step", "in_flight_limit", "queue_max") and self.pending:
            assert max(e.version for e in batch.entries) <= min(self.pending.values()), "stalest not trained first"
        for e in batch.dropped:
            assert self.pending.pop(e.gid) == e.version
            assert staleness(self.p.version, e.version) > eta

    def drain(self, rng=None):
        """Complete everything in flight; then the pipeline must be able to train or to admit."""
        while self.running:
            self.complete(self.running.pop())
        assert not self.in_flight
        assert self.p.ready() or self.p.verify(self.p.version), "deadlock: nothing to train, nothing admitted"

    # -- ledger ---------------------------------------------------------------------------------------
    def forget_in_flight(self, gid):
        del self.in_flight[gid]
        del self.finished[gid]
        self.groups.abort(gid)
        self.running = [r for r in self.running if r[0] != gid]

    def removed(self, entries):
        """Groups the policy took out on its own: surplus still running (aborted) or completed (dropped)."""
        for e in entries:
            if e.gid in self.in_flight:
                assert self.in_flight[e.gid] == e.version
                self.forget_in_flight(e.gid)
            else:
                assert self.pending.pop(e.gid) == e.version, f"policy returned unknown group {e.gid}"

    def check(self):
        p, c = self.p, self.p.counters
        p.check_invariants()
        assert c.conserved()
        assert (c.admitted, c.in_flight, c.pending, c.consumed) == (
            self.admitted, len(self.in_flight), len(self.pending), len(self.consumed)
        )
        if self.kind in ("staleflow", "synchronous"):
            assert c.in_flight + c.pending <= (p.eta + 1) * p.capacity
            seen = set()
            for v_buf, (occupied, reserved) in p.layout().items():  # every entry: V_traj + eta >= V_buf
                assert all(self.pending[g] + p.eta >= v_buf for g in occupied)
                assert all(self.in_flight[g] + p.eta >= v_buf for g in reserved)
                seen.update(occupied, reserved)
            assert seen == self.in_flight.keys() | self.pending.keys()
        if self.kind in ("queue_drop", "queue_max") and p.capacity is not None:
            assert c.pending <= p.capacity
        if self.kind in ("one_step", "in_flight_limit"):
            assert c.in_flight + c.pending <= (p.eta + 1) * p.batch_size

    def progress(self):
        """A driver that keeps admitting at the latest version trains within a bounded number of groups."""
        self.drain()
        for x in range(4 * self.p.batch_size + 4 * self.members):
            if self.p.ready():
                self.consume()
                return
            self.start(self.p.version, random.Random(x))
            self.drain()
            self.check()
        pytest.fail(f"{self.kind}: no batch after admitting at the latest version")


@pytest.mark.parametrize("kind", sorted(POLICIES))
@settings(PROFILE)
@given(data=st.data())
def test_random_schedules_keep_every_invariant(kind, data):
    kw, group_size, group_redundancy = data.draw(setups(kind), label="setup")
    seeds = data.draw(st.lists(st.integers(0, 2**32 - 1), min_size=8, max_size=30), label="ops")
    d = Driver(kind, kw, group_size, group_redundancy)
    for seed in seeds:  # each seed picks three operations and the choices they make
        rng = random.Random(seed)
        for _ in range(3):
            getattr(d, rng.choice(OPS))(rng)
            d.check()
    d.progress()
    d.check()


@pytest.mark.parametrize("kind", sorted(POLICIES))
def test_the_driver_catches_a_policy_that_trains_a_group_twice(kind, monkeypatch):
    """The properties can fail: a consume that repeats an entry is reported."""
    d = Driver(kind, {"batch_size": 2, **_minimal(kind)}, 1, 0)
    original = type(d.p).consume

    def twice(self):
        batch = original(self)
        batch.entries[1] = batch.entries[0]
        return batch

    monkeypatch.setattr(type(d.p), "consume", twice)
    for _ in range(2):
        d.start(0, random.Random(0))
    d.drain()
    with pytest.raises(AssertionError, match="trained twice"):
        d.consume()


def refused(call, *args):
    """Assert that a policy call raises StalenessError (cheaper than pytest.raises in the hot loop)."""
    try:
        call(*args)
    except StalenessError:
        return
    raise AssertionError(f"{call.__name__}{args} should have been refused")


def _minimal(kind):
    needs = {"staleflow": {"eta": 1}, "in_flight_limit": {"eta": 1}, "queue_max": {"eta": 1}, "queue_drop": {"capacity": 2}}
    return needs.get(kind, {})
