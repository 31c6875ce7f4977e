"""One training batch over N data-parallel ranks: split by tokens, and the ranks' metrics merged back.

Rank 0 sees the whole batch, so everything that depends on the whole batch is computed there, once:
the advantages (within each group for GRPO, stages/advantages.py) and the loss normaliser (the batch's completion tokens, or
sequences). Each rank then gets a shard and sums its part of the loss over that global normaliser, so
N ranks compute the same loss as one rank on the whole batch. DeepSpeed averages gradients over the
data-parallel ranks, so each rank scales its loss by N (trainer.py) and the averaged gradient is the
whole batch's gradient.

Shards are balanced by tokens, not by count: a rank's step time follows its tokens, and long-tailed
lengths make count-balanced shards skewed. Every rank must also run the same number of forward and
backward passes (ZeRO-2/3 reduce and gather inside them), so each shard is cut into the same number
of micro-batches; a rank with too few rows runs masked padding rows (zero loss, zero gradient).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from rlflow.stages import grpo
from rlflow.stages.reward_shaping import overlong_penalty
from rlflow.stages.trajectory import Trajectory


@dataclass
class BatchShard:
    """One rank's part of a batch, with the whole batch's loss normalisers."""

    trajectories: list[Trajectory]
    advantages: list[float]  # one per trajectory, computed within its group over the whole batch
    num_tokens: float  # completion tokens in the whole batch
    num_sequences: float  # non-empty completions in the whole batch
    micro_batches: int  # every rank runs exactly this many
    world_size: int
    pad: Trajectory  # a row to mask out when this shard has fewer rows than micro_batches
    reward_mean: float  # over the whole batch


def cost(t: Trajectory) -> int:
    """A row's share of the step time: the tokens its forward and backward passes run over."""
    return len(t.prompt_ids) + len(t.completion_ids)


def balance(costs: list[int], world_size: int) -> list[list[int]]:
    """Indices split into `world_size` parts of near-equal total cost (greedy longest-first).

    Ties go to the part with fewer rows, then the lower rank, so the split is deterministic.
    """
    parts: list[list[int]] = [[] for _ in range(world_size)]
    totals = [0] * world_size
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        r = min(range(world_size), key=lambda r: (totals[r], len(parts[r]), r))
        parts[r].append(i)
        totals[r] += costs[i]
    return [sorted(p) for p in parts]


def parts_for_tokens(costs: list[int], max_tokens: int) -> int:
    """The fewest parts `balance` cuts `costs` into with none above max_tokens (a longer row alone is allowed)."""
    cap = max([max_tokens, *costs])
    count = max(1, math.ceil(sum(costs) / max_tokens))
    while count < len(costs) and max(sum(costs[i] for i in p) for p in balance(costs, count)) > cap:
        count += 1
    return count


def shard_batch(
    trajectories: list[Trajectory], world_size: int, micro_batch_size: int, max_tokens: int | None = None, *,
    rows_too: bool = False,
    advantages: Callable[[torch.Tensor, list], torch.Tensor] = grpo.batch_advantages, overlong: dict | None = None,
    mini_batches: int = 1,
) -> list[BatchShard]:
    """The batch as `world_size` shards (rank order), balanced by tokens, with equal micro-batch counts.

    Micro-batches of at most micro_batch_size rows, or (packed micro-batches) of at most max_tokens prompt +
    completion tokens when it is given (and of at most micro_batch_size rows too with `rows_too`): then the rank
    that needs the most parts sets the count for all.
    advantages: the sequence-level estimator (stages/advantages.py; GRPO's by default); overlong: the keyword
    arguments of reward_shaping.overlong_penalty, added to the rewards before the advantages (None: no shaping).
    mini_batches: the micro-batch count is made a multiple of it, so each rank's micro-batches cut into that many
    equal parts, one optimizer step each (train.mini_batches)."""
    if not trajectories:
        raise ValueError("a training batch needs at least one trajectory")
    rewards = torch.tensor([t.reward for t in trajectories], dtype=torch.float32)
    shaped = rewards
    if overlong is not None:
        lengths = torch.tensor([len(t.completion_ids) for t in trajectories])
        shaped = rewards + overlong_penalty(lengths, **overlong)
    adv = advantages(shaped, [t.group_id for t in trajectories])  # over the whole batch, once
    num_tokens = float(sum(sum(t.trained_mask()) for t in trajectories))  # the tokens the loss averages over
    num_sequences = float(sum(1 for t in trajectories if t.completion_ids))
    costs = [cost(t) for t in trajectories]
    parts = balance(costs, world_size)
    by_rows = max(1, max(math.ceil(len(p) / micro_batch_size) for p in parts))
    if max_tokens is None:
        micro = by_rows
    else:
        micro = max(parts_for_tokens([costs[i] for i in p], max_tokens) for p in parts if p)
        micro = max(micro, by_rows) if rows_too else micro
    micro = math.ceil(micro / mini_batches) * mini_batches
    return [BatchShard(trajectories=[trajectories[i] for i in p], advantages=[float(adv[i]) for i in p],
                       num_tokens=num_tokens, num_sequences=num_sequences, micro_batches=micro,
                       world_size=world_size, pad=trajectories[0], reward_mean=float(rewards.mean()))
            for p in parts]


#: metrics that add up over ranks (each rank's value is its part of a whole-batch sum or mean)
SUMMED = ("loss", "pg_loss", "kl", "entropy", "clip_frac", "ratio_mean", "ratio_mean_first", "ratio_mean_last",
          "importance_weight_mean",
          "importance_weight_used_mean", "importance_truncated_frac", "importance_masked_frac", "tokens",
          "critic_loss", "value_mean", "value_clip_frac", "distill_reverse_kl")  # the last three: algo ppo's critic (stages/critic.py)


def merge_rank_metrics(per_rank: list[dict]) -> dict:
    """One step's metrics from every rank's: sums add, maxima take the max, the rest are rank 0's
    (grad_norm is global after the all-reduce; reward_mean and version are the same on every rank)."""
    merged = dict(per_rank[0])
    for key in SUMMED:
        if key in merged:
            merged[key] = sum(m[key] for m in per_rank)
    merged["importance_weight_max"] = max(m["importance_weight_max"] for m in per_rank)
    merged["step_time_s"] = max(m["step_time_s"] for m in per_rank)
    tokens = [m["tokens"] for m in per_rank]
    merged["rank_token_imbalance"] = max(tokens) / (sum(tokens) / len(tokens)) if sum(tokens) else 1.0
    return merged
