"""Advantage estimators: rewards in, advantages out; pure tensor functions.

Two shapes of estimator, run at two places:
  sequence-level  ([B] rewards, group ids) -> [B] advantages, one per trajectory, over the whole batch on rank 0
                  before it is sharded (stages/batch_shards.py): `ESTIMATORS` (grpo, dr_grpo, rloo).
  token-level     [B, T] per-token returns -> [B, T] advantages, in the trainer after its forward passes, because
                  they need per-token quantities of the batch: REINFORCE++ (`token_returns` with the KL folded into
                  the per-token reward, then `whiten` over every token of the batch); PPO (`gae` on the per-token
                  rewards of `last_token_rewards` plus the KL, with the critic's [B, T] values: stages/critic.py).
Rewards of one group share a prompt; groups may be short of a failed member (each is normalised on its own).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from rlflow.stages.grpo import batch_advantages, group_advantages
from rlflow.stages.loss_agg import sequence_sums


def grpo(rewards: Tensor, group_ids: Sequence) -> Tensor:
    """GRPO: A_i = (r_i - mean(r)) / std(r) within the group (DeepSeekMath, arXiv:2402.03300 §4.1.2, the outcome
    supervision formula; std with correction 0, plus 1e-6)."""
    return batch_advantages(rewards, group_ids)


def dr_grpo(rewards: Tensor, group_ids: Sequence) -> Tensor:
    """Dr.GRPO: A_i = r_i - mean(r) within the group, no division by the std ("Understanding R1-Zero-Like Training:
    A Critical Perspective", arXiv:2503.20783 §3.2, eq. 3 without the std term): the std weights groups of nearly
    uniform reward (too easy, too hard) up."""
    return batch_advantages(rewards, group_ids, lambda r: group_advantages(r, normalize_std=False))


def leave_one_out(rewards: Tensor) -> Tensor:
    """[1, k] rewards -> [1, k]: r_i - (sum_{j != i} r_j) / (k - 1); a group of one gets 0."""
    k = rewards.shape[-1]
    if k < 2:
        return torch.zeros_like(rewards)
    return rewards - (rewards.sum(dim=-1, keepdim=True) - rewards) / (k - 1)


def rloo(rewards: Tensor, group_ids: Sequence) -> Tensor:
    """RLOO: A_i = r_i - 1/(k-1) sum_{j != i} r_j, the mean of the group's other samples as the baseline
    (Ahmadian et al., "Back to Basics: Revisiting REINFORCE Style Optimization for Learning from Human Feedback in
    LLMs", arXiv:2402.14740 §3.2, eq. 7; Kool et al. 2019)."""
    return batch_advantages(rewards, group_ids, leave_one_out)


def reinforce_pp(rewards: Tensor, group_ids: Sequence) -> Tensor:
    """REINFORCE++'s sequence-level part: the raw reward r_i, no group baseline (arXiv:2501.03262 §3); the
    trainer turns it into per-token returns (`token_returns`) and whitens them over the batch (`whiten`)."""
    return rewards.clone().float()


#: sequence-level estimators by algorithm (the trainer's `algo`)
ESTIMATORS = {"grpo": grpo, "dr_grpo": dr_grpo, "rloo": rloo, "reinforce_pp": reinforce_pp, "gspo": grpo, "cispo": grpo,
              "ppo": reinforce_pp}  # ppo: the raw reward, which the critic's GAE turns into advantages
#: algorithms whose advantages are finished per token in the trainer (`token_returns`, `whiten`)
TOKEN_LEVEL = ("reinforce_pp",)


def token_returns(
    rewards: Tensor, token_rewards: Tensor | None, mask: Tensor, segments: Tensor | None = None
) -> Tensor:
    """[B, T] returns G_t = r_i + sum_{s >= t, s in sequence i} token_rewards_s (gamma = 1), 0 off the mask.

    rewards: [B] one per row, or [B, T] with each sequence's reward on its positions (packed rows); token_rewards:
    [B, T] per-token rewards such as -kl_coef * KL_t (REINFORCE++, Hu et al., arXiv:2501.03262 §3: A_t = r - beta * sum_{i >= t} KL(i),
    the outcome reward at the last token, the KL penalty at every token), or None. `segments` for packed rows.
    """
    mask = mask.to(torch.float32)
    base = rewards.to(torch.float32)
    if base.dim() == 1:
        base = base.unsqueeze(-1).expand_as(mask)
    if token_rewards is None:
        return base * mask
    per_token = token_rewards.to(torch.float32) * mask
    suffix = per_token.flip(-1).cumsum(-1).flip(-1)  # sum from t to the row's end
    if segments is not None:  # a packed row: take off the sums of the sequences after t's own
        seq = sequence_sums(per_token, segments)
        later = seq.flip(0).cumsum(0).flip(0) - seq  # sum over the sequences numbered after each
        suffix = suffix - later[segments]
    return (base + suffix) * mask


def moments(values: Tensor, mask: Tensor) -> Tensor:
    """[3] (sum, sum of squares, count) of the valid values: add these over micro-batches and ranks, then `whiten`."""
    mask = mask.to(torch.float32)
    v = values.to(torch.float32) * mask
    return torch.stack([v.sum(), (v * v).sum(), mask.sum()])


def whiten(values: Tensor, mask: Tensor, totals: Tensor, eps: float = 1e-8) -> Tensor:
    """(values - mean) / (std + eps) over every valid token of the batch, from `moments` summed over the batch
    (REINFORCE++ arXiv:2501.03262 §3: "global advantage normalisation"); 0 off the mask."""
    count = totals[2].clamp(min=1.0)
    mean = totals[0] / count
    var = (totals[1] / count - mean * mean).clamp(min=0.0)
    return (values.to(torch.float32) - mean) / (var.sqrt() + eps) * mask.to(torch.float32)


def last_token_rewards(rewards: Tensor, mask: Tensor, segments: Tensor | None = None) -> Tensor:
    """[B, T] token-level rewards: each sequence's reward on its last trained token, 0 elsewhere (the outcome reward
    of an episode that ends there). rewards: [B] one per row, or [B, T] each sequence's on its positions (packed)."""
    mask = mask.to(torch.float32)
    base = rewards.to(torch.float32)
    if base.dim() == 1:
        base = base.unsqueeze(-1).expand_as(mask)
    seg = segments if segments is not None else torch.zeros_like(mask, dtype=torch.long)
    position = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
    trained_at = torch.where(mask > 0, position, torch.full_like(position, -1))
    last = torch.full((mask.shape[0], int(seg.max()) + 1), -1, dtype=torch.long, device=mask.device)
    last = last.scatter_reduce(1, seg, trained_at, reduce="amax")  # each sequence's last trained position
    return base * ((position == last.gather(1, seg)) & (mask > 0))


def gae(token_rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float,
        segments: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Generalized advantage estimation (Schulman et al., "High-Dimensional Continuous Control Using Generalized
    Advantage Estimation", arXiv:1506.02438 eq. 16): A_t = sum_l (gamma lam)^l delta_{t+l}, with the TD error
    delta_t = r_t + gamma V_{t+1} - V_t, computed backwards as A_t = delta_t + gamma lam A_{t+1}.

    [B, T] in, ([B, T] advantages, [B, T] returns A_t + V_t) out, 0 off the mask. The steps are a sequence's trained
    tokens (mask 1) in order: masked positions between them (an environment's turn) are skipped, and after a
    sequence's last one V = 0 (the episode ends). `segments` [B, T] for packed rows: GAE restarts per sequence."""
    mask = mask.to(torch.float32)
    rewards, values = token_rewards.to(torch.float32) * mask, values.to(torch.float32) * mask
    advantages = torch.zeros_like(values)
    next_value = torch.zeros_like(values[:, 0])  # V of the next trained token of the same sequence
    next_advantage = torch.zeros_like(values[:, 0])
    for t in reversed(range(values.shape[-1])):
        if segments is not None and t + 1 < values.shape[-1]:  # a new sequence starts after t: nothing carries over
            same = (segments[:, t] == segments[:, t + 1]).to(torch.float32)
            next_value, next_advantage = next_value * same, next_advantage * same
        m = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        here = delta + gamma * lam * next_advantage
        advantages[:, t] = here * m
        next_value = torch.where(m > 0, values[:, t], next_value)
        next_advantage = torch.where(m > 0, here, next_advantage)
    return advantages, (advantages + values) * mask
