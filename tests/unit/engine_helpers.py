"""Helpers shared by the rollout-engine tests (HFEngine and VLLMEngine): prompts, reference log-probs, weights."""

from __future__ import annotations

import numpy as np
import torch

from rlflow.stages import tasks
from rlflow.stages.trajectory import Trajectory


def trajectories(tokenizer, rows: list[dict], group: str = "g") -> list[Trajectory]:
    return [
        Trajectory(group_id=f"{group}{i}", index=0, prompt=r["prompt"], answer=r["answer"], prompt_ids=tokenizer(r["prompt"])["input_ids"])
        for i, r in enumerate(rows)
    ]


def mixed_rows(n: int = 12) -> list[dict]:
    """Prompts of several lengths: repeat prompts, sums, and sums chained into longer prompts."""
    sums = tasks.arith(21, n)
    rows = [row for pair in zip(tasks.repeat(21, n // 2), sums[: n // 2]) for row in pair]
    for i, row in enumerate(rows[1::4]):  # every other sum grows by 1-3 more terms
        extra = "+".join(s["prompt"].rstrip("=") for s in sums[n // 2: n // 2 + 1 + i % 3])
        row["prompt"] = row["prompt"].rstrip("=") + "+" + extra + "="
    return rows


def run_to_idle(engine, limit: int = 200) -> list[Trajectory]:
    done: list[Trajectory] = []
    for _ in range(limit):
        if engine.idle:
            return done
        done.extend(engine.step())
    raise AssertionError("engine did not go idle")


def reference_logprobs(model, traj: Trajectory, temperature: float) -> list[float]:
    """log-softmax(logits / T) at each completion token, from one unbatched forward pass."""
    ids = torch.tensor([traj.prompt_ids + traj.completion_ids])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    logp = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
    start = len(traj.prompt_ids) - 1
    return [logp[start + j, token].item() for j, token in enumerate(traj.completion_ids)]


def perturbed_state(model, seed: int = 7) -> dict[str, np.ndarray]:
    """A different policy: every weight plus seeded noise, as read-only numpy arrays (like zero-copy Ray gets)."""
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for name, tensor in model.state_dict().items():
        array = (tensor + 0.05 * torch.randn(tensor.shape, generator=gen)).numpy()
        array.flags.writeable = False
        state[name] = array
    return state
