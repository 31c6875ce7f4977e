"""PPO's critic (stages/critic.py) and GAE (stages/advantages.py): hand-computed examples, then a real DeepSpeed
engine on the tiny Llama: the value loss falls on a fixed batch, and a checkpoint restores the critic."""

import math
import os

import numpy as np
import pytest
import torch

from rlflow.stages import advantages
from rlflow.stages.critic import value_loss

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
ZERO0 = os.path.join(REPO, "configs", "deepspeed", "zero0.json")
PPO = dict(algo="ppo", loss_agg="token-mean", clip_low=0.2, clip_high=0.28, max_importance_ratio=5.0, kl_coef=0.0)


def test_gae_on_a_hand_computed_example():
    # one sequence of 3 trained tokens after a prompt position (mask 0), gamma 0.9, lambda 0.5, reward 1 at the end
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0]])
    rewards = torch.tensor([[0.0, 0.0, 0.0, 1.0]])
    values = torch.tensor([[9.0, 0.5, 0.4, 0.2]])  # the masked position's value is never used
    adv, ret = advantages.gae(rewards, values, mask, gamma=0.9, lam=0.5)
    # delta_3 = 1 + 0.9 * 0 - 0.2 = 0.8                    A_3 = 0.8
    # delta_2 = 0 + 0.9 * 0.2 - 0.4 = -0.22                A_2 = -0.22 + 0.45 * 0.8 = 0.14
    # delta_1 = 0 + 0.9 * 0.4 - 0.5 = -0.14                A_1 = -0.14 + 0.45 * 0.14 = -0.077
    assert adv.tolist()[0] == pytest.approx([0.0, -0.077, 0.14, 0.8])
    assert ret.tolist()[0] == pytest.approx([0.0, 0.423, 0.54, 1.0])  # A + V


def test_gae_skips_environment_tokens_and_restarts_per_packed_sequence():
    # a row holding two packed sequences (segments 0 and 1); sequence 0 has an environment token (mask 0) inside
    mask = torch.tensor([[1.0, 0.0, 1.0, 0.0, 1.0, 1.0]])
    segments = torch.tensor([[0, 0, 0, 1, 1, 1]])
    rewards = advantages.last_token_rewards(torch.tensor([[2.0, 2.0, 2.0, 3.0, 3.0, 3.0]]), mask, segments)
    assert rewards.tolist()[0] == [0.0, 0.0, 2.0, 0.0, 0.0, 3.0]  # each sequence's reward on its last trained token
    values = torch.tensor([[1.0, 7.0, 1.5, 7.0, 0.5, 1.0]])
    adv, _ = advantages.gae(rewards, values, mask, gamma=1.0, lam=1.0, segments=segments)
    # gamma = lambda = 1: A_t = sum of rewards from t on, minus V_t, within the sequence (the return's baseline)
    # sequence 0: A_2 = 2 - 1.5 = 0.5, A_0 = 2 - 1 = 1 (position 1 skipped); sequence 1: A_5 = 3 - 1 = 2, A_4 = 2.5
    assert adv.tolist()[0] == pytest.approx([1.0, 0.0, 0.5, 0.0, 2.5, 2.0])


def test_last_token_rewards_of_padded_rows():
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 1.0, 1.0]])
    assert advantages.last_token_rewards(torch.tensor([1.0, -1.0]), mask).tolist() == [[0.0, 1.0, 0.0], [0.0, 0.0, -1.0]]


def test_value_clipping_on_a_hand_example():
    old, returns = torch.tensor([[1.0, 1.0]]), torch.tensor([[2.0, 0.0]])
    values = torch.tensor([[1.5, 1.1]], requires_grad=True)
    mask = torch.ones(1, 2)
    loss, decided = value_loss(values, old, returns, mask, value_clip=0.2, normalizer=2.0)
    # token 0: V moved 0.5 toward R; clipped V = 1.2: (1.5-2)^2 = 0.25 < (1.2-2)^2 = 0.64 -> 0.64, the clipped term
    # token 1: V = 1.1 within the clip: (1.1-0)^2 = 1.21 both ways
    assert loss.item() == pytest.approx(0.5 * (0.64 + 1.21) / 2)
    assert decided.item() == 1.0
    loss.backward()  # the clipped token gets no gradient (the clip's constant wins the max); the other 2 (V - R) / 4
    assert values.grad.tolist()[0] == pytest.approx([0.0, 0.5 * 2 * 1.1 / 2])
    plain, _ = value_loss(values, old, returns, mask, value_clip=None, normalizer=2.0)
    assert plain.item() == pytest.approx(0.5 * (0.25 + 1.21) / 2)


@pytest.fixture(scope="module")
def batch(tiny_llama_dir):
    from trainer_batches import load_hf, make_batch

    return make_batch(load_hf(tiny_llama_dir), n_groups=2)


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_the_critic_loss_falls_on_a_fixed_batch(tiny_llama_dir, batch, packing):
    from trainer_batches import GROUP

    from rlflow.stages.trainer import DeepSpeedTrainer

    tr = DeepSpeedTrainer(tiny_llama_dir, ZERO0, lr=1e-4, micro_batch_size=4, packing=packing,
                          algo_options={"gamma": 1.0, "lam": 0.95, "value_clip": 0.2, "critic_lr": 1e-3,
                                        "critic_epochs": 2, "critic_warmup_steps": 1}, **PPO)
    try:
        policy_before = tr.state_numpy()
        first = tr.train_step(batch, GROUP)  # a warmup step: the critic trains, the policy is held
        assert all(np.array_equal(policy_before[k], v) for k, v in tr.state_numpy().items())
        losses = [first["critic_loss"]] + [tr.train_step(batch, GROUP)["critic_loss"] for _ in range(4)]
        m = tr.train_step(batch, GROUP)
    finally:
        tr.close()
    assert first["value_mean"] == 0.0  # a zero value head: the first advantages are the returns
    assert all(math.isfinite(x) for x in losses) and losses[-1] < 0.5 * losses[0], losses
    assert m["nonfinite"] == "" and m["explained_variance"] > first["explained_variance"]
    assert 0.0 <= m["value_clip_frac"] <= 1.0 and m["critic_grad_norm"] > 0


def test_a_checkpoint_restores_the_critic(tiny_llama_dir, batch, tmp_path):
    from trainer_batches import GROUP

    from rlflow.stages.trainer import DeepSpeedTrainer

    kwargs = dict(lr=1e-4, micro_batch_size=4, algo_options={"critic_lr": 1e-3}, **PPO)
    tr = DeepSpeedTrainer(tiny_llama_dir, ZERO0, **kwargs)
    try:
        tr.train_step(batch, GROUP)
        tr.save_checkpoint(str(tmp_path), {"step": 1}, tag="step-1")
        saved = tr.critic.state_numpy()
        after_save = tr.train_step(batch, GROUP)
    finally:
        tr.close()
    assert os.path.isdir(tmp_path / "step-1" / "critic")  # inside the policy's tag: one manifest, pruned together
    fresh = DeepSpeedTrainer(tiny_llama_dir, ZERO0, **kwargs)
    try:
        initial = fresh.critic.state_numpy()
        assert fresh.load_checkpoint(str(tmp_path), tag="step-1") == {"step": 1}
        restored = fresh.critic.state_numpy()
        again = fresh.train_step(batch, GROUP)
    finally:
        fresh.close()
    assert not np.array_equal(initial["value_head.weight"], saved["value_head.weight"])
    assert all(np.array_equal(saved[k], restored[k]) for k in saved)
    # the critic's optimizer state came back too: the step after the load repeats the step after the save
    assert again["critic_loss"] == pytest.approx(after_save["critic_loss"], rel=1e-5)
