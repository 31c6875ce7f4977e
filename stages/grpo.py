"""GRPO loss math: pure tensor functions, no model, no DeepSpeed.

Sources: GRPO group-relative advantages (DeepSeekMath, arXiv:2402.03300 §4.1); DAPO clip-higher and
token-level loss (arXiv:2503.14476 §3.1, §3.3); decoupled PPO for stale rollouts (AReaL, arXiv:2505.24298 §5.2).
Shapes: B sequences, T completion-target positions; `mask` is 1 on real completion tokens, 0 on padding.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

LossAgg = Literal["token", "sequence"]


def group_advantages(rewards: Tensor, normalize_std: bool = True, eps: float = 1e-6) -> Tensor:
    """[G, S] rewards -> [G, S] advantages: reward minus its group mean, optionally over the group std.

    The std is the population std (correction 0), so a group of one gets advantage 0, not NaN.
    """
    adv = rewards - rewards.mean(dim=-1, keepdim=True)
    if normalize_std:
        adv = adv / (rewards.std(dim=-1, keepdim=True, correction=0) + eps)
    return adv


def token_logprobs(logits: Tensor, tokens: Tensor, temperature: float = 1.0) -> Tensor:
    """log softmax(logits / temperature) at `tokens`: the log-prob of the distribution the sampler drew from."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of softmax(logits) over the last dim (pass logits already divided by the temperature)."""
    logits = logits.float()
    return torch.logsumexp(logits, dim=-1) - (torch.softmax(logits, dim=-1) * logits).sum(dim=-1)


def aggregate(per_token: Tensor, mask: Tensor, loss_agg: LossAgg, normalizer: float | None = None) -> Tensor:
    """Reduce [B, T] per-token values to a scalar.

    token: sum over valid tokens / number of valid tokens (DAPO). sequence: mean over each sequence's
    valid tokens, then mean over non-empty sequences. `normalizer` replaces the denominator (valid tokens,
    resp. non-empty sequences) with a batch-wide count, so micro-batch results sum to the full-batch value.
    """
    mask = mask.to(per_token.dtype)
    masked = per_token * mask
    if loss_agg == "token":
        denom = mask.sum() if normalizer is None else normalizer
        return masked.sum() / max(float(denom), 1.0)
    if loss_agg == "sequence":
        lengths = mask.sum(dim=-1)
        per_seq = masked.sum(dim=-1) / lengths.clamp(min=1.0)
        denom = (lengths > 0).sum() if normalizer is None else normalizer
        return per_seq.sum() / max(float(denom), 1.0)
    raise ValueError(f"loss_agg must be 'token' or 'sequence', got {loss_agg!r}")


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    behaviour_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float,
    clip_high: float,
    max_importance_ratio: float,
    loss_agg: LossAgg,
    normalizer: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Decoupled PPO-clip loss; advantages are [B] (one per sequence) or [B, T].

    r = pi / pi_old (pi_old: the trainer's weights at the start of the step, the proximal policy), clipped to
    [1 - clip_low, 1 + clip_high]; w = pi_old / pi_behaviour (the weights that sampled the tokens), truncated at
    max_importance_ratio and detached. Per token: -w * min(r * A, clip(r) * A). With old == behaviour, w = 1:
    plain PPO.
    """
    valid = mask.bool()
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)
    advantages = advantages.to(logprobs.dtype)
    # Padding may hold anything: zero the log-ratios there so exp() cannot overflow into NaN gradients.
    log_ratio = torch.where(valid, logprobs - old_logprobs, torch.zeros_like(logprobs))
    ratio = torch.exp(log_ratio)
    clipped_ratio = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    surrogate = torch.minimum(ratio * advantages, clipped_ratio * advantages)

    log_w = torch.where(valid, old_logprobs - behaviour_logprobs, torch.zeros_like(old_logprobs)).detach()
    raw_w = torch.exp(log_w)
    w = raw_w.clamp(max=max_importance_ratio)

    loss = aggregate(-w * surrogate, mask, loss_agg, normalizer)

    with torch.no_grad():
        n = valid.sum().clamp(min=1)
        clipped = ((advantages > 0) & (ratio > 1.0 + clip_high)) | ((advantages < 0) & (ratio < 1.0 - clip_low))
        stats = {
            "clip_frac": float((clipped & valid).sum() / n),
            "ratio_mean": float(ratio[valid].sum() / n),
            "importance_weight_mean": float(raw_w[valid].sum() / n),
            "importance_weight_max": float(raw_w[valid].max()) if valid.any() else 1.0,
            "importance_truncated_frac": float(((raw_w > max_importance_ratio) & valid).sum() / n),
        }
    return loss, stats


def kl_penalty(
    logprobs: Tensor,
    ref_logprobs: Tensor,
    mask: Tensor,
    *,
    loss_agg: LossAgg = "token",
    normalizer: float | None = None,
) -> Tensor:
    """KL(pi || pi_ref) with the k3 estimator exp(ref - logp) - (ref - logp) - 1 (Schulman 2020), aggregated."""
    valid = mask.bool()
    delta = torch.where(valid, ref_logprobs - logprobs, torch.zeros_like(logprobs))
    per_token = torch.exp(delta) - delta - 1.0
    return aggregate(per_token, mask, loss_agg, normalizer)
