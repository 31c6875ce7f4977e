"""KL(pi || pi_ref) per token, by Schulman's estimators, as a loss term or as a per-token reward.

Schulman, "Approximating KL Divergence" (2020): for tokens sampled from pi and r = pi_ref / pi at each,
  k1 = -log r                 unbiased, high variance, can be negative
  k2 = (log r)^2 / 2          biased, low variance
  k3 = (r - 1) - log r        unbiased, low variance, >= 0 (GRPO's penalty, DeepSeekMath arXiv:2402.03300 eq. 4)
As a loss term (`kl_penalty`) the estimate is aggregated like the policy loss and added with kl_coef; folded into
the reward (`kl_reward`, REINFORCE++: "Stabilizing Critic-Free Policy Optimization with Global
Normalization", arXiv:2501.03262 §3) each token earns -kl_coef * KL_t.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch
from torch import Tensor

from rlflow.stages.loss_agg import LossAgg, aggregate

KlEstimator = Literal["k1", "k2", "k3"]
KL_ESTIMATORS: tuple[str, ...] = get_args(KlEstimator)


def kl_per_token(logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor, estimator: KlEstimator = "k3") -> Tensor:
    """[B, T] estimates of KL(pi || pi_ref) at the sampled tokens, 0 off the mask (module docstring)."""
    valid = mask.bool()
    log_r = torch.where(valid, ref_logprobs - logprobs, torch.zeros_like(logprobs))
    if estimator == "k3":
        return torch.exp(log_r) - log_r - 1.0
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * log_r * log_r
    raise ValueError(f"kl estimator must be one of {', '.join(KL_ESTIMATORS)}; got {estimator!r}")


def kl_penalty(
    logprobs: Tensor,
    ref_logprobs: Tensor,
    mask: Tensor,
    *,
    loss_agg: LossAgg = "token",
    normalizer: float | None = None,
    segments: Tensor | None = None,
    max_tokens: int | None = None,
    estimator: KlEstimator = "k3",
) -> Tensor:
    """KL(pi || pi_ref) by `estimator` (k3 by default), aggregated as the policy loss is: the loss term."""
    per_token = kl_per_token(logprobs, ref_logprobs, mask, estimator)
    return aggregate(per_token, mask, loss_agg, normalizer, segments, max_tokens)


def kl_reward(
    logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor, kl_coef: float, estimator: KlEstimator = "k1"
) -> Tensor:
    """[B, T] per-token rewards -kl_coef * KL_t (REINFORCE++ arXiv:2501.03262 §3: KL(t) = log pi_old / pi_ref, k1), no gradient."""
    with torch.no_grad():
        return -kl_coef * kl_per_token(logprobs, ref_logprobs, mask, estimator)
