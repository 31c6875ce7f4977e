"""The trainer's memory options on a tiny Llama (one process, CPU): gradient checkpointing, ZeRO-3 building the
model partitioned, and the lm_head chunks under ZeRO-3 (the reference model's partitioning: test_trainer.py)."""

import numpy as np
import pytest
import torch
from test_packing import SGD, assert_same_step, gradient_step, stale
from trainer_batches import GROUP, build_tiny_llama, build_tiny_qwen2, load_hf, make_batch

from rlflow.stages.deepspeed_setup import load_model
from rlflow.stages.trainer import DeepSpeedTrainer

ZERO3 = {**SGD, "zero_optimization": {"stage": 3}, "zero_allow_untested_optimizer": True}
ALGO = dict(clip_low=0.2, clip_high=0.28, loss_agg="token", max_importance_ratio=5.0)


def test_gradient_checkpointing_recomputes_each_layer_and_keeps_the_step(tiny_llama_dir):
    batch = stale(make_batch(load_hf(tiny_llama_dir), seed=5))
    calls = {}
    for on in (False, True):
        tr = DeepSpeedTrainer(tiny_llama_dir, SGD, lr=1.0, kl_coef=0.0, packing=True, gradient_checkpointing=on, **ALGO)
        count = calls[on] = []
        # a pre-hook: the recompute stops early, once it has what backward needs, so the layer's forward never returns
        tr.engine.module.model.layers[0].register_forward_pre_hook(lambda *_, count=count: count.append(1))
        try:
            micro = tr.train_step(batch, GROUP)["micro_batches"]
        finally:
            tr.close()
    # per micro-batch: the training pass (it also gives pi_old's log-probs), plus, checkpointed, backward's recompute
    assert (len(calls[False]), len(calls[True])) == (micro, 2 * micro)
    assert_same_step(gradient_step(tiny_llama_dir, batch, loss_agg="token", packing=True, gradient_checkpointing=True),
                     gradient_step(tiny_llama_dir, batch, loss_agg="token", packing=True))


@pytest.mark.parametrize("build", [build_tiny_llama, build_tiny_qwen2])  # Qwen2: tied embeddings
def test_zero3_builds_the_model_partitioned_with_the_checkpoints_weights(build, tmp_path):
    model_dir = build(tmp_path)
    tr = DeepSpeedTrainer(model_dir, ZERO3, lr=1.0, kl_coef=0.0, **ALGO)  # joins the process group zero.Init needs
    try:
        state = tr.state_numpy()
    finally:
        tr.close()
    model = load_model(model_dir, ZERO3)
    # no rank holds a whole parameter: outside a gather each is an empty placeholder for its partition
    assert all(hasattr(p, "ds_id") and p.numel() == 0 and p.ds_numel > 0 for p in model.parameters())
    expected = load_hf(model_dir).state_dict()
    assert set(state) == set(expected)
    for name, value in expected.items():
        np.testing.assert_array_equal(state[name], value.numpy(), err_msg=name)


def test_zero3_with_packing_checkpointing_and_chunks_takes_the_plain_step(tiny_llama_dir):
    """Everything at once under ZeRO-3 (the lm_head gathered for each chunk, recomputed chunks and layers included)
    against ZeRO-0 on padded rows and full logits."""
    batch = stale(make_batch(load_hf(tiny_llama_dir), seed=6))
    plain = gradient_step(tiny_llama_dir, batch, loss_agg="token", logit_chunk_tokens=0)
    torch.manual_seed(0)
    tr = DeepSpeedTrainer(tiny_llama_dir, ZERO3, lr=1.0, kl_coef=0.0, packing=True, gradient_checkpointing=True,
                          logit_chunk_tokens=5, **ALGO)
    initial = {k: v.detach().numpy().copy() for k, v in load_hf(tiny_llama_dir).state_dict().items()}
    try:
        metrics = tr.train_step(batch, GROUP)
        after = tr.state_numpy()
    finally:
        tr.close()
    assert_same_step((metrics, {k: initial[k] - after[k] for k in after}), plain)


def test_every_pass_of_a_step_runs_the_lm_head_as_often(tiny_llama_dir):
    """ZeRO-3 gathers the lm_head weight for each chunk, a collective: a rank must not run fewer chunks because its
    micro-batch is shorter (ranks would wait on each other for good). The count per pass is the step's, not the pass's."""
    batch = make_batch(load_hf(tiny_llama_dir), seed=3)
    tr = DeepSpeedTrainer(tiny_llama_dir, SGD, lr=1.0, kl_coef=0.0, packing=True, micro_batch_tokens=40,
                          logit_chunk_tokens=5, **ALGO)
    passes = []
    tr.engine.module.register_forward_pre_hook(lambda *_: passes.append([0]))
    # chunks are [positions, hidden]; the forward's own logits of its last position are [B, 1, hidden]
    tr.engine.module.get_output_embeddings().register_forward_pre_hook(
        lambda m, args: passes[-1].__setitem__(0, passes[-1][0] + (args[0].dim() == 2)))
    lengths, made = [], []
    tr.engine.module.get_input_embeddings().register_forward_hook(lambda m, args, out: lengths.append(args[0].shape[1]))
    cut = tr._micro_batches

    def keep(shard):  # the step's micro-batches, as the trainer cut them
        made.extend(cut(shard))
        return made
    tr._micro_batches = keep
    try:
        tr.train_step(batch, GROUP)
    finally:
        tr.close()
    trained = [int(mb.mask.sum()) for mb in made]
    assert len(set(lengths)) > 1 and len(set(trained)) > 1  # micro-batches of different lengths...
    # ...each through the lm_head (on its trained positions) in as many chunks as the one with the most needs:
    chunks = -(-max(trained) // 5)
    # the training passes only (pi_old's log-probs are theirs, detached); backward recomputes each chunk
    assert [n for (n,) in passes] == [2 * chunks] * len(passes) and len(passes) == len(lengths) > 1
