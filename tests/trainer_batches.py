"""Tiny Llama and Qwen2 models and a batch of grouped trajectories for trainer tests (unit: one process;
integration: ranks)."""

from __future__ import annotations

import random

import torch

from rlflow.stages import grpo
from rlflow.stages.trajectory import Trajectory

VOCAB, GROUP, REWARDED = 64, 4, 7  # reward 1 when token 7 appears in the completion


def build_tiny_llama(path) -> str:
    """A randomly initialised 2-layer Llama (vocab 64) saved to `path`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=128, tie_word_embeddings=False,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(path)
    return str(path)


def build_tiny_qwen2(path) -> str:
    """A randomly initialised 2-layer Qwen2 (vocab 64, q/k/v biases, grouped KV heads, tied embeddings) saved to `path`."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True,
    )  # fmt: skip
    Qwen2ForCausalLM(config).save_pretrained(path)
    return str(path)


def load_hf(model_dir, state=None):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if state is not None:
        model.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()}, strict=True)
    return model


def completion_logprobs(model, traj, temperature=1.0):
    """Per-token log-probs of traj's completion under `model`, from an unpadded forward (the sampler's view)."""
    ids = torch.tensor([traj.prompt_ids + traj.completion_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(traj.prompt_ids) - 1 : -1]
    return grpo.token_logprobs(logits, torch.tensor(traj.completion_ids), temperature)


def mean_logprob(model, batch, rewarded: bool) -> float:
    """Mean summed completion log-prob under `model` of the batch's rewarded (or unrewarded) trajectories."""
    return sum(completion_logprobs(model, t).sum().item() for t in batch if (t.reward == 1.0) == rewarded) / sum(
        1 for t in batch if (t.reward == 1.0) == rewarded)


def make_batch(model, n_groups=4, seed=0, temperature=1.0, max_len=11):
    """Groups of GROUP random completions of varied length, on-policy behaviour log-probs, toy reward."""
    rng = random.Random(seed)
    trajs = []
    for g in range(n_groups):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(3, 7))]
        for i in range(GROUP):
            completion = [rng.choice([t for t in range(VOCAB) if t != REWARDED]) for _ in range(rng.randrange(4, max_len))]
            if i % 2 == 0:  # half of each group is rewarded, so every group carries signal
                completion[rng.randrange(len(completion))] = REWARDED
            t = Trajectory(group_id=f"g{seed}-{g}", index=i, prompt="", answer="", prompt_ids=prompt,
                           completion_ids=completion, reward=float(REWARDED in completion))  # fmt: skip
            t.behaviour_logprobs = completion_logprobs(model, t, temperature).tolist()
            trajs.append(t)
    return trajs
