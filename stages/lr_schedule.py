"""The learning-rate schedule of a train stage (`lr_schedule`: constant or cosine, with warmup), as a factor of its
`lr`; stages/trainer.py sets it on the optimizer before each step."""

from __future__ import annotations

import math


def lr_factor(schedule: dict | None, step: int) -> float:
    """The learning rate of optimizer step `step` (0-based) as a fraction of the stage's `lr`.

    schedule: {"kind": "constant"|"cosine", "warmup_steps": W, "min_ratio": m, "total_steps": T} (None: constant).
    Warmup: (step + 1) / W for the first W steps, so the first step already moves. Cosine: from 1 after warmup
    down to m at the last step, T - 1. Set by hand before each optimizer step from the trainer's version (which
    the checkpoint keeps), not by a DeepSpeed scheduler: DeepSpeed's run their first step at a rate of 0.
    """
    if not schedule:
        return 1.0
    kind, warmup = schedule.get("kind", "constant"), int(schedule.get("warmup_steps", 0))
    if step < warmup:
        return (step + 1) / warmup
    if kind == "constant":
        return 1.0
    if kind == "cosine":
        span = max(1, int(schedule["total_steps"]) - 1 - warmup)
        progress = min(1.0, (step - warmup) / span)
        low = float(schedule.get("min_ratio", 0.1))
        return low + (1.0 - low) * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"lr_schedule kind must be 'constant' or 'cosine', got {kind!r}")
