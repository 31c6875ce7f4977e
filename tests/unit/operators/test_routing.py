"""Routing strategies on hand-worked snapshots (StaleFlow §5.3, Algorithms 2-3)."""

from hypothesis import given, settings
from hypothesis import strategies as st

from rlflow.operators.routing import CostModel, place, route_cost_model, route_least_loaded
from rlflow.operators.snapshot import InstanceSnapshot, TrajView

# Round numbers: step latency = 0.001 * kv + max(1, 0.5 * n) + 1 (seconds per step; units arbitrary)
COST = CostModel(k1=0.001, k2=1.0, k3=0.5, k4=1.0, k5=1.0, kv_budget=1000.0)


def inst(idx, version=0, run=0, wait=0, kv=0.0):
    return InstanceSnapshot(idx, kv, [TrajView(f"r{idx}.{j}") for j in range(run)],
                            [TrajView(f"w{idx}.{j}") for j in range(wait)], 0, version)


def traj(tid, v=None, tokens=0.0, gid=None):
    return TrajView(tid, gid if gid is not None else tid, v, tokens)


def routed(routes):
    return {r.inst: [t.tid for t in r.trajs] for r in routes}


def test_cost_model_throughput_and_gains():
    assert COST.throughput(0, 0) == 0
    assert COST.throughput(0, 4) == 4 / (0 + 2 + 1)
    idle = inst(0)
    assert COST.marginal_gain(idle, 0) == COST.ideal_gain(0) == 0.5  # 1 / (max(1, 0.5) + 1)
    busy = inst(1, run=4)
    assert abs(COST.marginal_gain(busy, 0) - (5 / 3.5 - 4 / 3)) < 1e-12
    assert COST.marginal_gain(inst(2, run=1, wait=1), 0) == 0  # something waits: gamma = 0
    assert COST.marginal_gain(inst(3, run=1, kv=990), 20) == 0  # does not fit M: gamma = 0


def test_initial_trajectory_goes_to_admitted_version_with_best_gain():
    # instance 0 (v0) is not admitted by the policy; instances 1, 2 are v1, instance 2 is idle
    insts = [inst(0, 0), inst(1, 1, run=3), inst(2, 1)]
    routes = route_cost_model(insts, [traj("a")], COST, verify=lambda v: v >= 1)
    assert routed(routes) == {2: ["a"]}
    assert [t.tid for t in insts[2].run_trajs] == ["a"]  # speculative snapshot updated


def test_partial_trajectory_never_goes_below_its_v_traj():
    insts = [inst(0, 0), inst(1, 2, run=6)]
    routes = route_cost_model(insts, [traj("p", v=1)], COST, verify=lambda v: True, mu=0.0)
    assert routed(routes) == {1: ["p"]}


def test_waterfall_prefers_older_version_group_when_gain_clears_threshold():
    # v0 group: one instance with 2 running -> gain 3/3 - 2/3 = 1/3 >= 0.3 * 0.5; v1 group idle (gain 0.5)
    insts = [inst(0, 0, run=2), inst(1, 1)]
    routes = route_cost_model(insts, [traj("x", v=0)], COST, verify=lambda v: True, mu=0.3)
    assert routed(routes) == {0: ["x"]}
    # with mu so high that 1/3 < mu * 0.5, the waterfall falls through to the v1 group
    insts = [inst(0, 0, run=2), inst(1, 1)]
    routes = route_cost_model(insts, [traj("x", v=0)], COST, verify=lambda v: True, mu=0.9)
    assert routed(routes) == {1: ["x"]}


def test_mlq_routes_staler_first_and_stops_when_no_gain_clears_threshold():
    # one instance; mu=0.9 lets only an idle or nearly idle instance accept
    insts = [inst(0, 2)]
    ts = [traj("new"), traj("v1", v=1), traj("v0", v=0)]
    routes = route_cost_model(insts, ts, COST, verify=lambda v: True, mu=0.9)
    # v0 goes first (gain 0.5 = ideal); next gain 2/2 - 1/2 = 0.5 >= 0.45 -> v1; third: 3/2.5 - 1 = 0.2 < 0.45 -> stop
    assert routed(routes) == {0: ["v0", "v1"]}


def test_no_candidate_stops_routing_and_reserve_called_once_per_group():
    reserved = []
    insts = [inst(0, 1), inst(1, 1)]
    ts = [traj("g0a", gid="g0"), traj("g0b", gid="g0")]
    admitted = {"n": 0}

    def verify(v):
        return admitted["n"] < 1  # the policy admits one group only

    def reserve(gid, v):
        admitted["n"] += 1
        reserved.append((gid, v))

    routes = route_cost_model(insts, ts, COST, verify, reserve=reserve, mu=0.0)
    # the sibling is routable although verify() now says no: its group already holds V_traj = 1
    assert sorted(t for ts_ in routed(routes).values() for t in ts_) == ["g0a", "g0b"]
    assert reserved == [("g0", 1)]
    more = route_cost_model([inst(0, 1)], [traj("g1a", gid="g1")], COST, verify, reserve=reserve)
    assert more == [] and reserved == [("g0", 1)]


def test_least_loaded_balances_and_respects_staleness_and_room():
    insts = [inst(0, 0, run=2), inst(1, 1, run=1), inst(2, 1, run=0), inst(3, 1, run=1, wait=1)]
    ts = [traj(f"t{j}") for j in range(4)]
    routes = route_least_loaded(insts, ts, verify=lambda v: v == 1, cost=COST)
    # instance 0 inadmissible (v0), instance 3 has a waiting trajectory (no room)
    assert routed(routes) == {2: ["t0", "t2"], 1: ["t1", "t3"]}


def test_held_instances_get_nothing():
    routes = route_least_loaded([inst(0), inst(1)], [traj("a"), traj("b")], verify=lambda v: True, hold=frozenset({0}))
    assert routed(routes) == {1: ["a", "b"]}


# -- the gain tables of route_cost_model against Algorithm 3 taken literally -----------------------------

def reference_cost_model(instances, ts_trajs, cost, verify, mu, reserve):
    """Algorithm 3 line by line: per trajectory, every candidate's gain from CostModel.marginal_gain,
    version groups ascending, the first strict maximum in index order (line 27); gain must be > 0 too."""
    assigned, routes = {}, {}
    for traj in sorted(ts_trajs, key=lambda t: (t.v_traj is None, t.v_traj or 0)):
        v_traj = traj.v_traj if traj.v_traj is not None else assigned.get(traj.gid)
        candidates = [i for i in instances
                      if (i.inst_version >= v_traj if v_traj is not None else verify(i.inst_version))]
        if not candidates:
            break
        selected = None
        for version in sorted({i.inst_version for i in candidates}):
            best, best_gain = None, float("-inf")
            for i in sorted((i for i in candidates if i.inst_version == version), key=lambda i: i.idx):
                gain = cost.marginal_gain(i, traj.tokens)
                if gain > best_gain:
                    best, best_gain = i, gain
            if best_gain >= mu * cost.ideal_gain(traj.tokens) and best_gain > 0:
                selected = best
                break
        if selected is None:
            break
        if v_traj is None:
            assigned[traj.gid] = selected.inst_version
            reserve(traj.gid, selected.inst_version)
        place(selected, traj, cost)
        routes.setdefault(selected.idx, []).append(traj.tid)
    return list(routes.items())


def final_state(snaps):
    return sorted((i.idx, [t.tid for t in i.run_trajs], [t.tid for t in i.wait_trajs], i.kv_cache) for i in snaps)


# few distinct templates and lengths, so equal gains (ties) and repeated lengths are common
_inst_template = st.tuples(st.integers(0, 3), st.integers(0, 6), st.sampled_from([0, 0, 0, 1]),
                           st.sampled_from([0.0, 100.0, 250.0, 600.0, 950.0]))
_traj_template = st.tuples(st.sampled_from([None, None, 0, 1, 2, 3]), st.sampled_from([0, 10, 50, 100, 400, 900]),
                           st.integers(0, 5))


@settings(max_examples=300, deadline=None)
@given(insts=st.lists(_inst_template, min_size=1, max_size=12), trajs=st.lists(_traj_template, max_size=30),
       cost=st.sampled_from([COST, CostModel(0.001, 1.0, 0.5, 1.0, 2.0, 1000.0, 4),
                             CostModel(7.28e-8, 1.72e-3, 1.25e-4, 1.07e-2, 1.0, 1000.0, 5)]),
       mu=st.sampled_from([0.0, 0.1, 0.3, 0.9]), admit=st.integers(0, 4), hold=st.frozensets(st.integers(0, 11)),
       order=st.randoms(use_true_random=False))
def test_cost_model_routing_matches_algorithm_3_reference(insts, trajs, cost, mu, admit, hold, order):
    def build():
        snaps = [InstanceSnapshot(idx, kv, [TrajView(f"r{idx}.{j}") for j in range(run)],
                                  [TrajView(f"w{idx}.{j}") for j in range(wait)], 0, v)
                 for idx, (v, run, wait, kv) in enumerate(insts)]
        order.shuffle(snaps)  # group order must not depend on the caller's instance order
        ts = [TrajView(f"t{j}", gid if v is None else f"p{j}", v, tokens) for j, (v, tokens, gid) in enumerate(trajs)]
        reserved = []

        def verify(version):  # the policy admits `admit` groups, on versions >= 1
            return len(reserved) < admit and version >= 1

        return snaps, ts, verify, lambda gid, v: reserved.append((gid, v)), reserved

    snaps, ts, verify, reserve, reserved = build()
    got = [(r.inst, [t.tid for t in r.trajs]) for r in
           route_cost_model(snaps, ts, cost, verify, mu=mu, reserve=reserve, hold=hold)]
    state = final_state(snaps)

    snaps, ts, verify, reserve, ref_reserved = build()
    held = [i for i in snaps if i.idx not in hold]
    assert got == reference_cost_model(held, ts, cost, verify, mu, reserve)
    assert reserved == ref_reserved
    assert state == final_state(snaps)  # the speculative snapshot is updated the same way


# -- the TS handed over as a multi-level queue (MLQ): same order, same routes, no sort --------------------------------
_trajs = st.lists(st.tuples(st.one_of(st.none(), st.integers(0, 3)), st.integers(0, 40)), max_size=30)


@settings(max_examples=150, deadline=None)
@given(_trajs, st.lists(st.tuples(st.integers(0, 3), st.integers(0, 6), st.integers(0, 2)), min_size=1, max_size=5),
       st.integers(0, 3), st.sampled_from([None, COST, CostModel(0.001, 1.0, 0.5, 1.0, 1.0, 1000.0, max_running=3)]))
def test_an_mlq_routes_exactly_as_the_sorted_list(ts, insts, verify_from, cost):
    """The simulator's TS hands routing an MLQ (no sort); every routing and lane filter must treat it as the sorted
    list: same routes, in the same order, including instances left out up front for having no room."""
    from rlflow.operators.routing import MLQ, mlq

    items = [traj(f"t{j}", v, tokens) for j, (v, tokens) in enumerate(ts)]
    queue = MLQ.of([t for t in items if t.v_traj is not None], [t for t in items if t.v_traj is None])
    assert list(queue) == mlq(items) and queue.partial == sum(t.v_traj is not None for t in items)
    back = [traj(f"b{j}", v % 4, 5.0) for j, (v, _) in enumerate(ts[:4]) if v is not None]
    assert list(queue.merged(back)) == mlq(items + back)
    odd = lambda t: int(t.tid[1:]) % 2 == 1
    assert list(queue.only(odd)) == [t for t in mlq(items) if odd(t)]
    # a TS that queues a lane apart hands its partial members over as a part: same lane, the merge keeps it one
    even = lambda t: not odd(t)
    parted = MLQ(list(queue)[:queue.partial], list(queue)[queue.partial:],
                 {odd: [t for t in list(queue)[:queue.partial] if odd(t)]})
    assert list(parted.only(odd)) == list(queue.only(odd)) and list(parted.only(even)) == list(queue.only(even))
    merged = parted.merged(back)
    assert list(merged) == mlq(items + back)
    assert list(merged.only(odd)) == [t for t in mlq(items + back) if odd(t)]

    def fleet():
        return [inst(i, version, run=run, wait=wait) for i, (version, run, wait) in enumerate(insts)]

    verify = lambda v: v >= verify_from
    route = lambda i, q: routed(route_least_loaded(i, q, verify, cost=cost))
    assert route(fleet(), queue) == route(fleet(), items)
    if cost is not None:
        assert (routed(route_cost_model(fleet(), queue, cost, verify))
                == routed(route_cost_model(fleet(), items, cost, verify)))


def test_a_shallow_snapshot_copies_its_lists_before_routing_changes_them():
    """The throughput-aware sync's tentative pass routes on shallow copies: the snapshot it copied must not change."""
    base = inst(0, run=2, wait=0, kv=10.0)
    run_before = list(base.run_trajs)
    copy = base.shallow()
    assert copy.run_trajs is base.run_trajs  # shared until changed
    place(copy, traj("new", 0, 5.0), COST)
    assert base.run_trajs == run_before and base.kv_cache == 10.0
    assert [t.tid for t in copy.run_trajs][-1] == "new" and copy.kv_cache == 15.0 and not copy.shared


def _least_loaded_reference(instances, ts_trajs, verify, cost, reserve):
    """Vanilla routing written plainly: every trajectory in MLQ order tried against every version group, no skips."""
    import heapq

    from rlflow.operators.routing import _Admission, mlq

    adm = _Admission(verify, reserve)
    heaps = {}
    for i in instances:
        if cost is None or cost.room(i):
            heaps.setdefault(i.inst_version, []).append((len(i.run_trajs) + len(i.wait_trajs), i.idx, i))
    for heap in heaps.values():
        heapq.heapify(heap)
    routes = {}
    for t in mlq(ts_trajs):
        while True:
            options = [v for v, heap in sorted(heaps.items()) if heap and adm.routable(t, v)]
            if not options:
                break
            best = min(options, key=lambda v: heaps[v][0][:2])
            inst = heaps[best][0][2]
            if cost is not None and not cost.fits(inst, t.tokens):
                heapq.heappop(heaps[best])
                continue
            heapq.heapreplace(heaps[best], (len(inst.run_trajs) + len(inst.wait_trajs) + 1, inst.idx, inst))
            adm.routed(t, inst.inst_version)
            place(inst, t, cost)
            routes.setdefault(inst.idx, []).append(t.tid)
            break
    return routes


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.one_of(st.none(), st.integers(0, 4)), st.integers(0, 300), st.integers(0, 5)),
                max_size=40),
       st.lists(st.tuples(st.integers(0, 4), st.integers(0, 4), st.integers(0, 1)), min_size=1, max_size=6),
       st.integers(0, 5), st.integers(1, 6),
       st.sampled_from([None, COST, CostModel(0.001, 1.0, 0.5, 1.0, 1.0, 1000.0, max_running=3)]))
def test_least_loaded_skips_change_no_route(ts, insts, verify_from, budget, cost):
    """Least-loaded routing skips trajectories it can tell are unroutable (a V_traj at or above one that found no
    instance; an initial one after one found none, until the next reservation). Against the plain loop on random
    snapshots, with a policy whose verify tightens as groups are reserved (a budget of reservations), the routes and
    the reservations are the same."""
    def run(route):
        reserved = []
        verify = lambda v: v >= verify_from and len(reserved) < budget
        fleet = [inst(i, version, run=run, wait=wait) for i, (version, run, wait) in enumerate(insts)]
        trajs = [traj(f"t{j}", v, tokens, gid=f"g{gid}" if v is None else f"p{j}") for j, (v, tokens, gid) in enumerate(ts)]
        out = route(fleet, trajs, verify, lambda gid, v: reserved.append((gid, v)))
        return out, reserved

    fast = run(lambda f, t, verify, reserve: routed(route_least_loaded(f, t, verify, cost=cost, reserve=reserve)))
    slow = run(lambda f, t, verify, reserve: _least_loaded_reference(f, t, verify, cost, reserve))
    assert fast == slow


def test_a_group_reserved_below_a_blocked_v_traj_still_routes():
    """The V_traj skip must compare each trajectory's own V_traj: a partial one of V_traj 3 finds no instance (the
    only one holds version 2), then an initial group is reserved at version 2, and its second member (V_traj 2 now)
    must still be routed."""
    ts = [traj("p", 3, 1.0), traj("a1", None, 1.0, gid="g"), traj("a2", None, 1.0, gid="g")]
    assert routed(route_least_loaded([inst(0, version=2)], ts, lambda v: True)) == {0: ["a1", "a2"]}
