"""Policy losses by name: PPO-clip (GRPO's, with DAPO's clip-higher), GSPO and CISPO, plus the entropy bonus.

Every loss takes the same arguments: log-probs of pi (with gradient), pi_old (the trainer's weights at the step's
start) and pi_behaviour (the weights that sampled), [B] or [B, T] advantages, the mask, its clip range and the
aggregation (stages/loss_agg.py). Each multiplies its per-token term by the off-policy weight w of pi_old /
pi_behaviour from grpo.importance_weights, unchanged, and returns (loss, stats) with grpo.step_stats' keys.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlflow.stages import grpo
from rlflow.stages.loss_agg import LossAgg, aggregate, sequence_sums

#: PPO-clip with clip-higher: today's GRPO loss, exactly (grpo.policy_loss)
ppo_clip = grpo.policy_loss


def _prepare(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """(log r = log pi - log pi_old, 0 off the mask; advantages as [B, 1] or [B, T] in the log-probs' dtype)."""
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)
    log_ratio = torch.where(mask.bool(), logprobs - old_logprobs, torch.zeros_like(logprobs))
    return log_ratio, advantages.to(logprobs.dtype)


def _weights(old_logprobs, behaviour_logprobs, mask, segments, off_policy) -> tuple[Tensor, Tensor, Tensor]:
    return grpo.importance_weights(old_logprobs - behaviour_logprobs, mask, segments=segments, **off_policy)


def gspo(
    logprobs: Tensor,
    old_logprobs: Tensor,
    behaviour_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    loss_agg: LossAgg = "seq-mean-token-mean",
    normalizer: float | None = None,
    segments: Tensor | None = None,
    max_tokens: int | None = None,
    **off_policy,
) -> tuple[Tensor, dict[str, float]]:
    """GSPO: one ratio per sequence, s_i = (pi(y_i) / pi_old(y_i))^(1/|y_i|) = exp(mean_t log r_t), clipped to
    [1 - clip_low, 1 + clip_high], loss -min(s_i A_i, clip(s_i) A_i) (Zheng et al., "Group Sequence Policy
    Optimization", arXiv:2507.18071 §4.1, eq. 5 and 7 for s_i; defaults 3e-4 / 4e-4 from its §5.1).

    Run as GSPO-token (eq. 13-14): s_i,t = sg[s_i] * pi(y_i,t) / sg[pi(y_i,t)], which has s_i's value and, with
    seq-mean-token-mean aggregation and one advantage per sequence, GSPO's gradient, and keeps packed rows and the
    per-token off-policy weight working. `off_policy`: grpo.importance_weights' keyword arguments.
    """
    valid = mask.bool()
    log_ratio, advantages = _prepare(logprobs, old_logprobs, advantages, mask)
    lengths = sequence_sums(valid.to(logprobs.dtype), segments).clamp(min=1.0)
    seq_log_ratio = sequence_sums(log_ratio, segments) / lengths  # (1/|y_i|) sum_t log r_t
    per_position = seq_log_ratio.unsqueeze(-1) if segments is None else seq_log_ratio[segments]
    token_log = per_position.detach() + logprobs - logprobs.detach()
    ratio = torch.exp(torch.where(valid, token_log, torch.zeros_like(token_log)))
    clipped_ratio = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    surrogate = torch.minimum(ratio * advantages, clipped_ratio * advantages)
    w, truncated, masked = _weights(old_logprobs, behaviour_logprobs, mask, segments, off_policy)
    loss = aggregate(-w * surrogate, mask, loss_agg, normalizer, segments, max_tokens)
    with torch.no_grad():
        clipped = ((advantages > 0) & (ratio > 1.0 + clip_high)) | ((advantages < 0) & (ratio < 1.0 - clip_low))
    return loss, grpo.step_stats(ratio, clipped, mask, old_logprobs, behaviour_logprobs, w, truncated, masked)


def cispo(
    logprobs: Tensor,
    old_logprobs: Tensor,
    behaviour_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float | None = None,
    clip_high: float = 4.0,
    loss_agg: LossAgg = "token-mean",
    normalizer: float | None = None,
    segments: Tensor | None = None,
    max_tokens: int | None = None,
    **off_policy,
) -> tuple[Tensor, dict[str, float]]:
    """CISPO: per token -sg(r^) A log pi, r^ = clip(r, 1 - clip_low, 1 + clip_high), r = pi / pi_old: the importance
    weight is clipped and carries no gradient, so no token's gradient is dropped (MiniMax-M1, "Scaling Test-Time
    Compute Efficiently with Lightning Attention", arXiv:2506.13585 §3.1, eq. 4 and 5; token-mean as there, 1 / sum
    |o_i|). clip_low None: no lower bound, as the paper ran it (it tuned only clip_high)."""
    valid = mask.bool()
    log_ratio, advantages = _prepare(logprobs, old_logprobs, advantages, mask)
    ratio = torch.exp(log_ratio)
    low = 0.0 if clip_low is None else 1.0 - clip_low
    clipped_ratio = ratio.clamp(low, 1.0 + clip_high).detach()
    w, truncated, masked = _weights(old_logprobs, behaviour_logprobs, mask, segments, off_policy)
    per_token = -w * clipped_ratio * advantages * torch.where(valid, logprobs, torch.zeros_like(logprobs))
    loss = aggregate(per_token, mask, loss_agg, normalizer, segments, max_tokens)
    with torch.no_grad():
        clipped = (ratio > 1.0 + clip_high) | (ratio < low)
    return loss, grpo.step_stats(ratio, clipped, mask, old_logprobs, behaviour_logprobs, w, truncated, masked)


#: the policy loss of each algorithm (the trainer's `algo`)
POLICY_LOSSES = {"grpo": ppo_clip, "dr_grpo": ppo_clip, "rloo": ppo_clip, "reinforce_pp": ppo_clip, "gspo": gspo,
                 "cispo": cispo, "ppo": ppo_clip}


def entropy_bonus(
    entropy: Tensor,
    mask: Tensor,
    coef: float,
    *,
    loss_agg: LossAgg = "token-mean",
    normalizer: float | None = None,
    segments: Tensor | None = None,
    max_tokens: int | None = None,
) -> Tensor:
    """coef * the aggregated entropy of pi at each valid position, to subtract from the loss: the entropy
    regulariser of A3C and PPO (Schulman et al., "Proximal Policy Optimization Algorithms", arXiv:1707.06347 §5,
    eq. 9, the c2 S[pi](s_t) term). `entropy` must carry its gradient for the bonus to act."""
    return coef * aggregate(entropy, mask, loss_agg, normalizer, segments, max_tokens)
