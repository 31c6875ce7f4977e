"""StreamRL skew-aware dispatch (StreamRL §5.3, Algorithm 2; Eq. 1-2) and LPT order within an instance."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass


def percentile(values: Sequence[float], q: float, presorted: bool = False) -> float:
    """The q-th percentile (0..100), linear interpolation between order statistics (`presorted`: values ascend)."""
    xs = values if presorted else sorted(values)
    if not xs:
        raise ValueError("percentile of an empty distribution")
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def instance_latency(m: int, l_avg: float, ptl: Callable[[int], float], max_batch: int) -> float:
    """Eq. 2: PTL(BS) * L_avg * ceil(M / BS), with BS = min(M, max_batch)."""
    if m <= 0:
        return 0.0
    bs = max(1, min(m, max_batch))
    return ptl(bs) * l_avg * math.ceil(m / bs)


@dataclass(frozen=True)
class DispatchPlan:
    n_long: int  # N_l instances for long-tail samples (the first N_l instance indices)
    n_regular: int  # N_r
    long_tail: list  # prompts marked long-tail, longest first
    regular: list  # the rest, longest first
    latency: float  # estimated generation time of the chosen split

    @property
    def assignment(self) -> dict[int, list]:
        """Instance index -> prompts in LPT order (longest predicted first): each partition spread evenly, longest
        first round robin. Computed on demand: a caller that routes from the two ranked lists needs no per-instance
        lists (the simulator re-plans at every top-up)."""
        out = {i: [] for i in range(self.n_long + self.n_regular)}
        _spread(self.long_tail, list(range(self.n_long)), out)
        _spread(self.regular, list(range(self.n_long, self.n_long + self.n_regular)), out)
        return out


def skew_aware_dispatch(prompts: Sequence, predicted: Sequence[float], n_instances: int, recent_lengths: Sequence[float],
                        ptl: Callable[[int], float], *, alpha: float = 0.2,
                        max_batch: Callable[[float], int] | int = 256) -> DispatchPlan:
    """Algorithm 2: sort by predicted length, top alpha long-tail, (N_l, N_r) minimising the estimated latency.

    Long-tail instances are assumed to decode L_alpha = P90 tokens per sample, regular ones L_r = P50
    (of `recent_lengths`). The split's latency is the slower of the two partitions: Algorithm 2 writes a
    sum, but the partitions decode in parallel and §5.3's stated goal is the generation time (deviation).
    `max_batch(L)` bounds BS by KV memory for samples of L tokens. With one instance nothing is split.
    """
    if n_instances < 1:
        raise ValueError("dispatch needs at least one instance")
    order = sorted(range(len(prompts)), key=predicted.__getitem__, reverse=True)  # longest first; ties: input order
    ranked = [prompts[j] for j in order]
    k = int(alpha * len(ranked)) if n_instances > 1 else 0
    long_tail, regular = ranked[:k], ranked[k:]
    recent = sorted(recent_lengths)  # once for both percentiles
    l_long, l_reg = percentile(recent, 90, presorted=True), percentile(recent, 50, presorted=True)
    cap = max_batch if callable(max_batch) else (lambda _l: max_batch)
    best = None
    lo = 1 if long_tail else 0
    hi = n_instances - 1 if regular else n_instances
    cap_long, cap_reg = cap(l_long), cap(l_reg)
    long_at, reg_at = {}, {}  # Eq. 2 by per-instance count: ceil(L / n) takes few distinct values over the n tried
    for n_l in range(lo, hi + 1):
        n_r = n_instances - n_l
        t_long = t_reg = 0.0
        if n_l:
            m = math.ceil(len(long_tail) / n_l)
            t_long = long_at.get(m)
            if t_long is None:
                t_long = long_at[m] = instance_latency(m, l_long, ptl, cap_long)
        if n_r:
            m = math.ceil(len(regular) / n_r)
            t_reg = reg_at.get(m)
            if t_reg is None:
                t_reg = reg_at[m] = instance_latency(m, l_reg, ptl, cap_reg)
        t = max(t_long, t_reg)
        if best is None or t < best[0]:
            best = (t, n_l)
    latency, n_l = best
    return DispatchPlan(n_l, n_instances - n_l, long_tail, regular, latency)


def _spread(ranked: list, insts: list[int], assignment: dict[int, list]) -> None:
    """Even split, longest first round robin: each instance's list is already in LPT order."""
    for j, p in enumerate(ranked):
        assignment[insts[j % len(insts)]].append(p)
