"""One DeepSpeed step of each algorithm on the tiny Llama: it runs, and it moves the weights."""

import math
import os

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
PPO = dict(clip_low=0.2, clip_high=0.28, max_importance_ratio=5.0)


@pytest.fixture(scope="module")
def batch(tiny_llama_dir):
    from trainer_batches import load_hf, make_batch

    return make_batch(load_hf(tiny_llama_dir), n_groups=2)


ALGOS = pytest.mark.parametrize("kw", [
    dict(algo="dr_grpo", loss_agg="seq-mean-token-sum-norm", max_new_tokens=16),
    dict(algo="rloo", loss_agg="token-mean"),
    dict(algo="reinforce_pp", loss_agg="token-mean", kl_coef=0.05),  # the KL folded into the reward
    dict(algo="reinforce_pp", loss_agg="token-mean", kl_coef=0.05, packing=True, algo_options={"kl_in_reward": False}),
    dict(algo="gspo", loss_agg="seq-mean-token-mean", algo_options={"clip_low": 3e-4, "clip_high": 4e-4}),
    dict(algo="cispo", loss_agg="token-mean", algo_options={"clip_low": None, "clip_high": 4.0}, packing=True),
    dict(algo="grpo", loss_agg="token", entropy_coef=0.01, kl_coef=0.05, kl_estimator="k2",
         overlong={"max_tokens": 10, "cache_tokens": 4, "penalty_factor": 1.0}),
    dict(algo="ppo", loss_agg="token-mean", kl_coef=0.05, packing=True, algo_options={"critic_lr": 1e-3}),  # KL in the reward
], ids=["dr_grpo", "rloo", "reinforce_pp", "reinforce_pp-kl-loss-packed", "gspo", "cispo-packed", "grpo-entropy-overlong",
        "ppo-kl-packed"])


@ALGOS
def test_one_step_runs_and_moves_the_weights(tiny_llama_dir, batch, kw):
    from trainer_batches import GROUP

    from rlflow.stages.trainer import DeepSpeedTrainer

    tr = DeepSpeedTrainer(tiny_llama_dir, os.path.join(REPO, "configs", "deepspeed", "zero0.json"), lr=1e-3,
                          micro_batch_size=4, **{"kl_coef": 0.0, **PPO, **kw})
    try:
        before = tr.state_numpy()
        m = tr.train_step(batch, GROUP)
        after = tr.state_numpy()
    finally:
        tr.close()
    assert m["version"] == 1 and math.isfinite(m["loss"]) and m["grad_norm"] > 0 and m["nonfinite"] == ""
    assert max(float(np.abs(after[k] - before[k]).max()) for k in before) > 1e-5
    if kw.get("kl_coef"):
        assert math.isfinite(m["kl"])  # logged whether it is a loss term or folded into the reward


def test_the_entropy_bonus_changes_the_update(tiny_llama_dir, batch):
    from trainer_batches import GROUP

    from rlflow.stages.trainer import DeepSpeedTrainer

    norms = []
    for coef in (0.0, 1.0):
        tr = DeepSpeedTrainer(tiny_llama_dir, os.path.join(REPO, "configs", "deepspeed", "zero0.json"), lr=1e-3,
                              micro_batch_size=8, loss_agg="token", kl_coef=0.0, entropy_coef=coef, **PPO)
        try:
            m = tr.train_step(batch, GROUP)
        finally:
            tr.close()
        norms.append(m["grad_norm"])
        assert m["loss"] == pytest.approx(m["pg_loss"] - coef * m["entropy"], rel=1e-4, abs=1e-6)
    assert norms[0] != pytest.approx(norms[1], rel=1e-3)


def test_the_constant_normaliser_needs_the_generation_budget(tiny_llama_dir):
    from rlflow.stages.trainer import DeepSpeedTrainer

    with pytest.raises(ValueError, match="max_new_tokens"):
        DeepSpeedTrainer(tiny_llama_dir, os.path.join(REPO, "configs", "deepspeed", "zero0.json"), lr=1e-3,
                         loss_agg="seq-mean-token-sum-norm", kl_coef=0.0, algo="dr_grpo", **PPO)


@ALGOS
def test_epochs_of_mini_batches_take_several_optimizer_steps_on_one_version(tiny_llama_dir, batch, kw):
    """train.epochs x train.mini_batches optimizer steps per batch, pi_old taken once before the first: the ratio is 1
    on the first step (fresh data, these weights) and departs from 1 after it, where the clip can act; the batch is
    one weights version, and DeepSpeed's step count (saved with a checkpoint) counts the optimizer steps."""
    from trainer_batches import GROUP

    from rlflow.stages.trainer import DeepSpeedTrainer

    tr = DeepSpeedTrainer(tiny_llama_dir, os.path.join(REPO, "configs", "deepspeed", "zero0.json"), lr=1e-2,
                          micro_batch_size=4, epochs=2, mini_batches=2, **{"kl_coef": 0.0, **PPO, **kw})
    try:
        m = tr.train_step(batch, GROUP)
        counters = tr.counters()
    finally:
        tr.close()
    assert m["version"] == 1 and m["optimizer_steps"] == 4 and counters == {"version": 1, "optimizer_steps": 4}
    assert m["micro_batches"] % 2 == 0 and math.isfinite(m["loss"]) and m["nonfinite"] == ""
    assert m["ratio_mean_first"] == pytest.approx(1.0, abs=1e-5)
    assert abs(m["ratio_mean_last"] - 1.0) > 1e-4  # pi_old is the batch's first weights, three steps back
    assert 0.0 <= m["clip_frac"] <= 1.0  # reported, a mean over the optimizer steps
