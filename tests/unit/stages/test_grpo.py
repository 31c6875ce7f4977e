"""GRPO loss math (stages/grpo.py): advantages, decoupled PPO-clip, aggregation, log-probs, KL, entropy."""

import math

import pytest
import torch

from rlflow.stages import grpo

CLIP = dict(clip_low=0.2, clip_high=0.28, max_importance_ratio=5.0)


def loss_at(ratios, advantage, loss_agg="token", behaviour_gap=0.0):
    """policy_loss on one sequence whose tokens have the given ratios pi/pi_old; returns (loss, grad, stats)."""
    old = torch.zeros(1, len(ratios))
    logprobs = torch.log(torch.tensor([ratios], dtype=torch.float64)).float().requires_grad_(True)
    behaviour = (old - behaviour_gap).requires_grad_(True)  # a leaf, to check no gradient reaches it
    mask = torch.ones(1, len(ratios))
    loss, stats = grpo.policy_loss(logprobs, old, behaviour, torch.tensor([advantage]), mask, loss_agg=loss_agg, **CLIP)
    loss.backward()
    assert behaviour.grad is None  # the importance weight is a constant of the objective
    return loss.item(), logprobs.grad[0], stats


def test_advantages_are_zero_mean_per_group_and_unit_std():
    rewards = torch.tensor([[0.0, 1.0, 1.0, 0.0], [0.2, 0.4, 0.9, 0.5]])
    adv = grpo.group_advantages(rewards)
    torch.testing.assert_close(adv.mean(dim=1), torch.zeros(2), atol=1e-6, rtol=0)
    torch.testing.assert_close(adv.std(dim=1, correction=0), torch.ones(2), atol=1e-4, rtol=0)
    torch.testing.assert_close(adv[0], torch.tensor([-1.0, 1.0, 1.0, -1.0]), atol=1e-5, rtol=0)
    raw = grpo.group_advantages(rewards, normalize_std=False)
    torch.testing.assert_close(raw[1], rewards[1] - 0.5, atol=1e-6, rtol=0)


def test_uniform_groups_and_groups_of_one_get_zero_advantage():
    adv = grpo.group_advantages(torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [0.3, 0.3, 0.3]]))
    assert torch.equal(adv, torch.zeros(3, 3))
    single = grpo.group_advantages(torch.tensor([[0.7], [0.1]]))
    assert torch.equal(single, torch.zeros(2, 1))  # population std: no NaN for a group of one


def test_positive_advantage_is_clipped_at_one_plus_clip_high():
    # 1.25 lies inside [0.8, 1.28]: symmetric PPO (eps 0.2) would clip it, clip-higher does not
    loss, grad, stats = loss_at([1.25, 1.5], advantage=1.0)
    assert loss == pytest.approx(-(1.25 + 1.28) / 2, abs=1e-6)
    assert grad[0] != 0 and grad[1] == 0  # the clipped token gets no gradient
    assert stats["clip_frac"] == pytest.approx(0.5)


def test_negative_advantage_is_clipped_at_one_minus_clip_low():
    loss, grad, stats = loss_at([0.75, 0.9, 1.5], advantage=-1.0)
    # 0.75 -> clipped to 0.8; 0.9 inside; 1.5 is above the range but with A < 0 min() keeps the unclipped term
    assert loss == pytest.approx((0.8 + 0.9 + 1.5) / 3, abs=1e-6)
    assert grad[0] == 0 and grad[1] != 0 and grad[2] != 0
    assert stats["clip_frac"] == pytest.approx(1 / 3)


def test_token_and_sequence_aggregation_on_a_hand_made_batch():
    # with ratio 1 and weight 1 the per-token loss is -A: sequence 0 has one token of loss 3, sequence 1 three of loss 1
    mask = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    zeros = torch.zeros(2, 3)
    adv = torch.tensor([-3.0, -1.0])
    token, _ = grpo.policy_loss(zeros, zeros, zeros, adv, mask, loss_agg="token", **CLIP)
    sequence, _ = grpo.policy_loss(zeros, zeros, zeros, adv, mask, loss_agg="sequence", **CLIP)
    assert token.item() == pytest.approx((3 + 1 + 1 + 1) / 4)  # every token weighs the same
    assert sequence.item() == pytest.approx((3 / 1 + 3 / 3) / 2)  # every sequence weighs the same


@pytest.mark.parametrize("loss_agg, normalizer", [("token", 4.0), ("sequence", 2.0)])
def test_micro_batches_with_a_batch_normalizer_sum_to_the_full_batch_loss(loss_agg, normalizer):
    torch.manual_seed(0)
    logprobs, old, behaviour = (-torch.rand(2, 3) for _ in range(3))
    mask = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    adv = torch.tensor([0.7, -1.3])
    full, _ = grpo.policy_loss(logprobs, old, behaviour, adv, mask, loss_agg=loss_agg, **CLIP)
    parts = [
        grpo.policy_loss(logprobs[i : i + 1], old[i : i + 1], behaviour[i : i + 1], adv[i : i + 1], mask[i : i + 1],
                         loss_agg=loss_agg, normalizer=normalizer, **CLIP)[0]
        for i in range(2)
    ]  # fmt: skip
    assert (parts[0] + parts[1]).item() == pytest.approx(full.item(), abs=1e-6)


def test_importance_weight_is_truncated_and_detached():
    # pi_old / pi_behaviour = 10 (the sampler's weights were far behind) -> truncated to 5
    loss, grad, stats = loss_at([1.0, 1.0], advantage=1.0, behaviour_gap=math.log(10.0))
    assert loss == pytest.approx(-5.0, rel=1e-5)
    torch.testing.assert_close(grad, torch.full((2,), -5.0 / 2))  # d/dlogp of -w * exp(logp - old) * A / n
    assert stats["importance_weight_max"] == pytest.approx(10.0, rel=1e-5)
    assert stats["importance_truncated_frac"] == 1.0
    # below the cap the weight is used as is
    loss, _, stats = loss_at([1.0], advantage=1.0, behaviour_gap=math.log(2.0))
    assert loss == pytest.approx(-2.0, rel=1e-5)
    assert stats["importance_truncated_frac"] == 0.0


def test_on_policy_reduces_to_plain_ppo():
    torch.manual_seed(1)
    old = -torch.rand(3, 5) - 0.5
    logprobs = (old + 0.4 * torch.randn(3, 5)).requires_grad_(True)
    adv = torch.tensor([1.0, -0.5, 2.0])
    mask = torch.ones(3, 5)
    loss, stats = grpo.policy_loss(logprobs, old, old, adv, mask, loss_agg="token", **CLIP)
    loss.backward()

    ref_logprobs = logprobs.detach().clone().requires_grad_(True)
    r = torch.exp(ref_logprobs - old)
    a = adv[:, None]
    ppo = -torch.min(r * a, torch.clamp(r, 0.8, 1.28) * a).mean()
    ppo.backward()
    assert loss.item() == pytest.approx(ppo.item(), abs=1e-6)
    torch.testing.assert_close(logprobs.grad, ref_logprobs.grad)
    assert stats["importance_weight_mean"] == 1.0 and stats["importance_weight_max"] == 1.0
    assert 0 < stats["clip_frac"] < 1  # the example exercises both branches


def test_garbage_in_padding_does_not_leak_into_loss_or_gradients():
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    logprobs = torch.tensor([[-1.0, -2.0, 500.0]], requires_grad=True)
    old = torch.tensor([[-1.0, -2.0, -500.0]])
    behaviour = torch.tensor([[-1.0, -2.0, -900.0]])
    loss, _ = grpo.policy_loss(logprobs, old, behaviour, torch.tensor([1.0]), mask, loss_agg="token", **CLIP)
    kl = grpo.kl_penalty(logprobs, old, mask)
    (loss + kl).backward()
    assert loss.item() == pytest.approx(-1.0)
    assert torch.isfinite(logprobs.grad).all() and logprobs.grad[0, 2] == 0


def test_token_logprobs_is_log_softmax_at_the_temperature():
    torch.manual_seed(2)
    logits = torch.randn(2, 4, 11) * 3
    tokens = torch.randint(0, 11, (2, 4))
    got = grpo.token_logprobs(logits, tokens, temperature=0.7)
    for b in range(2):
        for t in range(4):
            scaled = [x / 0.7 for x in logits[b, t].tolist()]
            top = max(scaled)
            manual = scaled[tokens[b, t]] - top - math.log(sum(math.exp(x - top) for x in scaled))
            assert got[b, t].item() == pytest.approx(manual, abs=1e-5)
    assert not torch.allclose(got, grpo.token_logprobs(logits, tokens, temperature=1.0))


def test_kl_penalty_is_the_k3_estimator():
    mask = torch.ones(1, 2)
    same = torch.tensor([[-1.0, -2.0]])
    assert grpo.kl_penalty(same, same, mask).item() == 0.0
    logprobs, ref = torch.tensor([[-1.0, -1.0]]), torch.tensor([[-1.5, -0.5]])
    expected = sum(math.exp(d) - d - 1 for d in (-0.5, 0.5)) / 2
    assert grpo.kl_penalty(logprobs, ref, mask).item() == pytest.approx(expected, rel=1e-6)


def test_entropy_from_logits():
    assert grpo.entropy_from_logits(torch.zeros(7)).item() == pytest.approx(math.log(7), rel=1e-6)
    assert grpo.entropy_from_logits(torch.tensor([100.0, 0.0, 0.0])).item() == pytest.approx(0.0, abs=1e-6)
    logits = torch.randn(3, 9)
    expected = torch.distributions.Categorical(logits=logits).entropy()
    torch.testing.assert_close(grpo.entropy_from_logits(logits), expected)


def test_unknown_aggregation_is_rejected():
    with pytest.raises(ValueError, match="loss_agg"):
        grpo.aggregate(torch.ones(1, 2), torch.ones(1, 2), "batch")
