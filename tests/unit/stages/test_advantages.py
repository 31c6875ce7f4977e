"""Advantage estimators (stages/advantages.py) against hand-computed values from each paper's formula."""

import math

import pytest
import torch

from rlflow.stages import advantages

REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 2.0, 3.0, 0.7])
GROUPS = ["a", "a", "a", "a", "b", "b", "b", "c"]  # c: a group of one (its other members' rewards failed)


def test_grpo_divides_by_the_group_std():
    # group a: mean 0.5, population std 0.5 -> +-1; group b: mean 2, std sqrt(2/3); a group of one gets 0
    adv = advantages.grpo(REWARDS, GROUPS)
    up, b = 0.5 / (0.5 + 1e-6), 1 / (math.sqrt(2 / 3) + 1e-6)
    torch.testing.assert_close(adv, torch.tensor([up, -up, -up, up, -b, 0.0, b, 0.0]))


def test_grpo_advantages_are_the_ones_before_the_family_existed():
    # stages/grpo.py batch_advantages at db8ff11 on these rewards, as exact float hex
    adv = advantages.grpo(torch.tensor([1.0, 0.0, 0.5, 1.0, 0.25, 0.0, 0.0]), ["a", "a", "a", "b", "b", "c", "c"])
    assert [a.hex() for a in adv.tolist()] == ["0x1.3988ae0000000p+0", "-0x1.3988ae0000000p+0", "0x0.0p+0",
                                               "0x1.ffffa60000000p-1", "-0x1.ffffa60000000p-1", "0x0.0p+0", "0x0.0p+0"]


def test_dr_grpo_only_subtracts_the_group_mean():
    # Dr.GRPO: r - mean(r), no std: group a 0.5, b 2
    adv = advantages.dr_grpo(REWARDS, GROUPS)
    torch.testing.assert_close(adv, torch.tensor([0.5, -0.5, -0.5, 0.5, -1.0, 0.0, 1.0, 0.0]))


def test_rloo_baseline_is_the_mean_of_the_other_members():
    # RLOO: r_i - sum_{j != i} r_j / (k - 1). a: 1 - (0+0+1)/3 = 2/3, 0 - 2/3; b: 1 - (2+3)/2, 2 - (1+3)/2, 3 - (1+2)/2
    adv = advantages.rloo(REWARDS, GROUPS)
    torch.testing.assert_close(adv, torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3, -1.5, 0.0, 1.5, 0.0]))


def test_reinforce_pp_returns_fold_the_per_token_rewards_in():
    # G_t = r + sum_{s >= t} token_rewards_s within the sequence; padding is 0
    token_rewards = torch.tensor([[-0.1, -0.2, -0.3], [-0.5, 0.0, 7.0]])  # 7.0 sits on padding
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    returns = advantages.token_returns(torch.tensor([1.0, 0.0]), token_rewards, mask)
    torch.testing.assert_close(returns, torch.tensor([[1 - 0.6, 1 - 0.5, 1 - 0.3], [-0.5, 0.0, 0.0]]))
    # without per-token rewards each token carries its sequence's reward
    torch.testing.assert_close(advantages.token_returns(torch.tensor([1.0, 0.0]), None, mask),
                               torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]))


def test_packed_returns_stop_at_their_sequence():
    # the two sequences above packed into one row; positions 0 and 4 are the next prompt's (masked, junk rewards)
    rewards = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0]])
    token_rewards = torch.tensor([[9.0, -0.1, -0.2, -0.3, 9.0, -0.5, 0.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0, 0.0, 1.0, 1.0]])
    segments = torch.tensor([[0, 0, 0, 0, 1, 1, 1]])
    returns = advantages.token_returns(rewards, token_rewards, mask, segments)
    torch.testing.assert_close(returns, torch.tensor([[0.0, 0.4, 0.5, 0.7, 0.0, -0.5, 0.0]]))


def test_whitening_uses_every_token_of_the_batch():
    # the returns above, in two micro-batches: their moments add up to the batch's
    first, second = torch.tensor([[0.4, 0.5, 0.7]]), torch.tensor([[-0.5, 0.0, 3.0]])
    m1, m2 = torch.ones(1, 3), torch.tensor([[1.0, 1.0, 0.0]])
    totals = advantages.moments(first, m1) + advantages.moments(second, m2)
    # 5 values: mean 1.1 / 5 = 0.22, population variance 1.15 / 5 - 0.22^2 = 0.1816
    mean, std = 0.22, math.sqrt(0.1816)
    torch.testing.assert_close(advantages.whiten(first, m1, totals), torch.tensor([[(v - mean) / std for v in (0.4, 0.5, 0.7)]]))
    torch.testing.assert_close(advantages.whiten(second, m2, totals), torch.tensor([[(-0.5 - mean) / std, -mean / std, 0.0]]))


def test_every_algorithm_has_an_estimator():
    assert set(advantages.ESTIMATORS) == {"grpo", "dr_grpo", "rloo", "reinforce_pp", "gspo", "cispo", "ppo"}
    assert advantages.reinforce_pp(REWARDS, GROUPS).tolist() == pytest.approx(REWARDS.tolist())
