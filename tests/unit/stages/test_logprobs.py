"""Chunked log-probs and entropy (stages/logprobs.py) against the full logits: values and gradients, the hooked
forward, and the trainer with and without chunks (one process, CPU)."""

import pytest
import torch
from test_packing import assert_same_step, gradient_step, stale
from trainer_batches import load_hf, make_batch

from rlflow.stages import grpo
from rlflow.stages.logprobs import TokenLogprobs, chunked_logprobs


def full(head, hidden, targets, temperature):
    logits = head(hidden).float() / temperature
    return grpo.token_logprobs(logits, targets), grpo.entropy_from_logits(logits)


@pytest.mark.parametrize("chunks", [1, 4, 21, 50])  # 21 positions: one a chunk; 50: empty chunks too
def test_chunks_give_the_full_logits_log_probs_entropy_and_gradients(chunks):
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=True)
    hidden = torch.randn(3, 7, 16, requires_grad=True)
    targets = torch.randint(0, 50, (3, 7))
    weights = torch.randn(3, 7)  # a loss that weighs each position differently
    results = []
    for fn in (full, lambda *a: chunked_logprobs(*a, chunks=chunks, entropy=True)):
        head.zero_grad()
        hidden.grad = None
        logprobs, entropy = fn(head, hidden, targets, 0.7)
        (logprobs * weights).sum().backward()
        results.append((logprobs.detach(), entropy, hidden.grad.clone(), head.weight.grad.clone(), head.bias.grad.clone()))
    # the same arithmetic per token; the matmul kernels per chunk size (matrix-vector at 1 row) and the weight gradient
    # summed chunk by chunk round differently: measured <= 1.4e-6 on values up to 11 (1.3e-7 of the largest)
    for want, got in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert not results[1][1].requires_grad  # the entropy is a metric: no graph kept for it


@pytest.mark.parametrize("chunks", [1, 3, 12])  # 9 selected positions: 12 runs leave some empty
def test_selected_positions_equal_the_full_logits_there_and_read_zero_elsewhere(chunks):
    """The trainer asks for its trained positions only: there the values and the gradients they send back equal
    the full logits' (a loss weighted on them alone), elsewhere 0, and the head never sees the other positions."""
    torch.manual_seed(1)
    head = torch.nn.Linear(16, 50)
    hidden = torch.randn(3, 7, 16, requires_grad=True)
    targets = torch.randint(0, 50, (3, 7))
    positions = torch.zeros(3, 7, dtype=torch.bool)
    positions[0, 4:] = positions[2, 1:7] = True  # 3 + 6 positions; row 1 has none (a padding row)
    weights = torch.randn(3, 7) * positions
    seen = []
    head.register_forward_hook(lambda m, args, out: seen.append(args[0].shape[0]))
    results = []
    for fn in (full, lambda *a: chunked_logprobs(*a, chunks=chunks, entropy=True, positions=positions)):
        head.zero_grad()
        hidden.grad = None
        logprobs, entropy = fn(head, hidden, targets, 0.7)
        (logprobs * weights).sum().backward()
        results.append((logprobs.detach() * positions, entropy * positions, hidden.grad.clone(), head.weight.grad.clone()))
    for want, got in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    seen.clear()
    logprobs, entropy = chunked_logprobs(head, hidden, targets, 0.7, chunks, True, positions)
    assert (logprobs[~positions] == 0).all() and (entropy[~positions] == 0).all()
    assert len(seen) == chunks and sum(seen) == 9  # the head ran `chunks` times, on the 9 selected rows alone


def test_the_hooked_forward_returns_the_models_own_log_probs(tiny_llama_dir):
    model = load_hf(tiny_llama_dir)
    tokens = TokenLogprobs(model, chunk_tokens=4)
    ids = torch.tensor([[1, 5, 9, 2, 7, 3, 3, 8], [4, 4, 1, 0, 6, 2, 9, 9]])
    with torch.no_grad():
        hidden = model.model(input_ids=ids).last_hidden_state[:, :-1]
        want = full(model.get_output_embeddings(), hidden, ids[:, 1:], 0.8)
        with tokens.request(ids[:, 1:], 0.8, entropy=True):
            got = model(input_ids=ids, **TokenLogprobs.FORWARD_KWARGS)
        plain = model(input_ids=ids).logits  # outside the block the model is itself again
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got[1], want[1], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grpo.token_logprobs(plain[:, :-1] / 0.8, ids[:, 1:]), want[0], rtol=1e-6, atol=1e-6)


def test_the_trainer_with_chunks_takes_the_step_it_takes_on_full_logits(tiny_llama_dir):
    batch = stale(make_batch(load_hf(tiny_llama_dir), seed=4))
    whole = gradient_step(tiny_llama_dir, batch, loss_agg="token", logit_chunk_tokens=0)
    chunked = gradient_step(tiny_llama_dir, batch, loss_agg="token", logit_chunk_tokens=5)
    assert_same_step(chunked, whole)


def test_logits_transformed_after_the_head_fall_back_to_full_logits(tmp_path):
    """Gemma-2 soft-caps its logits after the lm_head: the chunked head would miss that, so the trainer checks
    at start, warns and trains on the model's own logits."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    config = Gemma2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                          num_key_value_heads=1, head_dim=16, final_logit_softcapping=0.05)
    Gemma2ForCausalLM(config).save_pretrained(tmp_path)
    batch = stale(make_batch(load_hf(tmp_path), seed=4))
    whole = gradient_step(tmp_path, batch, loss_agg="token", logit_chunk_tokens=0)
    with pytest.warns(UserWarning, match="using full logits"):
        fallen_back = gradient_step(tmp_path, batch, loss_agg="token", logit_chunk_tokens=5)
    assert_same_step(fallen_back, whole)
