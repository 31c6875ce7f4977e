"""DAPO's soft overlong punishment (stages/reward_shaping.py, DAPO eq. 13) by hand: L_max 20, L_cache 4."""

import pytest
import torch

from rlflow.stages.reward_shaping import overlong_penalty


def test_overlong_penalty_by_hand():
    lengths = torch.tensor([10, 16, 18, 20, 25])
    # |y| <= 16: 0; 16 < |y| <= 20: (16 - |y|) / 4; |y| > 20: -1
    assert overlong_penalty(lengths, max_tokens=20, cache_tokens=4).tolist() == [0.0, 0.0, -0.5, -1.0, -1.0]
    assert overlong_penalty(lengths, 20, 4, penalty_factor=0.5).tolist() == [0.0, 0.0, -0.25, -0.5, -0.5]


def test_a_cache_as_long_as_the_budget_is_rejected():
    with pytest.raises(ValueError, match="cache_tokens < max_tokens"):
        overlong_penalty(torch.tensor([3]), max_tokens=4, cache_tokens=4)
