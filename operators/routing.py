"""Routing strategies: least-loaded (vanilla) and StaleFlow's cost-model waterfall (StaleFlow §5.3, Algorithm 3).

A routing strategy is a pure function of a speculative snapshot (instance snapshots it may update in
place) and the trajectories waiting in the trajectory server; it returns Route commands. Every route
respects the staleness policy through check_routable (Algorithm 2): an initial trajectory (no V_traj)
needs verify(inst_version), a partial one needs inst_version >= V_traj. Trajectories are duck-typed:
`.v_traj` (None while initial), `.tokens` (KV tokens it brings: prompt + generated so far), `.gid`.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from itertools import chain, islice

from .commands import Route

Verify = Callable[[int], bool]
Reserve = Callable[[object, int], None]


@dataclass(frozen=True)
class CostModel:
    """Per-instance throughput model T_i(S) (StaleFlow Eq. 2) and the KV rule gamma_i (Eq. 3)."""

    k1: float
    k2: float
    k3: float
    k4: float
    k5: float = 1.0  # KV units per token
    kv_budget: float = float("inf")  # M
    max_running: int | None = None  # engine cap on running trajectories (not in the paper; vLLM max_num_seqs)

    @classmethod
    def from_profile(cls, p) -> CostModel:
        """From a CostProfile-like object (operators/cost_profile.py's CostProfile or a profile dict)."""
        get = (lambda k: p[k]) if isinstance(p, dict) else (lambda k: getattr(p, k))
        return cls(get("k1"), get("k2"), get("k3"), get("k4"), get("k5"), get("kv_budget"), get("max_running"))

    def throughput(self, kv_cache: float, n_run: int) -> float:
        """Eq. 2: |run| / (k1 * kv + max(k2, k3 * |run|) + k4), tokens per second."""
        if n_run == 0:
            return 0.0
        return n_run / (self.k1 * kv_cache + max(self.k2, self.k3 * n_run) + self.k4)

    def room(self, inst) -> bool:
        """gamma_i of Eq. 3 less the KV test: nothing waiting and under the engine cap (true for any length)."""
        return not inst.wait_trajs and (self.max_running is None or len(inst.run_trajs) < self.max_running)

    def fits(self, inst, tokens: float) -> bool:
        """gamma_i of Eq. 3: the trajectory runs at once (fits M, nothing waiting, under the engine cap)."""
        return self.room(inst) and inst.kv_cache + self.k5 * tokens <= self.kv_budget

    def marginal_gain(self, inst, tokens: float) -> float:
        """Eq. 3: Delta T_i of routing a trajectory of `tokens` to `inst` (0 if it would wait)."""
        if not self.fits(inst, tokens):
            return 0.0
        n = len(inst.run_trajs)
        return self.throughput(inst.kv_cache + self.k5 * tokens, n + 1) - self.throughput(inst.kv_cache, n)

    def ideal_gain(self, tokens: float) -> float:
        """Eq. 4: the gain of routing to an idle instance, the upper bound of any gain."""
        return 1.0 / (self.k1 * self.k5 * tokens + max(self.k2, self.k3) + self.k4)


def place(inst, traj, cost: CostModel | None) -> None:
    """update_snapshot (Algorithm 3 line 36): the trajectory joins run_trajs if it fits, else wait_trajs."""
    k5 = cost.k5 if cost else 1.0
    if getattr(inst, "shared", False):  # a shallow copy's lists are another snapshot's
        inst.run_trajs, inst.wait_trajs, inst.shared = list(inst.run_trajs), list(inst.wait_trajs), False
    if cost is None or cost.fits(inst, traj.tokens):
        inst.run_trajs.append(traj)
        inst.kv_cache += k5 * traj.tokens
    else:
        inst.wait_trajs.append(traj)


class MLQ(list):
    """TS trajectories already in multi-level-queue order: the partial ones (V_traj set) by ascending V_traj, then
    the initial ones (no V_traj), each part stable. StaleFlow's TS is kept as this queue (§5.1); a TS that hands its
    levels over this way spares routing a sort of every waiting trajectory per cycle (at 512 instances the sort was
    a third of the simulator's time). `partial` is the number of partial trajectories at the front."""

    def __init__(self, partial: Iterable = (), initial: Iterable = (), parts: dict | None = None):
        super().__init__(partial)
        self.partial = len(self)
        self.extend(initial)
        # member -> the partial trajectories it keeps, in queue order: a TS that queues each lane apart (skew-aware
        # dispatch) hands its lanes over here, and `only` passes over none of the other lane's partial trajectories
        self.parts: dict[Callable, list] = parts or {}

    @classmethod
    def of(cls, partial: Iterable, initial: Iterable) -> MLQ:
        """From partial trajectories in any order (sorted here, stably) and initial ones in queue order."""
        return cls(sorted(partial, key=_v_traj), initial)

    def oldest(self) -> int | None:
        """The smallest V_traj waiting (None: only initial trajectories)."""
        return self[0].v_traj if self.partial else None

    def has_initial(self) -> bool:
        return len(self) > self.partial

    def merged(self, trajs: Iterable) -> MLQ:
        """With interrupted trajectories (V_traj set) added: as sorting the concatenation would order them."""
        trajs = list(trajs)
        if not trajs:
            return self
        # a stable sort of the filtered concatenation is the filtered stable sort: each part stays this MLQ's filter
        parts = {member: sorted(part + [t for t in trajs if member(t)], key=_v_traj)
                 for member, part in self.parts.items()}
        return MLQ(sorted(self[:self.partial] + trajs, key=_v_traj), self[self.partial:], parts)

    def only(self, member: Callable[[object], bool]) -> MLQView:
        """The members `member` keeps, still in queue order; filtered as they are read (routing reads a prefix)."""
        return MLQView(self, member, self.parts.get(member))


class MLQView:
    """An MLQ's members that `member` keeps, in queue order, tested lazily: routing stops at the first trajectory
    it cannot place, so a lane of skew-aware dispatch (StreamRL §5.3) never tests the rest of a long TS.
    `partial`: the partial members already picked out (the MLQ's part for `member`); then only initial ones are
    tested."""

    def __init__(self, queue: MLQ, member: Callable[[object], bool], partial: list | None = None):
        self.queue, self.member, self.partial = queue, member, partial

    def __iter__(self):
        if self.partial is None:
            return filter(self.member, self.queue)
        return chain(self.partial, filter(self.member, islice(self.queue, self.queue.partial, None)))


def _v_traj(t) -> int:
    return t.v_traj


def mlq(ts_trajs: Iterable) -> Iterable:
    """The multi-level queue flattened: ascending V_traj, initial trajectories (no V_traj) last; stable."""
    if isinstance(ts_trajs, (MLQ, MLQView)):
        return ts_trajs
    return sorted(ts_trajs, key=lambda t: (t.v_traj is None, t.v_traj or 0))


class _Admission:
    """check_routable (Algorithm 2) with V_traj fixed per group once its first member is routed."""

    def __init__(self, verify: Verify, reserve: Reserve | None):
        self._verify = verify
        self._reserve = reserve
        self._cache: dict[int, bool] = {}
        self.assigned: dict[object, int] = {}  # gid -> V_traj reserved in this pass

    def v_traj(self, traj) -> int | None:
        return traj.v_traj if traj.v_traj is not None else self.assigned.get(traj.gid)

    def routable(self, traj, version: int) -> bool:
        return self.admits(self.v_traj(traj), version)

    def admits(self, v_traj: int | None, version: int) -> bool:
        """routable() for a trajectory whose V_traj (v_traj(traj)) the caller already has."""
        if v_traj is not None:
            return version >= v_traj
        ok = self._cache.get(version)
        if ok is None:
            ok = self._cache[version] = bool(self._verify(version))
        return ok

    def routed(self, traj, version: int) -> None:
        """A trajectory left for an instance: an initial one reserves its group with V_traj = inst_version."""
        if self.v_traj(traj) is None:
            self.assigned[traj.gid] = version
            if self._reserve is not None:
                self._reserve(traj.gid, version)
            self._cache.clear()  # a reservation may fill a buffer


def _by_version(instances, hold: frozenset) -> dict[int, list]:
    groups: dict[int, list] = {}
    for inst in instances:
        if inst.idx not in hold:
            groups.setdefault(inst.inst_version, []).append(inst)
    return dict(sorted(groups.items()))


def _emit(routes: dict[int, list]) -> list[Route]:
    return [Route(idx, tuple(trajs)) for idx, trajs in routes.items()]


class _GainTable:
    """One version group's Eq. 3 gains, ready for the waterfall's max (StaleFlow Algorithm 3 lines 21-30).

    Algorithm 3 recomputes every candidate's gain for each trajectory, and interrupted trajectories have
    all-different lengths. Per instance the length-free terms of Eq. 2-3 are kept (one row; only the routed
    instance's row changes), so a new length is one pass of arithmetic; a repeated length (runs of initial
    trajectories) re-uses the gains with one entry refreshed. Gains are bit-identical to CostModel.marginal_gain
    (same operations in the same order); instances are in index order, so the first maximum is line 27's.
    """

    def __init__(self, insts, cost: CostModel):
        self.cost = cost
        self.insts = sorted(insts, key=lambda i: i.idx)
        self.pos = {inst.idx: p for p, inst in enumerate(self.insts)}
        self.rows = [self._row(inst) for inst in self.insts]
        self.tokens = None  # the length `gains` are for
        self.gains: list[float] = []

    def _row(self, inst) -> tuple:
        """(kv_cache, room, |run| + 1, max(k2, k3 * (|run| + 1)), T_i(S)): everything Eq. 3 needs but l."""
        c = self.cost
        n = len(inst.run_trajs)
        return inst.kv_cache, c.room(inst), n + 1, max(c.k2, c.k3 * (n + 1)), c.throughput(inst.kv_cache, n)

    def _gains(self, rows: list, tokens: float) -> list[float]:
        """Eq. 3 for each row: Eq. 2 after minus before, 0 where gamma_i = 0 (as CostModel.marginal_gain)."""
        c = self.cost
        k1, k4, budget, kv_add = c.k1, c.k4, c.kv_budget, c.k5 * tokens
        return [n1 / (k1 * (kv + kv_add) + step + k4) - before if room and kv + kv_add <= budget else 0.0
                for kv, room, n1, step, before in rows]

    def best(self, tokens: float) -> tuple[float, object]:
        """The largest gain for a trajectory of `tokens` and its instance (lowest index among equals)."""
        if tokens != self.tokens:
            self.tokens, self.gains = tokens, self._gains(self.rows, tokens)
        gain = max(self.gains)
        return gain, self.insts[self.gains.index(gain)]

    def refresh(self, inst) -> None:
        """`inst` took a trajectory (update_snapshot, line 36): its row and gain change, no other."""
        p = self.pos[inst.idx]
        self.rows[p] = self._row(inst)
        self.gains[p] = self._gains([self.rows[p]], self.tokens)[0]


def route_cost_model(instances, ts_trajs, cost: CostModel, verify: Verify, *, mu: float = 0.3,
                     reserve: Reserve | None = None, hold: frozenset = frozenset(),
                     until: int | None = None) -> list[Route]:
    """StaleFlow routing (Algorithm 3): MLQ by V_traj, version groups ascending, waterfall threshold mu * ideal gain.

    Stops at the first trajectory with no candidate or no gain above the threshold (lines 12-14, 38-40).
    Unlike line 31 a gain must also be positive, so even at mu = 0 a trajectory that would wait (gamma = 0,
    §5.3 Eq. 3) is never routed. Each version group's gains live in a _GainTable built on first use, so a
    route costs at most one pass of arithmetic over each group it tries. `until`: stop after the first route to that
    instance (a caller that only asks whether it would get one: the throughput-aware sync's tentative pass).
    """
    adm = _Admission(verify, reserve)
    groups = _by_version(instances, hold)
    tables: dict[int, _GainTable] = {}
    routes: dict[int, list] = {}
    for traj in mlq(ts_trajs):
        versions = [v for v in groups if adm.routable(traj, v)]
        if not versions:
            break
        threshold = mu * cost.ideal_gain(traj.tokens)
        selected = None
        for v in versions:
            if v not in tables:
                tables[v] = _GainTable(groups[v], cost)
            gain, inst = tables[v].best(traj.tokens)
            if gain >= threshold and gain > 0:
                selected = inst
                break
        if selected is None:
            break
        adm.routed(traj, selected.inst_version)
        place(selected, traj, cost)
        tables[selected.inst_version].refresh(selected)
        routes.setdefault(selected.idx, []).append(traj)
        if selected.idx == until:
            break
    return _emit(routes)


def route_least_loaded(instances, ts_trajs, verify: Verify, *, cost: CostModel | None = None,
                       reserve: Reserve | None = None, hold: frozenset = frozenset()) -> list[Route]:
    """Vanilla routing: each trajectory (MLQ order) to the least-loaded admissible instance with room.

    Room is the cost model's gamma (fits the KV budget, nothing waiting, under max_running); without a
    cost model every instance has room. Load is |run| + |wait|; ties go to the lower index.
    """
    adm = _Admission(verify, reserve)
    # An instance with something waiting or at max_running fits nothing this cycle: it is left out from the start
    # (the loop below would drop it when it came up), so with no room anywhere no trajectory is read at all.
    full = set() if cost is None else {i.idx for i in instances if not cost.room(i)}
    groups = _by_version(instances, hold | full)
    heaps = {v: [(len(i.run_trajs) + len(i.wait_trajs), i.idx, i) for i in insts] for v, insts in groups.items()}
    for heap in heaps.values():
        heapq.heapify(heap)
    routes: dict[int, list] = {}
    if not groups:
        return []
    # Skips that change no route: instances only leave the heaps (or grow their load), so once a trajectory of V_traj
    # v finds no admissible instance, none of V_traj >= v will; once an initial one finds none, no initial one will
    # (only an initial one reserves, so from then on nothing changes the policy's answers to verify). Without them a
    # TS held back by the staleness bound was tested in full against every version group at every cycle.
    blocked_v = None
    blocked_new = False
    for traj in mlq(ts_trajs):
        v_traj = adm.v_traj(traj)
        if blocked_new if v_traj is None else (blocked_v is not None and v_traj >= blocked_v):
            continue
        while True:
            best = None
            for v, heap in heaps.items():
                if heap and adm.admits(v_traj, v) and (best is None or heap[0][:2] < heaps[best][0][:2]):
                    best = v
            if best is None:
                if v_traj is None:
                    blocked_new = True
                elif blocked_v is None or v_traj < blocked_v:
                    blocked_v = v_traj
                break
            inst = heaps[best][0][2]
            if cost is not None and not cost.fits(inst, traj.tokens):
                heapq.heappop(heaps[best])  # full for this cycle
                continue
            heapq.heapreplace(heaps[best], (len(inst.run_trajs) + len(inst.wait_trajs) + 1, inst.idx, inst))
            adm.routed(traj, inst.inst_version)
            place(inst, traj, cost)
            routes.setdefault(inst.idx, []).append(traj)
            break
        if not any(heaps.values()):
            break
    return _emit(routes)


ROUTING = {"least_loaded": route_least_loaded, "cost_model": route_cost_model}
