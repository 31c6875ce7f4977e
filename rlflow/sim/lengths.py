"""Response lengths: fixed, lognormal by tailness (docs/concepts/staleness.md), or recorded from a run.

A group's lengths are independent draws, unless a share of the log-length variance is the prompt's
(`prompt_share`): ln L = ln m - sigma^2 / 2 + sigma (sqrt(share) z_prompt + sqrt(1 - share) z_sample), one z_prompt
per group. Each length has the same lognormal law either way; only how alike a group's lengths are changes.
StreamRL §5.1 ("difficulty is a property inherent to the prompts") is the premise of its length ranker, and its
evaluation (§7) generates every sample of a prompt to that prompt's ground-truth length: share 1.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from rlflow.sim.config import LengthSpec, SimConfigError
from rlflow.staleness_model import lognormal_sigma, tail_multiplier

_CHUNK = 8192  # lengths are drawn in bulk; one numpy call per chunk, not per sample


def load_recorded(path: str | Path) -> np.ndarray:
    """Recorded lengths: one integer per line, or a JSON list of integers."""
    text = Path(path).read_text().strip()
    if text.startswith("["):
        values = json.loads(text)
    else:
        values = [line for line in text.splitlines() if line.strip()]
    lengths = np.asarray([int(v) for v in values], dtype=np.int64)
    if lengths.size == 0 or lengths.min() < 1:
        raise SimConfigError(f"lengths.path: {path} must hold at least one length, all >= 1 token")
    return lengths


class LengthSampler:
    """Draws integer lengths from a LengthSpec with its own seeded generator."""

    def __init__(self, spec: LengthSpec, rng: np.random.Generator):
        self.spec = spec
        self._rng = rng
        self._recorded = load_recorded(spec.path) if spec.kind == "file" else None
        self._buf: list[int] = []

    def draw_group(self, n: int) -> list[int]:
        """The n lengths of one prompt's group: `draw` when they are independent, else with one prompt factor."""
        spec = self.spec
        if not spec.prompt_share or spec.kind != "lognormal" or spec.tailness == 0:
            return self.draw(n)
        z = (math.sqrt(spec.prompt_share) * self._rng.standard_normal()
             + math.sqrt(1 - spec.prompt_share) * self._rng.standard_normal(n))
        return self._lognormal(z).tolist()

    def draw(self, n: int) -> list[int]:
        while len(self._buf) < n:  # _buf is a stack: the next length is at the end
            self._buf = self._chunk().tolist()[::-1] + self._buf
        return [self._buf.pop() for _ in range(n)]

    @property
    def max_length(self) -> int | None:
        if self._recorded is not None:
            return int(self._recorded.max())
        if self.spec.kind == "fixed":
            return int(round(self.spec.mean))
        return self.spec.cap

    def _chunk(self) -> np.ndarray:
        spec = self.spec
        if spec.kind == "file":
            return self._rng.choice(self._recorded, size=_CHUNK)
        if spec.kind == "fixed" or spec.tailness == 0:
            return self._bounded(np.full(_CHUNK, round(spec.mean), dtype=np.int64))
        return self._lognormal(self._rng.standard_normal(_CHUNK))

    def _lognormal(self, z: np.ndarray) -> np.ndarray:
        """Lengths from standard normals: mean * exp(sigma z - sigma^2 / 2), rounded, capped, at least 1."""
        sigma = lognormal_sigma(self.spec.tailness)
        return self._bounded(np.rint(self.spec.mean * np.exp(sigma * z - sigma * sigma / 2)).astype(np.int64))

    def _bounded(self, out: np.ndarray) -> np.ndarray:
        if self.spec.cap is not None:
            out = np.minimum(out, self.spec.cap)
        return np.maximum(out, 1)


def expected_length(spec: LengthSpec) -> float:
    """E[L] of the lengths actually drawn (after capping); rounding is ignored."""
    if spec.kind == "file":
        return float(load_recorded(spec.path).mean())
    sigma = lognormal_sigma(spec.tailness) if spec.kind == "lognormal" else 0.0
    if sigma == 0 or spec.cap is None:
        return min(spec.mean, spec.cap) if spec.cap is not None else spec.mean
    # E[min(L, c)] for L = m exp(sigma z - sigma^2/2): m Phi(a - sigma) + c (1 - Phi(a)), a = (ln(c/m) + sigma^2/2) / sigma
    a = (math.log(spec.cap / spec.mean) + sigma * sigma / 2) / sigma
    phi = lambda x: 0.5 * (1 + math.erf(x / math.sqrt(2)))
    return spec.mean * phi(a - sigma) + spec.cap * (1 - phi(a))


def group_tail_multiplier(spec: LengthSpec, group_size: int) -> float:
    """M_tail = E[max over a group] / E[L] for the spec (recorded lengths: exact order statistics)."""
    if spec.kind == "file":
        values = np.sort(load_recorded(spec.path)).astype(float)
        n = values.size
        # P(max of S draws with replacement = k-th smallest) = (k/n)^S - ((k-1)/n)^S
        k = np.arange(1, n + 1)
        weights = (k / n) ** group_size - ((k - 1) / n) ** group_size
        return float(weights @ values / values.mean())
    if spec.kind == "fixed" or spec.tailness == 0:
        return 1.0
    return tail_multiplier(spec.tailness, group_size, cap=spec.cap, mean=spec.mean, prompt_share=spec.prompt_share)
