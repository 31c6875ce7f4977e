"""DeepSpeedTrainer on a real tiny Llama and a real DeepSpeed engine (gloo, one process, CPU)."""

import os

import numpy as np
import pytest
import torch
from trainer_batches import GROUP, load_hf, make_batch, mean_logprob

from rlflow.stages.trainer import DeepSpeedTrainer
from rlflow.stages.trajectory import Trajectory

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
ZERO = {s: os.path.join(REPO, "configs", "deepspeed", f"zero{s}.json") for s in range(4)}
ALGO = dict(clip_low=0.2, clip_high=0.28, loss_agg="token", kl_coef=0.0, max_importance_ratio=5.0)


def trainer(model_dir, stage, **kw):
    return DeepSpeedTrainer(model_dir, ZERO[stage], **{"lr": 3e-3, "micro_batch_size": 5, **ALGO, **kw})


@pytest.mark.parametrize("stage", [0, 3])
def test_training_raises_the_logprob_of_rewarded_completions(tiny_llama_dir, stage):
    initial = load_hf(tiny_llama_dir)
    batch = make_batch(initial)
    tr = trainer(tiny_llama_dir, stage)
    try:
        metrics = [tr.train_step(batch, GROUP) for _ in range(4)]
        trained = load_hf(tiny_llama_dir, tr.state_numpy())
    finally:
        tr.close()

    assert mean_logprob(trained, batch, True) > mean_logprob(initial, batch, True) + 0.5
    assert mean_logprob(trained, batch, False) < mean_logprob(initial, batch, False)
    assert [m["version"] for m in metrics] == [1, 2, 3, 4]
    first = metrics[0]
    assert first["tokens"] == sum(len(t.completion_ids) for t in batch)
    assert first["micro_batches"] == 4  # 16 trajectories, micro-batches of 5
    # step 1 is on-policy: the importance weights are 1 and nothing is clipped
    assert first["importance_weight_mean"] == pytest.approx(1.0, abs=1e-4)
    assert first["importance_weight_max"] == pytest.approx(1.0, abs=1e-4)
    assert first["clip_frac"] == 0.0 and first["kl"] == 0.0
    assert first["grad_norm"] > 0 and first["entropy"] > 0
    # later steps reuse the batch: it is now stale and the importance weights move away from 1
    assert metrics[-1]["importance_weight_max"] > 1.01


def test_old_logprobs_match_an_unpadded_forward_at_the_temperature(tiny_llama_dir):
    # behaviour log-probs from an unpadded forward at T = 0.7: the trainer's padded, shifted, tempered
    # recomputation must agree token by token, so every importance weight is exactly 1
    batch = make_batch(load_hf(tiny_llama_dir), temperature=0.7)
    tr = trainer(tiny_llama_dir, 0, temperature=0.7, micro_batch_size=16)
    try:
        m = tr.train_step(batch, GROUP)
    finally:
        tr.close()
    assert m["importance_weight_mean"] == pytest.approx(1.0, abs=1e-5)
    assert m["importance_weight_max"] == pytest.approx(1.0, abs=1e-5)


@pytest.mark.parametrize(
    "stage, loss_agg", [(0, "token"), (0, "sequence"), (1, "token"), (2, "sequence"), (3, "token")]
)
def test_micro_batches_accumulate_to_the_full_batch_step(tiny_llama_dir, stage, loss_agg):
    batch = make_batch(load_hf(tiny_llama_dir), seed=3)
    results = []
    for micro in (3, 16):  # 6 micro-batches (the last one short) vs one
        tr = trainer(tiny_llama_dir, stage, micro_batch_size=micro, loss_agg=loss_agg)
        try:
            results.append((tr.train_step(batch, GROUP), tr.state_numpy()))
        finally:
            tr.close()
    (m_micro, w_micro), (m_full, w_full) = results
    assert m_micro["micro_batches"] == 6 and m_full["micro_batches"] == 1
    assert m_micro["loss"] == pytest.approx(m_full["loss"], abs=1e-6)
    assert m_micro["grad_norm"] == pytest.approx(m_full["grad_norm"], rel=1e-4)
    # Adam's first update is about lr * g / |g|: entries with |g| near eps amplify rounding, so compare at lr / 100
    for name in w_full:
        np.testing.assert_allclose(w_micro[name], w_full[name], atol=3e-5, err_msg=name)


@pytest.mark.parametrize("stage", [0, 3])
def test_state_numpy_round_trips_into_a_fresh_hf_model(tiny_llama_dir, stage):
    batch = make_batch(load_hf(tiny_llama_dir))
    tr = trainer(tiny_llama_dir, stage)
    try:
        tr.train_step(batch, GROUP)
        state = tr.state_numpy()
        ids = torch.tensor([batch[0].prompt_ids + batch[0].completion_ids])
        with torch.no_grad():
            engine_logits = tr.engine(input_ids=ids).logits
    finally:
        tr.close()
    assert set(state) == set(load_hf(tiny_llama_dir).state_dict())
    assert all(a.dtype == np.float32 and a.flags.c_contiguous and a.flags.writeable for a in state.values())
    fresh = load_hf(tiny_llama_dir, state)
    with torch.no_grad():
        fresh_logits = fresh(input_ids=ids).logits
        initial_logits = load_hf(tiny_llama_dir)(input_ids=ids).logits
    torch.testing.assert_close(fresh_logits, engine_logits, rtol=0, atol=1e-6)
    assert not torch.allclose(fresh_logits, initial_logits, atol=1e-4)  # the step really changed the weights


@pytest.mark.parametrize("stage", [0, 3])
def test_checkpoint_restores_version_weights_and_optimizer(tiny_llama_dir, stage, tmp_path):
    batches = [make_batch(load_hf(tiny_llama_dir), seed=s) for s in range(3)]
    first = trainer(tiny_llama_dir, stage)
    try:
        for b in batches[:2]:
            first.train_step(b, GROUP)
        first.save_checkpoint(str(tmp_path), {"consumed_groups": 8, "note": "two steps"})
        saved = first.state_numpy()
        after_third = first.train_step(batches[2], GROUP)
        expected = first.state_numpy()
    finally:
        first.close()

    resumed = trainer(tiny_llama_dir, stage)
    try:
        assert resumed.version == 0
        client = resumed.load_checkpoint(str(tmp_path))
        assert client == {"consumed_groups": 8, "note": "two steps"}
        assert resumed.version == 2
        for name, value in resumed.state_numpy().items():
            np.testing.assert_array_equal(value, saved[name], err_msg=name)
        m = resumed.train_step(batches[2], GROUP)
        got = resumed.state_numpy()
    finally:
        resumed.close()
    assert m["version"] == after_third["version"] == 3
    # the same update as the uninterrupted run only if Adam's moments and step count were restored too
    for name in expected:
        np.testing.assert_allclose(got[name], expected[name], atol=1e-6, err_msg=name)


def test_a_checkpoint_counts_the_optimizer_steps_of_epochs_and_mini_batches(tiny_llama_dir, tmp_path):
    batch = make_batch(load_hf(tiny_llama_dir))
    first = trainer(tiny_llama_dir, 0, epochs=2, mini_batches=3)
    try:
        first.train_step(batch, GROUP)
        saved = first.save_checkpoint(str(tmp_path), {"step": 1})
    finally:
        first.close()
    assert saved == {"version": 1, "optimizer_steps": 6}  # one version, six optimizer steps
    resumed = trainer(tiny_llama_dir, 0, epochs=2, mini_batches=3)
    try:
        resumed.load_checkpoint(str(tmp_path))
        assert resumed.counters() == saved  # what a resume checks against the run's state (checkpoint.agree)
    finally:
        resumed.close()


def test_load_checkpoint_from_an_empty_directory_fails_loudly(tiny_llama_dir, tmp_path):
    tr = trainer(tiny_llama_dir, 0)
    try:
        with pytest.raises(FileNotFoundError, match="no DeepSpeed checkpoint"):
            tr.load_checkpoint(str(tmp_path))
    finally:
        tr.close()


@pytest.mark.parametrize("stage", [0, 3])
def test_kl_to_the_reference_model_grows_as_the_policy_moves(tiny_llama_dir, stage):
    batch = make_batch(load_hf(tiny_llama_dir))
    tr = trainer(tiny_llama_dir, stage, kl_coef=0.5)
    try:
        if stage == 3:  # partitioned like the policy (an engine without optimizer), not a whole copy on every rank
            assert tr.ref_model.zero_optimization_stage() == 3
            assert all(p.numel() == 0 for p in tr.ref_model.module.parameters())
        kls = [tr.train_step(batch, GROUP)["kl"] for _ in range(3)]
    finally:
        tr.close()
    assert kls[0] == pytest.approx(0.0, abs=1e-7)  # policy == reference before the first update
    assert 0 < kls[1] < kls[2]


def test_malformed_batches_are_rejected(tiny_llama_dir):
    batch = make_batch(load_hf(tiny_llama_dir), n_groups=2)
    tr = trainer(tiny_llama_dir, 0)
    try:
        unrewarded = [Trajectory(**{**t.as_dict(), "reward": None}) if i == 5 else t for i, t in enumerate(batch)]
        with pytest.raises(ValueError, match=r"g0-1/1 reached the trainer without a reward"):
            tr.train_step(unrewarded, GROUP)
        with pytest.raises(ValueError, match="at most group_size=4"):
            tr.train_step(batch + batch[:1], GROUP)  # a group with one member too many
        short = [Trajectory(**{**t.as_dict(), "behaviour_logprobs": t.behaviour_logprobs[:-1]}) for t in batch]
        with pytest.raises(ValueError, match="behaviour log-probs"):
            tr.train_step(short, GROUP)
        assert tr.version == 0  # nothing was trained
    finally:
        tr.close()


def test_a_group_short_of_a_failed_member_is_normalised_on_its_own():
    from rlflow.stages.grpo import batch_advantages

    rows = [Trajectory(group_id=g, index=i, prompt="p", answer="a", prompt_ids=[1], reward=r)
            for g, i, r in [("a", 0, 1.0), ("a", 1, 0.0), ("a", 2, 0.0), ("b", 0, 1.0), ("b", 1, 0.0)]]
    adv = batch_advantages(torch.tensor([t.reward for t in rows]), [t.group_id for t in rows])
    assert adv[:3].sum().item() == pytest.approx(0.0, abs=1e-6)
    assert adv[3].item() == pytest.approx(1.0, abs=1e-4) and adv[4].item() == pytest.approx(-1.0, abs=1e-4)


def test_lr_schedule_factors_by_hand():
    from rlflow.stages.lr_schedule import lr_factor

    assert [lr_factor(None, k) for k in (0, 50)] == [1.0, 1.0]
    warm = {"kind": "constant", "warmup_steps": 4, "total_steps": 10}
    assert [lr_factor(warm, k) for k in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]  # the first step moves
    cos = {"kind": "cosine", "warmup_steps": 0, "min_ratio": 0.1, "total_steps": 5}
    # from 1 at step 0 to min_ratio at the last step (4): 0.1 + 0.9 * (1 + cos(pi * k / 4)) / 2
    assert [round(lr_factor(cos, k), 4) for k in range(6)] == [1.0, 0.8682, 0.55, 0.2318, 0.1, 0.1]


def test_lr_schedule_sets_the_rate_of_each_step_and_resumes_from_the_version(tiny_llama_dir, tmp_path):
    schedule = {"kind": "cosine", "warmup_steps": 1, "min_ratio": 0.5, "total_steps": 3}
    batch = make_batch(load_hf(tiny_llama_dir))
    tr = trainer(tiny_llama_dir, 1, lr=1e-3, lr_schedule=schedule)
    try:
        lrs = [tr.train_step(batch, GROUP)["lr"] for _ in range(2)]
        tr.save_checkpoint(str(tmp_path))
    finally:
        tr.close()
    assert lrs == pytest.approx([1e-3, 1e-3])  # warmup (1 of 1), then the cosine's start
    again = trainer(tiny_llama_dir, 1, lr=1e-3, lr_schedule=schedule)
    try:
        again.load_checkpoint(str(tmp_path))
        assert again.train_step(batch, GROUP)["lr"] == pytest.approx(5e-4)  # step 3 of 3: the floor, not a restart
    finally:
        again.close()


def test_environment_tokens_are_context_not_trained(tiny_llama_dir):
    """Multi-turn: completion tokens with loss_mask 0 (environment observations) count in no loss, importance
    weight or token normaliser: junk behaviour log-probs there would blow the weights up if they did."""
    batch = make_batch(load_hf(tiny_llama_dir), seed=5)
    masked = []
    for t in batch:
        mask = [1 if j % 3 else 0 for j in range(len(t.completion_ids))]  # every third token "from the environment"
        logprobs = [lp if m else -50.0 for lp, m in zip(t.behaviour_logprobs, mask)]
        masked.append(Trajectory(**{**t.as_dict(), "loss_mask": mask, "behaviour_logprobs": logprobs}))
    tr = trainer(tiny_llama_dir, 0, micro_batch_size=16)
    try:
        m = tr.train_step(masked, GROUP)
    finally:
        tr.close()
    assert m["tokens"] == sum(t.loss_mask.count(1) for t in masked) < sum(len(t.completion_ids) for t in masked)
    assert m["importance_weight_max"] == pytest.approx(1.0, abs=1e-4)  # on-policy over the trained tokens only


def test_on_policy_distillation_moves_the_student_toward_the_teacher(tiny_llama_dir, tmp_path):
    """train.distill with reward_weight 0 (the teacher alone): a teacher that prefers the rewarded completions (it was
    trained on them) pulls the student there without any reward; a teacher equal to the student gives a KL of 0 and
    no signal."""
    initial = load_hf(tiny_llama_dir)
    batch = make_batch(initial)
    rl = trainer(tiny_llama_dir, 0)
    try:
        for _ in range(4):
            rl.train_step(batch, GROUP)
        teacher = load_hf(tiny_llama_dir, rl.state_numpy())
    finally:
        rl.close()
    teacher.save_pretrained(tmp_path / "teacher")
    rewards = [t.reward for t in batch]
    for t in batch:
        t.reward = 0.0  # no reward signal at all: what moves the student is the teacher
    student = trainer(tiny_llama_dir, 0, distill={"teacher": str(tmp_path / "teacher"), "coef": 1.0,
                                                  "reward_weight": 0.0})
    try:
        metrics = [student.train_step(batch, GROUP) for _ in range(4)]
        trained = load_hf(tiny_llama_dir, student.state_numpy())
    finally:
        student.close()
    # the KL is measured with the sampler's log-probs (make_batch's: the initial student's) against the teacher's
    assert abs(metrics[0]["distill_reverse_kl"]) > 0.05 and all(m["reward_mean"] == 0.0 for m in metrics)
    for t, r in zip(batch, rewards):
        t.reward = r  # which ones the teacher was trained to prefer
    assert mean_logprob(trained, batch, True) > mean_logprob(initial, batch, True) + 0.5

    same = trainer(tiny_llama_dir, 0, distill={"teacher": tiny_llama_dir, "reward_weight": 0.0})
    try:
        m = same.train_step(make_batch(initial, seed=5), GROUP)
    finally:
        same.close()
    assert abs(m["distill_reverse_kl"]) < 1e-4 and m["grad_norm"] < 1e-3  # the student is its teacher already
