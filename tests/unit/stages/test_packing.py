"""Packed micro-batches (stages/packing.py): the layout, the leak probe, and the trainer's loss and gradients packed
equal to padded on a tiny Llama and a tiny Qwen2 (one process, CPU, DeepSpeed ZeRO-0)."""

import inspect
import os
import random

import numpy as np
import pytest
import torch
from trainer_batches import GROUP, VOCAB, build_tiny_llama, build_tiny_qwen2, load_hf, make_batch

from rlflow.stages import grpo, packing
from rlflow.stages.batch_shards import cost, shard_batch
from rlflow.stages.trainer import DeepSpeedTrainer
from rlflow.stages.trajectory import Trajectory

# SGD at lr 1 without clipping: a step moves each weight by exactly minus its gradient
SGD = {"train_micro_batch_size_per_gpu": 3, "zero_optimization": {"stage": 0}, "steps_per_print": 10**6,
       "optimizer": {"type": "SGD", "params": {"lr": 1.0}}}
ALGO = dict(lr=1.0, clip_low=0.2, clip_high=0.28, kl_coef=0.0, max_importance_ratio=5.0)
# Measured: |loss difference| <= 1.6e-7 and |gradient difference| <= 1.2e-7 for gradients up to 7e-2 (fp32 rounding
# of sums taken in another order: attention over 1 row instead of 3, per-sequence sums by index_add). An rtol alone
# cannot hold for gradients near 0, so atol sits ~8x above the largest difference seen, ~1.5e-5 of the largest grad.
RTOL, ATOL = 1e-5, 1e-6


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model_dir(request, tmp_path_factory):
    build = {"llama": build_tiny_llama, "qwen2": build_tiny_qwen2}[request.param]
    return build(tmp_path_factory.mktemp(request.param))


def traj(prompt, completion, behaviour, loss_mask=()):
    return Trajectory(group_id="g", index=0, prompt="", answer="", prompt_ids=prompt, completion_ids=completion,
                      behaviour_logprobs=behaviour, loss_mask=list(loss_mask), reward=1.0)


def stale(batch, sigma=0.2, seed=1):
    """The batch with behaviour log-probs off the trainer's by noise: importance weights away from 1."""
    rng = random.Random(seed)
    return [Trajectory(**{**t.as_dict(), "behaviour_logprobs": [lp + rng.gauss(0, sigma) for lp in t.behaviour_logprobs]})
            for t in batch]


def test_a_packed_row_aligns_every_value_to_its_target():
    a = traj([1, 2], [3, 4, 5], [-0.1, -0.2, -0.3], loss_mask=[1, 0, 1])
    b = traj([6], [7, 8], [-0.4, -0.5])
    mb = packing.packed([a, b], [2.0, -1.0])
    assert mb.input_ids.tolist() == [[1, 2, 3, 4, 5, 6, 7, 8]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2]]
    assert mb.attention_mask is None and mb.targets.tolist() == [[2, 3, 4, 5, 6, 7, 8]]
    # target k is predicted at position k: completions 3, 5 (4 is an environment token) and 7, 8 are trained;
    # target 6 (b's first token, predicted from a's last) is masked like any prompt token
    assert mb.mask.tolist() == [[0, 1, 0, 1, 0, 1, 1]]
    torch.testing.assert_close(mb.behaviour_logprobs, torch.tensor([[0, -0.1, -0.2, -0.3, 0, -0.4, -0.5]]))
    assert mb.advantages.tolist() == [[2.0] * 5 + [-1.0] * 2]
    assert mb.segments.tolist() == [[0, 0, 0, 0, 0, 1, 1]]
    pad = packing.packed([b], [3.0], trained=False)  # a pass a rank runs for its peers: nothing trained
    assert pad.mask.sum() == 0 and pad.advantages.abs().sum() == 0


def test_per_sequence_sums_of_a_packed_row_equal_the_padded_rows():
    a, b = traj([1, 2], [3, 4, 5], [-1.0, -2.0, -0.5]), traj([6], [7, 8], [-0.3, -0.1])
    pad, pack = packing.padded([a, b], [1.0, -2.0], pad_token_id=0), packing.packed([a, b], [1.0, -2.0])
    for mb in (pad, pack):
        mb.old_logprobs = torch.zeros_like(mb.behaviour_logprobs)
    for agg, off in [("sequence", "decoupled"), ("token", "tis_sequence"), ("sequence", "mis_sequence")]:
        losses = []
        for mb in (pad, pack):
            logprobs = (mb.behaviour_logprobs * 0.5).requires_grad_(True)
            loss, _ = grpo.policy_loss(logprobs, mb.old_logprobs, mb.behaviour_logprobs, mb.advantages, mb.mask,
                                       clip_low=0.2, clip_high=0.28, max_importance_ratio=5.0, loss_agg=agg,
                                       off_policy=off, mask_low=0.1, mask_high=10.0, segments=mb.segments)
            kl = grpo.kl_penalty(logprobs, mb.behaviour_logprobs, mb.mask, loss_agg=agg, segments=mb.segments)
            losses.append((loss.item(), kl.item()))
        assert losses[0] == pytest.approx(losses[1], rel=1e-6), (agg, off)


def test_a_token_budget_sets_one_micro_batch_count_for_every_rank():
    rng = random.Random(0)
    rows = []
    for i in range(40):
        n = rng.randrange(1, 60)
        rows.append(Trajectory(group_id=f"g{i // 4}", index=i % 4, prompt="", answer="", reward=float(i % 2),
                               prompt_ids=[1] * rng.randrange(2, 9), completion_ids=[2] * n, behaviour_logprobs=[0.0] * n))
    shards = shard_batch(rows, 3, micro_batch_size=1000, max_tokens=120)
    counts = {s.micro_batches for s in shards}
    assert len(counts) == 1  # every rank runs the same number of passes
    (count,) = counts
    worst = 0
    for s in shards:
        parts = packing.split_by_tokens([cost(t) for t in s.trajectories], count)
        assert sorted(i for p in parts for i in p) == list(range(len(s.trajectories)))
        worst = max(worst, max(sum(cost(s.trajectories[i]) for i in p) for p in parts))
    assert worst <= 120  # no row here is longer than the budget
    assert count >= -(-max(sum(map(cost, s.trajectories)) for s in shards) // 120)
    assert shard_batch(rows, 3, micro_batch_size=4)[0].micro_batches == 4  # without a budget: rows, as before


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_the_probe_sees_no_leak_when_transformers_builds_the_block_diagonal_mask(model_dir, attention):
    model = load_hf(model_dir)
    model.config._attn_implementation = attention

    def logprobs_of(ids, positions, use_cache=False):
        with torch.no_grad():
            logits = model(input_ids=ids, position_ids=positions, use_cache=use_cache).logits[:, :-1]
        return grpo.token_logprobs(logits, ids[:, 1:])

    deviations = packing.probe(logprobs_of, VOCAB)
    assert deviations["crossed"] == 0.0 and deviations["moved"] < 1e-6
    assert packing.problem(deviations, 1e-3) is None
    # with a KV cache transformers skips the packed-sequence mask: sequence B then attends to A, and the probe says so
    leaky = packing.probe(lambda ids, pos: logprobs_of(ids, pos, use_cache=True), VOCAB)
    assert leaky["crossed"] > 1e-2
    assert "attends to the one before it" in packing.problem(leaky, 1e-3)


def gradient_step(model_dir, batch, **kw):
    """(metrics, gradient of every weight) of one trainer step at SGD lr 1."""
    initial = {k: v.detach().numpy().copy() for k, v in load_hf(model_dir).state_dict().items()}
    tr = DeepSpeedTrainer(model_dir, SGD, **{**ALGO, **kw})
    try:
        metrics = tr.train_step(batch, GROUP)
        after = tr.state_numpy()
    finally:
        tr.close()
    return metrics, {k: initial[k] - after[k] for k in after}


def assert_same_step(got, expected):
    (m, grads), (m0, grads0) = got, expected
    for key in ("loss", "pg_loss", "entropy", "importance_weight_mean", "clip_frac", "tokens"):
        assert m[key] == pytest.approx(m0[key], rel=RTOL, abs=ATOL), key
    assert set(grads) == set(grads0)
    for name in grads0:
        assert np.abs(grads0[name]).max() > 0, name  # every weight gets a gradient: the comparison means something
        np.testing.assert_allclose(grads[name], grads0[name], rtol=RTOL, atol=ATOL, err_msg=name)


@pytest.mark.parametrize("loss_agg, off_policy", [("token", "decoupled"), ("sequence", "tis_sequence")])
def test_packed_micro_batches_give_the_padded_loss_and_gradients(model_dir, loss_agg, off_policy):
    batch = stale(make_batch(load_hf(model_dir), seed=3))
    kw = dict(loss_agg=loss_agg, off_policy=off_policy)
    padded = gradient_step(model_dir, batch, packing=False, **kw)
    packed = gradient_step(model_dir, batch, packing=True, logit_chunk_tokens=7, **kw)
    budget = gradient_step(model_dir, batch, packing=True, micro_batch_tokens=40, **kw)
    assert padded[0]["micro_batches"] == packed[0]["micro_batches"] == 6  # 16 rows, 3 a micro-batch
    assert budget[0]["micro_batches"] == 5  # 165 tokens, at most 40 a micro-batch
    assert padded[0]["importance_weight_mean"] != pytest.approx(1.0, abs=1e-3)  # the off-policy weights take part
    assert_same_step(packed, padded)
    assert_same_step(budget, padded)


def test_packed_passes_run_on_the_tokens_alone(model_dir):
    """No compute on padding: every pass is one row, and the training passes see each token once."""
    batch = make_batch(load_hf(model_dir), seed=3)
    seen = {}
    for mode in (False, True):
        tr = DeepSpeedTrainer(model_dir, SGD, **ALGO, loss_agg="token", packing=mode)
        shapes = seen[mode] = []
        tr.engine.module.get_input_embeddings().register_forward_hook(lambda m, args, out, shapes=shapes: shapes.append(args[0].shape))
        try:
            tr.train_step(batch, GROUP)
        finally:
            tr.close()
    tokens = sum(cost(t) for t in batch)
    packed_passes = seen[True][-6:]  # the 6 training passes (after the 6 that recompute the old log-probs)
    assert all(rows == 1 for rows, _ in packed_passes) and sum(n for _, n in packed_passes) == tokens
    assert sum(rows * n for rows, n in seen[False][-6:]) > tokens  # the padded passes also run on padding


def test_the_train_stage_settings_reach_the_trainer_as_its_keyword_arguments():
    from rlflow.compiler import compile_pipeline

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    overrides = ["stages.train.packing=false", "stages.train.micro_batch_tokens=4096",
                 "stages.train.gradient_checkpointing=true"]
    for sets, expected in [([], (True, None, False)), (overrides, (False, 4096, True))]:
        plan = compile_pipeline(os.path.join(repo, "pipelines", "one_step.yaml"), sets)
        (trainer,) = [a for a in plan["actors"] if a["role"] == "trainer"]
        kwargs = trainer["trainer_kwargs"]
        assert (kwargs["packing"], kwargs["micro_batch_tokens"], kwargs["gradient_checkpointing"]) == expected
    assert set(kwargs) <= set(inspect.signature(DeepSpeedTrainer).parameters)


def test_a_packed_row_is_cut_where_its_attention_would_add_a_tenth_and_never_under_flash_attention():
    """sdpa attends over a whole packed row: the bound keeps attention within 10% of the dense layers (never below
    MIN_ROW_TOKENS), none under flash-attention's varlen kernels; shard_batch then cuts by tokens and by rows."""
    from types import SimpleNamespace

    smollm2 = SimpleNamespace(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536)
    llama7b = SimpleNamespace(hidden_size=4096, num_attention_heads=32, num_key_value_heads=32, intermediate_size=11008)
    assert packing.row_token_bound(smollm2, "sdpa") == packing.MIN_ROW_TOKENS  # 307 by the rule
    assert packing.row_token_bound(llama7b, "sdpa") == int(0.1 * (4 * 4096**2 + 3 * 4096 * 11008) / (2 * 4096))
    assert packing.row_token_bound(llama7b, "flash_attention_2") is None
    from rlflow.stages.trajectory import Trajectory

    rows = [Trajectory(group_id=f"g{i // 4}", index=i % 4, prompt="", answer="", prompt_ids=[1] * 10,
                       completion_ids=[2] * 40, behaviour_logprobs=[-1.0] * 40, reward=float(i % 2))
            for i in range(16)]  # 16 rows of 50 tokens: 800 tokens
    assert shard_batch(rows, 1, 16, 300)[0].micro_batches == 3  # by tokens alone
    assert shard_batch(rows, 1, 4, 300, rows_too=True)[0].micro_batches == 4  # the rows' bound is the larger
    assert shard_batch(rows, 1, 16, 300, rows_too=True)[0].micro_batches == 3
