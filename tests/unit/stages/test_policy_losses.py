"""Policy losses (stages/policy_losses.py) and loss aggregation (stages/loss_agg.py) against hand-computed values,
and GRPO pinned to the loss and gradients it had before the algorithm family existed."""

import math

import pytest
import torch

from rlflow.stages import kl, loss_agg, policy_losses

MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
PER_TOKEN = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 99.0]])  # 99 sits on padding: never counted


@pytest.mark.parametrize("mode, expected", [
    ("token-mean", 15 / 5), ("token", 15 / 5),  # sum over the 5 valid tokens / 5
    ("seq-mean-token-mean", (6 / 3 + 9 / 2) / 2), ("sequence", (6 / 3 + 9 / 2) / 2),  # per-sequence means, averaged
    ("seq-mean-token-sum", 15 / 2),  # per-sequence sums (6, 9), averaged
    ("seq-mean-token-sum-norm", 15 / (2 * 10)),  # ... over the constant L = 10
])
def test_each_aggregation_mode_by_hand(mode, expected):
    assert loss_agg.aggregate(PER_TOKEN, MASK, mode, max_tokens=10).item() == pytest.approx(expected)


def test_batch_normalisers_replace_the_micro_batch_counts():
    # a micro-batch of 2 sequences in a batch of 4 sequences: its share of the batch-wide value
    assert loss_agg.aggregate(PER_TOKEN, MASK, "seq-mean-token-sum", normalizer=4).item() == pytest.approx(15 / 4)
    assert loss_agg.aggregate(PER_TOKEN, MASK, "seq-mean-token-sum-norm", normalizer=4, max_tokens=10).item() == (
        pytest.approx(15 / 40))
    assert loss_agg.normalizer_of("token", 7, 2) == 7 and loss_agg.normalizer_of("seq-mean-token-sum-norm", 7, 2) == 2


def test_packed_rows_aggregate_per_sequence():
    # the two sequences of MASK packed into one row: positions 0-2 are sequence 0, 3-4 sequence 1
    row, mask, segments = torch.tensor([[1.0, 2, 3, 4, 5]]), torch.ones(1, 5), torch.tensor([[0, 0, 0, 1, 1]])
    assert loss_agg.aggregate(row, mask, "seq-mean-token-mean", segments=segments).item() == pytest.approx(3.25)
    assert loss_agg.aggregate(row, mask, "seq-mean-token-sum", segments=segments).item() == pytest.approx(7.5)


def test_the_constant_normaliser_needs_its_length_and_unknown_modes_fail():
    with pytest.raises(ValueError, match="max_tokens"):
        loss_agg.aggregate(PER_TOKEN, MASK, "seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="loss_agg"):
        loss_agg.aggregate(PER_TOKEN, MASK, "batch")


def _grad(loss, logprobs):
    loss.backward()
    return logprobs.grad


def test_gspo_clips_the_sequence_ratio_not_each_token():
    # one sequence, token ratios pi/pi_old of 1.2 and 0.8: s = (1.2 * 0.8)^(1/2) = sqrt(0.96) (GSPO eq. 7)
    old = torch.log(torch.tensor([[0.5, 0.5]]))
    s = math.sqrt(0.96)
    kw = dict(clip_low=0.01, clip_high=0.01, loss_agg="seq-mean-token-mean")
    logprobs = (old + torch.log(torch.tensor([[1.2, 0.8]])))
    # A = +1: min(s, clip(s) = 0.99) = s, unclipped; loss -s; d(-s)/d log pi_t = -s / |y| for each token
    lp = logprobs.clone().requires_grad_(True)
    loss, stats = policy_losses.gspo(lp, old, old, torch.tensor([1.0]), torch.ones(1, 2), **kw)
    assert loss.item() == pytest.approx(-s, rel=1e-6)
    torch.testing.assert_close(_grad(loss, lp), torch.full((1, 2), -s / 2))
    assert stats["clip_frac"] == 0.0 and stats["ratio_mean"] == pytest.approx(s, rel=1e-6)
    # A = -1: min(-s, -0.99) = -0.99, the clipped constant: loss 0.99, no gradient, the whole sequence clipped
    lp = logprobs.clone().requires_grad_(True)
    loss, stats = policy_losses.gspo(lp, old, old, torch.tensor([-1.0]), torch.ones(1, 2), **kw)
    assert loss.item() == pytest.approx(0.99, rel=1e-6)
    torch.testing.assert_close(_grad(loss, lp), torch.zeros(1, 2))
    assert stats["clip_frac"] == 1.0


def test_gspo_packed_equals_padded():
    # two sequences of 2 and 3 tokens, padded vs packed into one row: same loss
    old = torch.log(torch.tensor([[0.5, 0.4, 0.0], [0.3, 0.6, 0.2]]).clamp(min=1e-3))
    lp = old + torch.tensor([[0.1, -0.3, 0.0], [0.2, 0.05, -0.1]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    adv = torch.tensor([0.7, -0.4])
    padded, _ = policy_losses.gspo(lp, old, old, adv, mask, clip_low=0.05, clip_high=0.05)
    row = lambda t: torch.cat([t[0, :2], t[1]])[None]  # noqa: E731
    packed, _ = policy_losses.gspo(row(lp), row(old), row(old), torch.tensor([[0.7, 0.7, -0.4, -0.4, -0.4]]),
                                   torch.ones(1, 5), clip_low=0.05, clip_high=0.05,
                                   segments=torch.tensor([[0, 0, 1, 1, 1]]))
    assert packed.item() == pytest.approx(padded.item(), rel=1e-6)


def test_cispo_weights_log_pi_by_the_clipped_stop_gradient_ratio():
    # r = pi/pi_old = 0.6/0.4 = 1.5 and 0.2/0.4 = 0.5; clip_high 0.2, no lower bound: r^ = 1.2, 0.5 (MiniMax-M1 eq. 5)
    old = torch.log(torch.tensor([[0.4, 0.4]]))
    lp = torch.log(torch.tensor([[0.6, 0.2]])).requires_grad_(True)
    loss, stats = policy_losses.cispo(lp, old, old, torch.tensor([2.0]), torch.ones(1, 2), clip_high=0.2)
    # per token -r^ A log pi (eq. 4), token-mean over 2 tokens
    expected = (-1.2 * 2 * math.log(0.6) - 0.5 * 2 * math.log(0.2)) / 2
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    # the gradient is -r^ A / 2 per token: the clipped token keeps a gradient (PPO-clip's would be 0)
    torch.testing.assert_close(_grad(loss, lp), torch.tensor([[-1.2, -0.5]]))
    assert stats["clip_frac"] == 0.5
    # a lower bound clips the 0.5 up to 1 - 0.3 = 0.7
    lp2 = lp.detach().clone().requires_grad_(True)
    loss, _ = policy_losses.cispo(lp2, old, old, torch.tensor([2.0]), torch.ones(1, 2), clip_low=0.3, clip_high=0.2)
    torch.testing.assert_close(_grad(loss, lp2), torch.tensor([[-1.2, -0.7]]))


def test_the_off_policy_weight_multiplies_every_loss():
    # pi_old / pi_behaviour = 2 on both tokens: with tis_token capped at 1.5 each term is 1.5 x its on-policy value
    old = torch.log(torch.tensor([[0.4, 0.4]]))
    behaviour = old - math.log(2.0)
    lp = torch.log(torch.tensor([[0.6, 0.2]]))
    for loss_fn in (policy_losses.gspo, policy_losses.cispo):
        on, _ = loss_fn(lp, old, old, torch.tensor([1.0]), torch.ones(1, 2))
        off, stats = loss_fn(lp, old, behaviour, torch.tensor([1.0]), torch.ones(1, 2), off_policy="tis_token",
                             tis_cap=1.5)
        assert off.item() == pytest.approx(1.5 * on.item(), rel=1e-6)
        assert stats["importance_weight_mean"] == pytest.approx(2.0) and stats["importance_truncated_frac"] == 1.0


def test_entropy_bonus_is_coef_times_the_aggregated_entropy():
    entropy = torch.tensor([[1.0, 2.0], [3.0, 7.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    assert policy_losses.entropy_bonus(entropy, mask, 0.1).item() == pytest.approx(0.1 * 6 / 3)
    assert policy_losses.entropy_bonus(entropy, mask, 0.1, loss_agg="seq-mean-token-mean").item() == (
        pytest.approx(0.1 * (1.5 + 3) / 2))


# --------------------------------------------------------------------------- grpo is unchanged

# Inputs, and the loss (policy loss + 0.1 x k3 KL) and d loss / d logprobs they gave with stages/grpo.py's
# policy_loss and kl_penalty at db8ff11, before the algorithm family existed, as exact float hex.
LOGP = [[-1.2, -0.3, -2.0, -0.7, -1.5], [-0.4, -1.1, -0.9, -3.0, -0.2]]
OLD = [[-1.0, -0.5, -1.8, -0.7, -1.9], [-0.6, -1.0, -1.3, -2.5, -0.2]]
BEH = [[-1.1, -0.4, -1.0, -0.9, -1.9], [-0.6, -1.4, -1.3, -2.0, -0.5]]
REF = [[-1.3, -0.2, -2.2, -0.6, -1.4], [-0.5, -1.2, -1.0, -2.8, -0.1]]
PIN_MASK = [[1, 1, 1, 1, 0], [1, 1, 1, 0, 0]]
SEGMENTS = [[0, 0, 1, 1, 1], [0, 0, 0, 1, 1]]
PINNED = {
    ("token", False): ("0x1.602be00000000p-2", ["-0x1.a1ffbe0000000p-4", "-0x1.05c00a0000000p-3", "-0x1.4334a00000000p-5",
                       "-0x1.20f47e0000000p-3", "0x0.0p+0", "0x1.d356040000000p-3", "0x1.0218be0000000p-2",
                       "0x1.1d18320000000p-2", "0x0.0p+0", "0x0.0p+0"]),
    ("token", True): ("-0x1.abf3da0000000p-3", ["-0x1.a1ffbe0000000p-4", "-0x1.05c00a0000000p-3", "0x1.22728e0000000p-4",
                      "0x1.cd798e0000000p-3", "0x0.0p+0", "-0x1.5fc77a0000000p-4", "-0x1.855c980000000p-4",
                      "0x1.6460400000000p-10", "0x0.0p+0", "0x0.0p+0"]),
    ("sequence", False): ("0x1.0ac9f20000000p-1", ["-0x1.6dbfc40000000p-4", "-0x1.ca10140000000p-4",
                          "-0x1.1ace0a0000000p-5", "-0x1.f9abdc0000000p-4", "0x0.0p+0", "0x1.109cd80000000p-2",
                          "0x1.2d1cde0000000p-2", "0x1.4c9c3a0000000p-2", "0x0.0p+0", "0x0.0p+0"]),
    ("sequence", True): ("0x1.4fdcf80000000p-3", ["-0x1.24996a0000000p-4", "-0x1.6e73440000000p-4", "0x1.fc48780000000p-4",
                         "0x1.93ca5a0000000p-2", "0x0.0p+0", "-0x1.ec7daa0000000p-5", "-0x1.108da00000000p-4",
                         "0x1.f2ed200000000p-11", "0x0.0p+0", "0x0.0p+0"]),
}


@pytest.mark.parametrize("agg, packed", list(PINNED))
def test_grpo_gives_the_loss_and_gradients_it_gave_before(agg, packed):
    """The trainer's call for algo grpo (POLICY_LOSSES, kl.kl_penalty with the default estimator) is bit-identical."""
    logprobs = torch.tensor(LOGP, requires_grad=True)
    mask = torch.tensor(PIN_MASK, dtype=torch.float32)
    segments = torch.tensor(SEGMENTS) if packed else None
    adv = (torch.tensor([[0.8, 0.8, -1.3, -1.3, -1.3], [0.5, 0.5, 0.5, -0.2, -0.2]]) if packed
           else torch.tensor([0.8, -1.3]))
    normalizer = None if packed else 7.0 if agg == "token" else 2.0
    agg_kw = {"loss_agg": agg, "normalizer": normalizer, "max_tokens": None}
    loss, _ = policy_losses.POLICY_LOSSES["grpo"](
        logprobs, torch.tensor(OLD), torch.tensor(BEH), adv, mask, segments=segments, **agg_kw,
        clip_low=0.2, clip_high=0.28, max_importance_ratio=5.0, off_policy="decoupled", tis_cap=2.0, mask_low=0.5,
        mask_high=2.0)  # fmt: skip
    total = loss + 0.1 * kl.kl_penalty(logprobs, torch.tensor(REF), mask, segments=segments, estimator="k3", **agg_kw)
    total.backward()
    want_loss, want_grad = PINNED[(agg, packed)]
    assert total.item().hex() == want_loss
    assert [g.hex() for g in logprobs.grad.flatten().tolist()] == want_grad
