"""Synchronization strategies: which instances Pull now, and which take no new routes (staleflow.txt §5.3, Algorithm 4).

Each is a pure function (instances, ts_trajs, ps_version, ...) -> SyncDecision. The cycle (Algorithm 1
lines 4-9) interrupts whatever a pulled instance still holds and returns it to the TS, so a pull with
partial rollout resumes those trajectories elsewhere or on the new weights, V_traj kept.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from .routing import _Admission


@dataclass(frozen=True)
class SyncDecision:
    pull: list[int] = field(default_factory=list)  # instances to Pull the PS version now
    hold: frozenset = frozenset()  # instances routing must skip this cycle (draining before a pull)


def _behind(instances, ps_version: int) -> list:
    return [i for i in instances if i.inst_version < ps_version]


def _idle(inst) -> bool:
    return not inst.run_trajs and not inst.wait_trajs


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


def sync_throughput_aware(instances, ts_trajs, ps_version: int, *, verify: Callable[[int], bool],
                          route: Callable, **_) -> SyncDecision:
    """StaleFlow (Algorithm 4): pull an instance behind only if nothing in the TS is routable to it now
    and a tentative update would let the routing strategy route to it (its gain clears the threshold).

    `route(instances, ts_trajs)` is the routing strategy without side effects on the staleness policy.
    """
    adm = _Admission(verify, None)
    candidates = [i for i in _behind(instances, ps_version)
                  if not any(adm.routable(t, i.inst_version) for t in ts_trajs)]
    pull = []
    for cand in candidates:
        temp = [i.clone() for i in instances]
        target = next(i for i in temp if i.idx == cand.idx)
        target.inst_version = ps_version
        # Only the version changes (Algorithm 4 line 16): a busy instance shows a small gain and keeps
        # draining; it is pulled once its load is low enough for new work to clear the threshold.
        if any(r.inst == cand.idx for r in route(temp, ts_trajs)):
            pull.append(cand.idx)
    return SyncDecision(pull)


SYNC = {
    "greedy": sync_greedy,
    "per_instance": sync_per_instance,
    "global": sync_global,
    "throughput_aware": sync_throughput_aware,
}
