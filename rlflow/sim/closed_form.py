"""The closed-form comparison mode: configs in the model's terms (rho, q, tailness, C/B) and its prediction."""

from __future__ import annotations

from rlflow.sim.config import LengthSpec, SimConfig, TrainerModel
from rlflow.sim.lengths import expected_length, group_tail_multiplier
from rlflow.staleness_model import StalenessPrediction, predict_mean_staleness


def utilization(config: SimConfig) -> float:
    """rho = v_R / v_T with v_R = C * s_R and v_T = B * E[L] / t_step (slots mode)."""
    mean = expected_length(config.lengths)
    batch_tokens = config.batch_samples * (mean + config.prompt_tokens)
    v_t = config.batch_samples * mean / config.trainer.step_time(batch_tokens)
    return config.slots * config.speed / v_t


def closed_form_prediction(config: SimConfig) -> StalenessPrediction | None:
    """Predicted mean staleness where the closed form applies: slots mode, queue_drop with q = Q/B >= 1."""
    if config.mode != "slots" or config.policy != "queue_drop" or config.capacity is None:
        return None
    q = config.capacity / config.batch_groups
    if q < 1:
        return None
    return predict_mean_staleness(
        rho=utilization(config),
        concurrency=config.slots,
        batch=config.batch_samples,
        tail=group_tail_multiplier(config.lengths, config.group_size),
        queue_factor=q,
    )


def closed_form_config(
    *,
    rho: float,
    q: float | None,
    tailness: float,
    c_over_b: float,
    batch_groups: int = 16,
    group_size: int = 8,
    mean_length: float = 1000.0,
    cap_factor: float = 8.0,
    speed: float = 100.0,
    steps: int = 300,
    warmup_steps: int = 50,
    seed: int = 0,
    policy: str = "queue_drop",
    eta: int | None = None,
) -> SimConfig:
    """A slots-mode run at utilization `rho`, queue factor `q` (None: no capacity), `tailness`, C = c_over_b * B.

    t_step is chosen so that v_R / v_T = rho; lengths are lognormal, capped at cap_factor * E[L].
    """
    batch = batch_groups * group_size
    slots = max(1, round(c_over_b * batch))
    lengths = LengthSpec(
        kind="lognormal" if tailness > 0 else "fixed",
        mean=mean_length,
        tailness=tailness,
        cap=int(cap_factor * mean_length),
    )
    mean = expected_length(lengths)
    t_step = rho * batch * mean / (slots * speed)  # v_T = B E[L] / t_step = v_R / rho
    return SimConfig(
        mode="slots",
        slots=slots,
        speed=speed,
        lengths=lengths,
        group_size=group_size,
        batch_groups=batch_groups,
        policy=policy,
        eta=eta,
        capacity=None if q is None else round(q * batch_groups),
        trainer=TrainerModel(t_step=t_step),
        steps=steps,
        warmup_steps=warmup_steps,
        seed=seed,
    )
