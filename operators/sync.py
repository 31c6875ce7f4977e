"""Synchronization strategies: which instances Pull now, and which take no new routes (StaleFlow §5.3, Algorithm 4).

Each is a pure function (instances, ts_trajs, ps_version, ...) -> SyncDecision. The cycle (Algorithm 1
lines 4-9) interrupts whatever a pulled instance still holds and returns it to the TS, so a pull with
partial rollout resumes those trajectories elsewhere or on the new weights, V_traj kept.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

from .routing import MLQ, CostModel, route_cost_model

_DEFAULT_MU = 0.3  # StaleFlow §6.1 (CoordinationConfig.mu's default)


@dataclass(frozen=True)
class SyncDecision:
    pull: list[int] = field(default_factory=list)  # instances to Pull the PS version now
    hold: frozenset = frozenset()  # instances routing must skip this cycle (draining before a pull)


def _behind(instances, ps_version: int) -> list:
    return [i for i in instances if i.inst_version < ps_version]


def _idle(inst) -> bool:
    """Drained: nothing generating or waiting, and no episode between turns (a barrier waits for whole episodes)."""
    return not inst.run_trajs and not inst.wait_trajs and not getattr(inst, "env_trajs", ())


def sync_greedy(instances, ts_trajs, ps_version: int, **_) -> SyncDecision:
    """Vanilla: every instance behind the PS pulls as soon as a newer version exists."""
    return SyncDecision([i.idx for i in _behind(instances, ps_version)])


def sync_per_instance(instances, ts_trajs, ps_version: int, **_) -> SyncDecision:
    """Laminar relay: an instance behind takes no new work, drains on its own weights, then pulls alone."""
    behind = _behind(instances, ps_version)
    return SyncDecision([i.idx for i in behind if _idle(i)], frozenset(i.idx for i in behind))


def sync_global(instances, ts_trajs, ps_version: int, *, partial_rollout: bool = False, **_) -> SyncDecision:
    """Global: partial rollout pulls every instance at once; otherwise a barrier (all drain, then all pull)."""
    behind = _behind(instances, ps_version)
    if not behind:
        return SyncDecision()
    if partial_rollout or all(_idle(i) for i in instances):
        return SyncDecision([i.idx for i in behind])
    return SyncDecision([], frozenset(i.idx for i in instances))


def _routable_on(ts_trajs, verify: Callable[[int], bool]) -> Callable[[int], bool]:
    """Algorithm 4 lines 4-10 for every version at once: is some TS trajectory routable (Algorithm 2) to an
    instance on `version`? A partial one needs version >= V_traj, an initial one verify(version), so one pass
    over the TS (oldest V_traj, any initial) answers for every instance instead of one scan per instance."""
    if isinstance(ts_trajs, MLQ):  # already in queue order: the oldest V_traj is first, initial ones last
        oldest, initial = ts_trajs.oldest(), ts_trajs.has_initial()
    else:
        oldest, initial = None, False
        for t in ts_trajs:
            v = t.v_traj
            if v is None:
                initial = True
            elif oldest is None or v < oldest:
                oldest = v
    cache: dict[int, bool] = {}

    def routable(version: int) -> bool:
        if oldest is not None and version >= oldest:
            return True
        if not initial:
            return False
        if version not in cache:
            cache[version] = bool(verify(version))
        return cache[version]

    return routable


def _tentative_router(route: Callable, verify: Callable[[int], bool], cost: CostModel | None,
                      mu: float | None) -> tuple[Callable, CostModel | None, float | None]:
    """The routing strategy Algorithm 4 (line 18) runs on the tentative snapshot, with its cost model and mu.

    §5.3 states the sync criterion as "this tentative update enables new trajectories to be routed
    (indicating that the marginal gain exceeds the predefined threshold)": the test is the cost model's
    mu * Delta T_ideal threshold of Algorithm 3, and §6.5 sums the strategy up as syncing "per instance
    based on actual load". Vanilla least-loaded routing has no threshold (it routes to any instance with
    room), so running it here turns the test into "has room", which an instance behind nearly always has,
    and the sync degenerates to greedy (with least-loaded routing, the ablation's "+S" could never differ
    from "vanilla"; benchmarks/results/ablation.md). So whenever a
    cost model is known the tentative pass is Algorithm 3 with the coordinator's mu, whatever routing the
    coordinator issues Route commands with (interpretation of §5.3 for the R-vanilla / S-StaleFlow
    combinations of Figure 16); only without a cost model does it fall back to `route`, and then the
    sync cannot be throughput-aware.

    `cost` / `mu` may be given explicitly; otherwise they are read from `route` when it is a
    functools.partial carrying them (what Coordinator._route_fn builds).
    """
    kw = getattr(route, "keywords", None) or {}
    cost = cost if cost is not None else kw.get("cost")
    if cost is None:
        return route, None, None
    mu = mu if mu is not None else kw.get("mu", _DEFAULT_MU)
    if getattr(route, "func", None) is route_cost_model:
        return partial(route, cost=cost, mu=mu), cost, mu  # keeps its verify / hold
    return partial(route_cost_model, cost=cost, verify=verify, mu=mu), cost, mu


def sync_throughput_aware(instances, ts_trajs, ps_version: int, *, verify: Callable[[int], bool],
                          route: Callable, cost: CostModel | None = None, mu: float | None = None,
                          **_) -> SyncDecision:
    """StaleFlow (Algorithm 4): pull an instance behind only if nothing in the TS is routable to it now
    (step 1, lines 2-12: it can take no more load on its own weights) and a tentative update would let
    the routing strategy route to it, i.e. its marginal gain clears mu * Delta T_ideal (step 2, lines 14-27).

    `route(instances, ts_trajs)` is the coordinator's routing strategy without side effects on the
    staleness policy; the tentative pass uses the cost-model waterfall when a cost model is known
    (see _tentative_router). Each candidate is tried on its own copy of the snapshot with only its
    version changed (lines 15-16), so candidates are judged independently of one another.
    """
    if not ts_trajs:
        return SyncDecision()  # nothing to route: no tentative update can route anything (lines 21-25)
    routable = _routable_on(ts_trajs, verify)
    candidates = [i for i in _behind(instances, ps_version) if not routable(i.inst_version)]
    if not candidates:
        return SyncDecision()
    router, cost, mu = _tentative_router(route, verify, cost, mu)
    # Exact shortcut for the waterfall: before its first route an instance's gain is the snapshot's, so it
    # can be routed to only if some TS trajectory's gain on it clears the threshold (Algorithm 3 line 31).
    thresholds = {} if cost is None else {tok: mu * cost.ideal_gain(tok) for tok in {t.tokens for t in ts_trajs}}
    pull = []
    for cand in candidates:
        if cost is not None and not any(0 < g >= thr for g, thr in
                                        ((cost.marginal_gain(cand, tok), thr) for tok, thr in thresholds.items())):
            continue
        temp = [i.shallow() for i in instances]
        target = next(i for i in temp if i.idx == cand.idx)
        target.inst_version = ps_version
        # Only the version changes (Algorithm 4 line 16): the instance keeps its run/wait trajectories and
        # KV in the tentative snapshot, so a busy instance shows a small gain and keeps draining on its
        # old weights; it is pulled once its load is low enough for new work to clear the threshold.
        route = partial(router, until=cand.idx) if getattr(router, "func", None) is route_cost_model else router
        if any(r.inst == cand.idx for r in route(temp, ts_trajs)):
            pull.append(cand.idx)
    return SyncDecision(pull)


SYNC = {
    "greedy": sync_greedy,
    "per_instance": sync_per_instance,
    "global": sync_global,
    "throughput_aware": sync_throughput_aware,
}
