"""Migration strategies: interrupt work on overloaded or long-tail instances (StaleFlow Algorithm 5; Laminar §5.2).

threshold returns (inst, trajs) to interrupt back to the TS; repack returns (source, destination)
pairs whose trajectories move together onto the destination, the source then being free to pull.
"""

from __future__ import annotations

from dataclasses import dataclass

from .routing import CostModel


def migrate_none(instances, **_) -> list[tuple[int, list]]:
    """No migration."""
    return []


def migrate_threshold(instances, *, cost: CostModel, phi_wait: int = 3, phi_throughput: float = 5.0,
                      **_) -> list[tuple[int, list]]:
    """Algorithm 5: excess wait_trajs beyond phi_wait go back; if max/min throughput > phi_throughput,
    everything on the highest-throughput instance goes back for redistribution (as the paper states).

    The excess is taken from the tail of wait_trajs (the ones that would run last). Instances with no
    running work have T_i = 0 and are left out of the gap (max/min would be infinite); §5.3 leaves idle
    instances to the routing strategy.
    """
    migration = []
    for inst in instances:
        excess = len(inst.wait_trajs) - phi_wait
        if excess > 0:
            moved = inst.wait_trajs[-excess:]
            migration.append((inst.idx, moved))
            inst.wait_trajs = inst.wait_trajs[:-excess]
    busy = [(cost.throughput(i.kv_cache, len(i.run_trajs)), i.idx, i) for i in instances if i.run_trajs]
    if len(busy) >= 2:
        hi, lo = max(busy, key=lambda b: (b[0], -b[1])), min(busy, key=lambda b: (b[0], b[1]))
        if hi[0] / lo[0] > phi_throughput:
            inst = hi[2]
            done = {id(t) for idx, trajs in migration if idx == inst.idx for t in trajs}
            rest = [t for t in inst.run_trajs + inst.wait_trajs if id(t) not in done]
            if rest:
                migration.append((inst.idx, rest))
    return migration


@dataclass(frozen=True)
class RepackMove:
    src: int
    dst: int


def repack_plan(instances, *, c_max: float, batch_limit: int) -> list[RepackMove]:
    """Laminar Algorithm 1 (best-fit consolidation) over one weight-version group.

    Candidates ramp down (kv < min(C_max, kv_prev)) and hold fewer than B trajectories; smallest KV is
    released first, onto the fitting destination that ends up most densely packed.
    """
    cands = [i for i in instances if i.kv_prev is not None and i.kv_cache < min(c_max, i.kv_prev)
             and _n_reqs(i) < batch_limit]
    cands.sort(key=lambda i: (i.kv_cache, i.idx))
    load_c = {i.idx: i.kv_cache for i in cands}  # destination load including what the plan moved there
    load_n = {i.idx: _n_reqs(i) for i in cands}
    emptied: set[int] = set()
    dests: set[int] = set()
    plan = []
    for s in cands:
        if s.idx in emptied or s.idx in dests:
            continue  # a destination already holds moved work; releasing it would move that work twice
        fits = [d for d in cands if d.idx not in emptied and d.idx != s.idx
                and load_c[d.idx] + s.kv_cache <= c_max and load_n[d.idx] + _n_reqs(s) <= batch_limit]
        if not fits:
            continue
        d = max(fits, key=lambda d: (load_c[d.idx], -d.idx))
        load_c[d.idx] += s.kv_cache
        load_n[d.idx] += _n_reqs(s)
        emptied.add(s.idx)
        dests.add(d.idx)
        plan.append(RepackMove(s.idx, d.idx))
    return plan


def _n_reqs(inst) -> int:
    return len(inst.run_trajs) + len(inst.wait_trajs)


def migrate_repack(instances, *, c_max: float, batch_limit: int, **_) -> list[RepackMove]:
    """Laminar repack (Laminar §5.1): plan per weight-version group, every group independently."""
    groups: dict[int, list] = {}
    for inst in instances:
        if _n_reqs(inst):
            groups.setdefault(inst.inst_version, []).append(inst)
    return [m for v in sorted(groups) for m in repack_plan(groups[v], c_max=c_max, batch_limit=batch_limit)]


MIGRATION = {"none": migrate_none, "threshold": migrate_threshold, "repack": migrate_repack}
