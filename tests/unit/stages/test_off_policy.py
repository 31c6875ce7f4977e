"""Off-policy corrections (stages/grpo.py importance_weights, train stage `off_policy`) against hand-computed values.

The hand-made batch: 2 sequences, 3 positions, the last one of sequence 1 padding. rho = pi_old / pi_behaviour:
    sequence 0: [4, 1, 0.25]   (product 1)     advantage +1
    sequence 1: [1.5, 2.5, pad] (product 3.75)  advantage -1
logprobs == old_logprobs, so r = 1 (never clipped) and each token's loss is -w * A; 5 valid tokens (token mean).
"""

import math
import os
import random

import pytest
import torch

from rlflow.stages import grpo

RHO = [[4.0, 1.0, 0.25], [1.5, 2.5, 1.0]]
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
ADV = torch.tensor([1.0, -1.0])
CLIP = {"clip_low": 0.2, "clip_high": 0.28}


def batch():
    """(logprobs leaf, old, behaviour): behaviour = -3, old = behaviour + log rho; garbage ratio e^50 at the padding."""
    behaviour = torch.full((2, 3), -3.0)
    behaviour[1, 2] = -60.0
    old = torch.full((2, 3), -3.0) + torch.log(torch.tensor(RHO))
    old[1, 2] = -10.0
    return old.clone().requires_grad_(True), old, behaviour


def run(off_policy, loss_agg="token", normalizer=None, **params):
    logprobs, old, behaviour = batch()
    params = {"max_importance_ratio": 5.0, **params}
    loss, stats = grpo.policy_loss(logprobs, old, behaviour, ADV, MASK, loss_agg=loss_agg, normalizer=normalizer,
                                   off_policy=off_policy, **CLIP, **params)
    loss.backward()
    return loss.item(), logprobs.grad, stats


# (option, parameters, the weights by hand, truncated tokens, masked tokens, loss by hand = sum(-w * A) / 5)
CASES = [
    ("decoupled", {"max_importance_ratio": 3.0}, [[3, 1, 0.25], [1.5, 2.5]], 1, 0, (-(3 + 1 + 0.25) + (1.5 + 2.5)) / 5),
    ("tis_token", {"tis_cap": 2.0}, [[2, 1, 0.25], [1.5, 2]], 2, 0, (-(2 + 1 + 0.25) + (1.5 + 2)) / 5),
    # sequence 0: min(4 * 1 * 0.25, 2) = 1 on each token; sequence 1: min(1.5 * 2.5, 2) = 2 on each token
    ("tis_sequence", {"tis_cap": 2.0}, [[1, 1, 1], [2, 2]], 2, 0, (-(1 + 1 + 1) + (2 + 2)) / 5),
    # band [0.5, 2]: 4, 0.25 and 2.5 fall outside and are masked; 1 and 1.5 keep their ratio
    ("mis_token", {"mask_low": 0.5, "mask_high": 2.0}, [[0, 1, 0], [1.5, 0]], 0, 3, (-1 + 1.5) / 5),
    # band [0.5, 2]: sequence 0's product 1 is inside (weight 1), sequence 1's 3.75 outside (both tokens masked)
    ("mis_sequence", {"mask_low": 0.5, "mask_high": 2.0}, [[1, 1, 1], [0, 0]], 0, 2, -(1 + 1 + 1) / 5),
    # band [0.5, 5]: only 0.25 falls outside
    ("icepop", {"mask_low": 0.5, "mask_high": 5.0}, [[4, 1, 0], [1.5, 2.5]], 0, 1, (-(4 + 1) + (1.5 + 2.5)) / 5),
]


@pytest.mark.parametrize("off_policy, params, weights, truncated, masked, expected", CASES, ids=[c[0] for c in CASES])
def test_each_correction_matches_the_hand_computed_loss_gradient_and_stats(off_policy, params, weights, truncated, masked, expected):
    loss, grad, stats = run(off_policy, **params)
    assert loss == pytest.approx(expected, abs=1e-5)
    # d loss / d logprob_t = -w_t * A / 5 at r = 1: masked tokens and the padding get exactly zero
    w = torch.tensor([weights[0], weights[1] + [0.0]])
    torch.testing.assert_close(grad, -w * ADV.unsqueeze(-1) / 5, atol=1e-6, rtol=1e-5)
    assert bool((grad[w == 0] == 0).all())
    assert stats["importance_truncated_frac"] == pytest.approx(truncated / 5)
    assert stats["importance_masked_frac"] == pytest.approx(masked / 5)
    assert stats["importance_weight_used_mean"] == pytest.approx(float(w.sum()) / 5, abs=1e-5)
    # the uncorrected per-token ratio is reported the same way whatever the option
    assert stats["importance_weight_mean"] == pytest.approx((4 + 1 + 0.25 + 1.5 + 2.5) / 5, abs=1e-5)
    assert stats["importance_weight_max"] == pytest.approx(4.0, abs=1e-5)


def test_default_is_the_decoupled_correction_with_max_importance_ratio():
    logprobs, old, behaviour = batch()
    default, _ = grpo.policy_loss(logprobs, old, behaviour, ADV, MASK, loss_agg="token", max_importance_ratio=3.0, **CLIP)
    assert default.item() == pytest.approx(CASES[0][-1], abs=1e-6)


def test_sequence_aggregation_normalises_per_sequence_not_per_kept_token():
    # tis_sequence: sequence 0 mean(-1, -1, -1) = -1, sequence 1 mean(2, 2) = 2 -> (-1 + 2) / 2
    assert run("tis_sequence", loss_agg="sequence", tis_cap=2.0)[0] == pytest.approx(0.5, abs=1e-5)
    # mis_sequence masks all of sequence 1: it still counts as a sequence -> (-1 + 0) / 2
    assert run("mis_sequence", loss_agg="sequence")[0] == pytest.approx(-0.5, abs=1e-5)


@pytest.mark.parametrize("off_policy", grpo.OFF_POLICY)
def test_rows_with_a_batch_normalizer_sum_to_the_full_batch_loss(off_policy):
    # what micro-batches and trainer ranks do: each holds whole sequences, the normaliser is the whole batch's
    logprobs, old, behaviour = batch()
    full, _ = grpo.policy_loss(logprobs, old, behaviour, ADV, MASK, loss_agg="token", max_importance_ratio=5.0,
                               off_policy=off_policy, **CLIP)
    rows = sum(grpo.policy_loss(logprobs[i : i + 1], old[i : i + 1], behaviour[i : i + 1], ADV[i : i + 1], MASK[i : i + 1],
                                loss_agg="token", normalizer=5.0, max_importance_ratio=5.0, off_policy=off_policy, **CLIP)[0]
               for i in range(2))  # fmt: skip
    assert rows.item() == pytest.approx(full.item(), abs=1e-6)


@pytest.mark.parametrize("off_policy", ["tis_sequence", "mis_sequence"])
def test_sequence_weights_are_one_value_per_sequence(off_policy):
    torch.manual_seed(0)
    log_ratio = torch.randn(4, 7) * 0.3
    mask = (torch.arange(7) < torch.tensor([[7], [5], [2], [6]])).float()
    w, _, _ = grpo.importance_weights(log_ratio, mask, off_policy, tis_cap=1.5, mask_low=0.3, mask_high=3.0)
    for row in range(4):
        kept = w[row][mask[row].bool()]
        assert torch.equal(kept, kept[:1].expand_as(kept))
        rho = math.exp(float(log_ratio[row][mask[row].bool()].sum()))
        expected = min(rho, 1.5) if off_policy == "tis_sequence" else (rho if 0.3 <= rho <= 3.0 else 0.0)
        assert float(kept[0]) == pytest.approx(expected, rel=1e-5)


def test_a_long_sequence_ratio_is_clamped_in_log_space_not_overflowed():
    log_ratio = torch.full((1, 40), 10.0)  # rho = e^400: inf in float32
    w, truncated, _ = grpo.importance_weights(log_ratio, torch.ones(1, 40), "tis_sequence", tis_cap=2.0)
    assert torch.allclose(w, torch.full((1, 40), 2.0)) and bool(truncated.all())
    w, _, masked = grpo.importance_weights(log_ratio, torch.ones(1, 40), "mis_sequence")
    assert torch.equal(w, torch.zeros(1, 40)) and bool(masked.all())


def test_icepop_is_the_token_level_mask_of_mis_token():
    assert run("icepop")[0] == pytest.approx(run("mis_token")[0])


def test_no_gradient_reaches_the_weights():
    logprobs, old, behaviour = batch()
    behaviour.requires_grad_(True)
    for option in grpo.OFF_POLICY:
        loss, _ = grpo.policy_loss(logprobs, old, behaviour, ADV, MASK, loss_agg="token", max_importance_ratio=5.0,
                                   off_policy=option, **CLIP)
        loss.backward()
    assert behaviour.grad is None  # the weight is a constant of the objective


def test_unknown_option_is_rejected():
    with pytest.raises(ValueError, match="off_policy must be one of"):
        grpo.importance_weights(torch.zeros(1, 2), torch.ones(1, 2), "tis")


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


# --------------------------------------------------------------------------- the train stage option, lowered to the trainer


def test_the_option_and_its_parameters_reach_the_trainer_kwargs():
    from rlflow.compiler import compile_pipeline

    pipeline = os.path.join(REPO, "pipelines", "one_step.yaml")
    plan = compile_pipeline(pipeline, ["stages.train.off_policy=mis_sequence", "stages.train.mask_low=0", "stages.train.mask_high=3"])
    (trainer,) = [a for a in plan["actors"] if a["role"] == "trainer"]
    kwargs = trainer["trainer_kwargs"]
    assert (kwargs["off_policy"], kwargs["mask_low"], kwargs["mask_high"]) == ("mis_sequence", 0.0, 3.0)
    # the resolved pipeline the plan records spells out every default, and validates again
    from rlflow.schema import Pipeline

    assert Pipeline.model_validate(plan["pipeline"]).stages["train"].off_policy == "mis_sequence"


def test_a_parameter_of_another_option_is_rejected_unless_left_at_its_default():
    from pydantic import ValidationError

    from rlflow.schema import TrainStage

    assert TrainStage(kind="train", off_policy="icepop", mask_high=5.0, tis_cap=2.0).tis_cap == 2.0
    with pytest.raises(ValidationError, match="applies to off_policy tis_token / tis_sequence, not icepop"):
        TrainStage(kind="train", off_policy="icepop", tis_cap=3.0)
    with pytest.raises(ValidationError, match="applies to off_policy decoupled, not tis_token"):
        TrainStage(kind="train", off_policy="tis_token", max_importance_ratio=3.0)


# --------------------------------------------------------------------------- one DeepSpeed step per option


@pytest.fixture(scope="module")
def stale_batch(tiny_llama_dir):
    from trainer_batches import load_hf, make_batch

    model_dir = tiny_llama_dir
    trajs = make_batch(load_hf(model_dir), n_groups=2)
    rng = random.Random(0)
    for t in trajs:  # a sampler that disagrees with the trainer: rho_t = e^{+-1.2} on some tokens
        t.behaviour_logprobs = [lp + rng.choice([-1.2, 0.0, 1.2]) for lp in t.behaviour_logprobs]
    return model_dir, trajs


@pytest.mark.parametrize("off_policy", grpo.OFF_POLICY)
def test_deepspeed_trainer_takes_a_step_with_each_correction(stale_batch, off_policy):
    from trainer_batches import GROUP

    from rlflow.stages.trainer import DeepSpeedTrainer

    model_dir, trajs = stale_batch
    tr = DeepSpeedTrainer(model_dir, os.path.join(REPO, "configs", "deepspeed", "zero0.json"), lr=1e-3, clip_low=0.2,
                          clip_high=0.28, loss_agg="token", kl_coef=0.0, max_importance_ratio=3.0, off_policy=off_policy,
                          tis_cap=2.0, mask_low=0.5, mask_high=2.0, micro_batch_size=4)
    try:
        m = tr.train_step(trajs, GROUP)
    finally:
        tr.close()
    assert m["version"] == 1 and math.isfinite(m["loss"]) and m["grad_norm"] > 0
    # e^1.2 = 3.3 exceeds every cap and band here: truncations leave masked_frac 0, masks leave truncated_frac 0
    if off_policy in ("decoupled", "tis_token", "tis_sequence"):
        assert m["importance_truncated_frac"] > 0 and m["importance_masked_frac"] == 0
    else:
        assert m["importance_masked_frac"] > 0 and m["importance_truncated_frac"] == 0
    if not off_policy.endswith("_sequence"):  # per token, truncating or masking only lowers the mean weight
        assert m["importance_weight_used_mean"] < m["importance_weight_mean"]
