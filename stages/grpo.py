"""GRPO loss math: pure tensor functions, no model, no DeepSpeed.

Sources: GRPO group-relative advantages (DeepSeekMath, arXiv:2402.03300 §4.1); DAPO clip-higher and
token-level loss (arXiv:2503.14476 §3.1, §3.3); decoupled PPO for stale rollouts (AReaL, arXiv:2505.24298 §5.2;
Hilton et al., arXiv:2110.00641); off-policy corrections in `importance_weights`.
Shapes: B rows, T completion-target positions; `mask` is 1 on real completion tokens, 0 on padding. A row is one
sequence, or several packed end to end (stages/packing.py): then `segments` [B, T] numbers the sequence each position
belongs to, so per-sequence sums stay per sequence.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Literal, get_args

import torch
from torch import Tensor

from rlflow.stages.kl import kl_penalty  # noqa: F401 - the k3 loss term, kept importable from here
from rlflow.stages.loss_agg import LossAgg, aggregate, sequence_sums  # noqa: F401 - kept importable from here

#: how the weight pi_old / pi_behaviour corrects for stale or mismatched samples (see `importance_weights`)
OffPolicy = Literal["decoupled", "tis_token", "tis_sequence", "mis_token", "mis_sequence", "icepop"]
OFF_POLICY: tuple[str, ...] = get_args(OffPolicy)


def group_advantages(rewards: Tensor, normalize_std: bool = True, eps: float = 1e-6) -> Tensor:
    """[G, S] rewards -> [G, S] advantages: reward minus its group mean, optionally over the group std.

    The std is the population std (correction 0), so a group of one gets advantage 0, not NaN.
    """
    adv = rewards - rewards.mean(dim=-1, keepdim=True)
    if normalize_std:
        adv = adv / (rewards.std(dim=-1, keepdim=True, correction=0) + eps)
    return adv


def batch_advantages(
    rewards: Tensor, group_ids: Sequence, per_group: Callable[[Tensor], Tensor] = group_advantages
) -> Tensor:
    """[B] rewards of a batch -> [B] advantages, each row's within its own group (`group_ids[i]` names row i's).

    Groups may be smaller than group_size when a member's reward failed (the runtime drops that member, not the
    group), so each group is normalised on its own. `per_group`: [1, S] rewards -> [1, S] advantages (GRPO's by
    default; stages/advantages.py has the others).
    """
    groups: dict = {}
    for i, gid in enumerate(group_ids):
        groups.setdefault(gid, []).append(i)
    adv = torch.empty(len(group_ids))
    for members in groups.values():
        adv[members] = per_group(rewards[members].unsqueeze(0))[0]
    return adv


def token_logprobs(logits: Tensor, tokens: Tensor, temperature: float = 1.0) -> Tensor:
    """log softmax(logits / temperature) at `tokens`: the log-prob of the distribution the sampler drew from."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of softmax(logits) over the last dim (pass logits already divided by the temperature)."""
    logits = logits.float()
    return torch.logsumexp(logits, dim=-1) - (torch.softmax(logits, dim=-1) * logits).sum(dim=-1)


def importance_weights(
    log_ratio: Tensor,
    mask: Tensor,
    off_policy: OffPolicy = "decoupled",
    *,
    max_importance_ratio: float = 5.0,
    tis_cap: float = 2.0,
    mask_low: float = 0.5,
    mask_high: float = 2.0,
    segments: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """(weights, truncated, masked), all [B, T], for log_ratio = log pi_old - log pi_behaviour; no gradient.

    rho_t = pi_old_t / pi_behaviour_t per token; a sequence's rho = prod_t rho_t over its valid tokens, the same
    weight on each of its tokens (exp of a clamped log-sum, so it cannot overflow):
      decoupled     w_t = min(rho_t, max_importance_ratio)                 [1]
      tis_token     w_t = min(rho_t, tis_cap)                              [2] truncated IS
      tis_sequence  w   = min(rho, tis_cap)                                [3]
      mis_token     w_t = rho_t if mask_low <= rho_t <= mask_high else 0   [3] masked IS
      mis_sequence  w   = rho   if mask_low <= rho   <= mask_high else 0   [3]
      icepop        w_t = rho_t if mask_low <= rho_t <= mask_high else 0   [4]
    A weight of 0 takes the token out of the gradient; it still counts in the loss normaliser.
    [1] AReaL arXiv:2505.24298 §5.2 (decoupled PPO, Hilton et al. arXiv:2110.00641), truncated;
    [2] Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL training";
    [3] Liu et al. 2025, "When speed kills stability: demystifying RL collapse from the training-inference
    mismatch"; [4] Ling Team 2025, Ring-1T, arXiv:2510.18855 (IcePop: M(k) = k inside [alpha, beta], else 0).
    """
    valid = mask.bool()
    log_w = torch.where(valid, log_ratio, torch.zeros_like(log_ratio)).detach()
    if off_policy == "decoupled":  # kept exactly as before the named options existed
        raw_w = torch.exp(log_w)
        truncated = (raw_w > max_importance_ratio) & valid
        return raw_w.clamp(max=max_importance_ratio), truncated, torch.zeros_like(valid)
    if off_policy in ("tis_sequence", "mis_sequence"):
        if segments is None:
            log_w = log_w.sum(dim=-1, keepdim=True).expand_as(log_w)
        else:
            log_w = sequence_sums(log_w, segments)[segments]
    if off_policy in ("tis_token", "tis_sequence"):
        log_cap = math.log(tis_cap)
        truncated = (log_w > log_cap) & valid
        return torch.exp(log_w.clamp(max=log_cap)), truncated, torch.zeros_like(valid)
    if off_policy in ("mis_token", "mis_sequence", "icepop"):
        low = math.log(mask_low) if mask_low > 0 else -math.inf
        high = math.log(mask_high)
        inside = (log_w >= low) & (log_w <= high)
        w = torch.where(inside, torch.exp(log_w.clamp(min=low, max=high)), torch.zeros_like(log_w))
        return w, torch.zeros_like(valid), ~inside & valid
    raise ValueError(f"off_policy must be one of {', '.join(OFF_POLICY)}; got {off_policy!r}")


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
    off_policy: OffPolicy = "decoupled",
    tis_cap: float = 2.0,
    mask_low: float = 0.5,
    mask_high: float = 2.0,
    segments: Tensor | None = None,
    max_tokens: int | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Decoupled PPO-clip loss; advantages are [B] (one per row) or [B, T]; `segments` for packed rows; `max_tokens`
    for loss_agg seq-mean-token-sum-norm (stages/loss_agg.py).

    r = pi / pi_old (pi_old: the trainer's weights at the start of the step, the proximal policy), clipped to
    [1 - clip_low, 1 + clip_high]; w = the off-policy weight of pi_old / pi_behaviour (the weights that sampled
    the tokens), from `importance_weights`, detached. Per token: -w * min(r * A, clip(r) * A). With
    old == behaviour, w = 1 (unless the mask band excludes 1): plain PPO.
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

    w, truncated, masked = importance_weights(
        old_logprobs - behaviour_logprobs, mask, off_policy,
        max_importance_ratio=max_importance_ratio, tis_cap=tis_cap, mask_low=mask_low, mask_high=mask_high,
        segments=segments,
    )  # fmt: skip

    loss = aggregate(-w * surrogate, mask, loss_agg, normalizer, segments, max_tokens)

    with torch.no_grad():
        clipped = ((advantages > 0) & (ratio > 1.0 + clip_high)) | ((advantages < 0) & (ratio < 1.0 - clip_low))
    return loss, step_stats(ratio, clipped, mask, old_logprobs, behaviour_logprobs, w, truncated, masked)


def step_stats(
    ratio: Tensor, clipped: Tensor, mask: Tensor, old_logprobs: Tensor, behaviour_logprobs: Tensor,
    w: Tensor, truncated: Tensor, masked: Tensor,
) -> dict[str, float]:
    """A policy loss's metrics over the valid tokens: how much was clipped, the ratio pi/pi_old, and the off-policy
    weights before and after their correction (`importance_weights`' outputs)."""
    valid = mask.bool()
    with torch.no_grad():
        n = valid.sum().clamp(min=1)
        raw_w = torch.exp(torch.where(valid, old_logprobs - behaviour_logprobs, torch.zeros_like(old_logprobs)))
        return {
            "clip_frac": float((clipped & valid).sum() / n),
            "ratio_mean": float(ratio[valid].sum() / n),
            # per-token rho = pi_old / pi_behaviour before any correction: how off-policy the batch is
            "importance_weight_mean": float(raw_w[valid].sum() / n),
            "importance_weight_max": float(raw_w[valid].max()) if valid.any() else 1.0,
            # what the correction did: the weight it applied, the tokens it truncated, the tokens it masked out
            "importance_weight_used_mean": float(w[valid].sum() / n),
            "importance_truncated_frac": float(truncated.sum() / n),
            "importance_masked_frac": float(masked.sum() / n),
        }
