"""Loss aggregation: [B, T] per-token loss terms -> one scalar, the way each algorithm averages them.

Modes (names as verl's `loss_agg_mode`); `x` is the per-token term, `n_i` sequence i's valid tokens, `N` the batch's
valid tokens, `S` its non-empty sequences, `L` a constant token budget:
  token-mean               sum_i sum_t x / N                     DAPO token-level loss (arXiv:2503.14476 §3.3, eq. 12)
  seq-mean-token-mean      sum_i (sum_t x / n_i) / S             GRPO as published (DeepSeekMath arXiv:2402.03300 eq. 3)
  seq-mean-token-sum       sum_i sum_t x / S                     Dr.GRPO without the 1/|o_i| (arXiv:2503.20783 §3.2)
  seq-mean-token-sum-norm  sum_i sum_t x / (S * L)               Dr.GRPO as its code runs it: the per-sequence sum
                                                                 over a constant generation budget L, MAX_TOKENS
"token" and "sequence" are the older spellings of token-mean and seq-mean-token-mean, kept as aliases.
A row is one sequence, or several packed end to end (stages/packing.py): then `segments` [B, T] numbers the sequence
each position belongs to.
"""

from __future__ import annotations

from typing import Literal, get_args

from torch import Tensor

LossAgg = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "token", "sequence"]
LOSS_AGG: tuple[str, ...] = get_args(LossAgg)
#: the older spellings and the mode each names
ALIASES = {"token": "token-mean", "sequence": "seq-mean-token-mean"}
#: modes whose value does not shrink with a sequence's length (Dr.GRPO's requirement)
LENGTH_NORMALISED = ("token-mean", "seq-mean-token-mean", "token", "sequence")


def canonical(loss_agg: str) -> str:
    """The mode's name without alias; ValueError for an unknown one."""
    if loss_agg not in LOSS_AGG:
        raise ValueError(f"loss_agg must be one of {', '.join(LOSS_AGG)}; got {loss_agg!r}")
    return ALIASES.get(loss_agg, loss_agg)


def normalizer_of(loss_agg: str, num_tokens: float, num_sequences: float) -> float:
    """The batch-wide count `aggregate`'s `normalizer` takes for this mode: tokens for token-mean, else sequences."""
    return num_tokens if canonical(loss_agg) == "token-mean" else num_sequences


def sequence_sums(values: Tensor, segments: Tensor | None) -> Tensor:
    """Per-sequence sums of [B, T] values: [B] (one sequence per row) or, with `segments`, one entry per sequence
    id (ids above the largest hold 0: the vector is sized by numel so that no device sync reads the count)."""
    if segments is None:
        return values.sum(dim=-1)
    return values.new_zeros(values.numel()).index_add_(0, segments.reshape(-1), values.reshape(-1))


def aggregate(
    per_token: Tensor,
    mask: Tensor,
    loss_agg: LossAgg,
    normalizer: float | None = None,
    segments: Tensor | None = None,
    max_tokens: int | None = None,
) -> Tensor:
    """Reduce [B, T] per-token values to a scalar by `loss_agg` (module docstring).

    `normalizer` replaces the count in the denominator (valid tokens for token-mean, non-empty sequences for the
    seq-* modes) with a batch-wide one, so micro-batch results sum to the full-batch value. `max_tokens`: L of
    seq-mean-token-sum-norm. `segments`: the sequence of each position when rows are packed.
    """
    mode = canonical(loss_agg)
    mask = mask.to(per_token.dtype)
    masked = per_token * mask
    if mode == "token-mean":
        denom = mask.sum() if normalizer is None else normalizer
        return masked.sum() / max(float(denom), 1.0)
    lengths = sequence_sums(mask, segments)
    denom = max(float((lengths > 0).sum() if normalizer is None else normalizer), 1.0)
    if mode == "seq-mean-token-mean":
        per_seq = sequence_sums(masked, segments) / lengths.clamp(min=1.0)
        return per_seq.sum() / denom
    if mode == "seq-mean-token-sum":
        return masked.sum() / denom
    if max_tokens is None or max_tokens < 1:
        raise ValueError(f"loss_agg seq-mean-token-sum-norm needs max_tokens >= 1 (the constant L), got {max_tokens}")
    return masked.sum() / (denom * max_tokens)
