"""Reward shaping applied to a batch's rewards before its advantages: DAPO's soft overlong punishment."""

from __future__ import annotations

import torch
from torch import Tensor


def overlong_penalty(lengths: Tensor, max_tokens: int, cache_tokens: int, penalty_factor: float = 1.0) -> Tensor:
    """[B] completion lengths -> [B] length rewards to add to the task's (DAPO, arXiv:2503.14476 §3.4, eq. 13):

      0                                    |y| <= L_max - L_cache
      ((L_max - L_cache) - |y|) / L_cache  L_max - L_cache < |y| <= L_max
      -1                                   L_max < |y|

    times penalty_factor; L_max = max_tokens (the generation budget), L_cache = cache_tokens (the soft punishment
    interval before it, 0 < L_cache < L_max). A completion within L_max - L_cache, the expected maximum length, is
    not touched; the penalty grows linearly over the cache, so a truncated answer is not punished as hard as a
    wrong one for merely running long.
    """
    if not 0 < cache_tokens < max_tokens:
        raise ValueError(f"overlong shaping needs 0 < cache_tokens < max_tokens; got {cache_tokens} and {max_tokens}")
    expected = max_tokens - cache_tokens
    over = (lengths.to(torch.float32) - expected).clamp(min=0.0)
    return -penalty_factor * (over / cache_tokens).clamp(max=1.0)
