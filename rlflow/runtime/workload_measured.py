"""The workload block's length figures, measured on what a run trained: what `rlflow simulate` and `rlflow tune`
otherwise assume (workload.mean_length, tailness, prompt_share; rlflow/sim/lengths.py draws them).

Trained batches are biased: filters drop groups (drop_uniform_groups keeps prompts of mixed success), queue-drop
prefers short samples, and max_new_tokens caps the tail. The figures describe what was trained; read them as a
starting point for a tune, not as the model's length law.
"""

from __future__ import annotations

import math

from rlflow.staleness_model import SIGMA_PER_TAILNESS

MEASURED_GROUPS = 4096  # the most recent trained groups the run's figures are measured on (bounded memory)


def prompt_share(groups: list[list[int]]) -> float:
    """The share of log-length variance that lies between groups: the intraclass correlation of ln(length) by
    one-way analysis of variance, (MSB - MSW) / (MSB + (n - 1) MSW) with n the mean group size, clipped to [0, 1] (0
    with fewer than two groups of two, or no variance)."""
    groups = [[math.log(max(1, n)) for n in g] for g in groups if len(g) > 1]
    total = sum(len(g) for g in groups)
    if len(groups) < 2:
        return 0.0
    grand = sum(map(sum, groups)) / total
    means = [sum(g) / len(g) for g in groups]
    msb = sum(len(g) * (m - grand) ** 2 for g, m in zip(groups, means)) / (len(groups) - 1)
    msw = sum((x - m) ** 2 for g, m in zip(groups, means) for x in g) / (total - len(groups))
    n = total / len(groups)
    if msb + (n - 1) * msw <= 0:
        return 0.0
    return min(1.0, max(0.0, (msb - msw) / (msb + (n - 1) * msw)))


def measured_workload(groups: list[list[int]]) -> dict | None:
    """{mean_length, tailness, prompt_share, groups} of trained groups' completion lengths (None with fewer than two
    groups): the mean length, the tailness whose lognormal sigma is the standard deviation of ln(length) (sigma =
    1.3 * tailness / 100), and prompt_share."""
    lengths = [n for g in groups for n in g]
    if len(groups) < 2 or len(lengths) < 2:
        return None
    logs = [math.log(max(1, n)) for n in lengths]
    mu = sum(logs) / len(logs)
    sigma = math.sqrt(sum((x - mu) ** 2 for x in logs) / (len(logs) - 1))
    return {"mean_length": round(sum(lengths) / len(lengths), 1), "tailness": round(sigma / SIGMA_PER_TAILNESS, 1),
            "prompt_share": round(prompt_share(groups), 2), "groups": len(groups)}


def as_overrides(measured: dict) -> str:
    """The figures as `--set` overrides for rlflow simulate / tune."""
    return " ".join(f"--set workload.{k}={measured[k]:g}" for k in ("mean_length", "tailness", "prompt_share"))
