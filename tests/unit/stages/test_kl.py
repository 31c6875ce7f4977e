"""KL estimators (stages/kl.py) by hand: pi = 0.5, pi_ref = 0.25 at a token, so r = pi_ref / pi = 0.5."""

import math

import pytest
import torch

from rlflow.stages import kl

LOGP, REF = torch.log(torch.tensor([[0.5, 0.9]])), torch.log(torch.tensor([[0.25, 0.1]]))
MASK = torch.tensor([[1.0, 0.0]])  # the second token is padding


@pytest.mark.parametrize("estimator, expected", [
    ("k1", -math.log(0.5)),  # -log r
    ("k2", 0.5 * math.log(0.5) ** 2),  # (log r)^2 / 2
    ("k3", (0.5 - 1) - math.log(0.5)),  # (r - 1) - log r
])
def test_each_estimator_by_hand(estimator, expected):
    per_token = kl.kl_per_token(LOGP, REF, MASK, estimator)
    assert per_token[0, 0].item() == pytest.approx(expected, rel=1e-6)
    assert per_token[0, 1].item() == 0.0
    assert kl.kl_penalty(LOGP, REF, MASK, estimator=estimator).item() == pytest.approx(expected, rel=1e-6)


def test_kl_as_a_reward_is_minus_coef_times_the_estimate_without_gradient():
    logp = LOGP.clone().requires_grad_(True)
    reward = kl.kl_reward(logp, REF, MASK, kl_coef=0.1)
    assert reward[0, 0].item() == pytest.approx(-0.1 * -math.log(0.5), rel=1e-6)  # k1 by default, as REINFORCE++
    assert not reward.requires_grad


def test_unknown_estimator_is_rejected():
    with pytest.raises(ValueError, match="k1, k2, k3"):
        kl.kl_per_token(LOGP, REF, MASK, "k4")
