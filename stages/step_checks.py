"""What a training step checks and decides around the math: the batch it is given is well formed, the loss
aggregation it is asked for is complete, a non-finite step is held (never applied) and its verdict is named, so that
weights that are not finite are never published or checkpointed (stages/trainer.py)."""

from __future__ import annotations

import contextlib
import math

from rlflow.stages import loss_agg
from rlflow.stages.trajectory import Trajectory


@contextlib.contextmanager
def optimizer_held(optimizer):
    """The optimizer's step does nothing inside: weights and moments stay as they are (not even Adam's decay of
    its moments by a zero gradient, which would still move the weights)."""
    optimizer.step = lambda *args, **kwargs: None
    try:
        yield
    finally:
        del optimizer.step


def nonfinite_verdict(loss: float, grad_norm: float | None, applied: bool, weights_finite: bool) -> str:
    """One rank's step: "" (finite), "skipped" (a non-finite loss or gradient, not applied) or "poisoned" (the
    weights are not finite after it: never publish or checkpoint them)."""
    if not weights_finite:
        return "poisoned"
    finite = math.isfinite(loss) and (grad_norm is None or math.isfinite(grad_norm))
    return "" if finite and applied else "skipped"


NONFINITE_ORDER = ("", "skipped", "poisoned")


def check_batch(trajectories: list[Trajectory], group_size: int) -> None:
    """Groups of at most group_size (fewer when a reward failed), every member rewarded, one log-prob per token."""
    if not trajectories:
        raise ValueError("train_step needs at least one group of trajectories")
    counts: dict[str, int] = {}
    for t in trajectories:
        counts[t.group_id] = counts.get(t.group_id, 0) + 1
        if t.reward is None:
            raise ValueError(f"trajectory {t.traj_id} reached the trainer without a reward (reward stage bug)")
        if len(t.behaviour_logprobs) != len(t.completion_ids):
            raise ValueError(
                f"trajectory {t.traj_id}: {len(t.behaviour_logprobs)} behaviour log-probs for "
                f"{len(t.completion_ids)} completion tokens"
            )
        if not t.prompt_ids:
            raise ValueError(f"trajectory {t.traj_id} has an empty prompt")
    wrong = {g: n for g, n in counts.items() if n > group_size}
    if wrong:
        raise ValueError(f"groups may have at most group_size={group_size} members; got {wrong}")


def loss_agg_mode_of(name: str, max_new_tokens: int | None) -> str:
    """The aggregation mode `name` spells (stages/loss_agg.py), checked: seq-mean-token-sum-norm needs its L."""
    mode = loss_agg.canonical(name)
    if mode == "seq-mean-token-sum-norm" and not max_new_tokens:
        raise ValueError("loss_agg seq-mean-token-sum-norm divides by the generation budget: pass max_new_tokens")
    return mode
