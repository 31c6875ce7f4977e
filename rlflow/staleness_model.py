"""Closed-form mean staleness under queue-drop (docs/internals/architecture.md, "The closed-form staleness model").

Pure math, no heavy imports: the compiler calls it to print a prediction next to the plan,
the simulator's validation compares against it.

Units: B (batch) and C (concurrency) count samples (rollouts), not groups; B = G * S.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from functools import lru_cache

# "Predicting and Controlling Staleness in Fully Asynchronous RL Training", "The discrete-event simulator": sigma = 1.3 * tailness / 100.
SIGMA_PER_TAILNESS = 1.3 / 100


def lognormal_sigma(tailness: float) -> float:
    return SIGMA_PER_TAILNESS * tailness


def _lognormal_cdf(x: float, mean: float, sigma: float) -> float:
    # L = mean * exp(sigma z - sigma^2 / 2), z ~ N(0, 1)
    if x <= 0:
        return 0.0
    z = (math.log(x / mean) + sigma * sigma / 2) / sigma
    return 0.5 * (1 + math.erf(z / math.sqrt(2)))


@lru_cache(maxsize=256)
def tail_multiplier(tailness: float, group_size: int, cap: float | None = None, mean: float = 1.0,
                    prompt_share: float = 0.0) -> float:
    """M_tail = E[max(L_1..L_S)] / E[L] for the (optionally capped) lognormal of the digest.

    Both expectations are integrals of survival functions, E[X] = int_0^inf P(X > x) dx, taken
    numerically on a log-spaced grid; with a cap c both integrals stop at c (L is min(L, c)).

    prompt_share: the share of log-length variance a group's samples have in common (their prompt's), as the
    simulator draws them (sim/lengths.py): the digest's i.i.d. group is 0; at 1 a group's samples are equally long
    and M_tail is 1. Above 0 the group is no longer i.i.d. and both expectations are taken by `_capped_max_mean`.
    """
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if not 0 <= prompt_share <= 1:
        raise ValueError(f"prompt_share must be in [0, 1], got {prompt_share}")
    sigma = lognormal_sigma(tailness)
    if sigma == 0 or group_size == 1:
        return 1.0
    if prompt_share > 0:
        return (_capped_max_mean(sigma, group_size, cap, mean, prompt_share)
                / _capped_max_mean(sigma, 1, cap, mean, prompt_share))
    hi = cap if cap is not None else mean * math.exp(sigma * 9)
    n = 4000
    lo = mean * math.exp(-sigma * 9)
    xs = [0.0] + [lo * (hi / lo) ** (i / n) for i in range(n + 1)]
    e_max = e_one = 0.0
    for a, b in zip(xs, xs[1:]):
        f = _lognormal_cdf((a + b) / 2, mean, sigma)
        e_one += (1 - f) * (b - a)
        e_max += (1 - f**group_size) * (b - a)
    return e_max / e_one


def _capped_max_mean(sigma: float, group_size: int, cap: float | None, mean: float, share: float, n: int = 241) -> float:
    """E[min(max(L_1..L_S), cap)] for L_i = mean * exp(sigma (sqrt(share) z + sqrt(1 - share) e_i) - sigma^2 / 2), with
    one z per group and e_i i.i.d. standard normals. The max of the group is exp(mu + sigma sqrt(share) z + tau M), M
    the max of S standard normals (density S phi(m) Phi(m)^(S-1)), tau = sigma sqrt(1 - share): a double integral over
    (z, m), taken on an n x n grid over [-8, 8]^2."""
    span = 8.0
    h = 2 * span / (n - 1)
    zs = [-span + i * h for i in range(n)]
    pdf = [math.exp(-z * z / 2) / math.sqrt(2 * math.pi) for z in zs]
    f_max = [group_size * p * (0.5 * (1 + math.erf(z / math.sqrt(2)))) ** (group_size - 1) for z, p in zip(zs, pdf)]
    mu, rho, tau = math.log(mean) - sigma * sigma / 2, sigma * math.sqrt(share), sigma * math.sqrt(1 - share)
    top = math.inf if cap is None else cap
    total = 0.0
    for z, wz in zip(zs, pdf):
        base = mu + rho * z
        total += wz * sum(wm * min(math.exp(base + tau * m), top) for m, wm in zip(zs, f_max))
    return total * h * h


@dataclass(frozen=True)
class StalenessPrediction:
    rho: float  # trainer utilization v_R / v_T
    pre_queue: float  # PQS
    in_queue: float  # IQS
    mean: float  # PQS + IQS

    def as_dict(self) -> dict:
        return asdict(self)


def predict_mean_staleness(
    *, rho: float, concurrency: int, batch: int, tail: float, queue_factor: float = 1.0
) -> StalenessPrediction:
    """Mean staleness of queue-drop ("Predicting and Controlling Staleness in Fully Asynchronous RL Training", "Total"; docs/concepts/staleness.md).

    rho = v_R / v_T; concurrency C and batch B in samples; tail = M_tail; queue_factor q = Q / B >= 1.
    """
    if rho <= 0:
        raise ValueError(f"rho must be > 0, got {rho}")
    if queue_factor < 1:
        raise ValueError(f"queue factor q = Q/B must be >= 1, got {queue_factor}")
    pqs = concurrency * tail / (batch * max(1.0, rho))
    iqs = rho if rho <= 1 else (2 * queue_factor + rho - 1) / (2 * rho)
    return StalenessPrediction(rho=rho, pre_queue=pqs, in_queue=iqs, mean=pqs + iqs)
