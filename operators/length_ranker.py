"""Output-length rankers for skew-aware dispatch (StreamRL §5.2): an oracle and an online-refit linear model."""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Sequence

import numpy as np


class OracleRanker:
    """True lengths, for experiments: `lookup(prompt)` returns the length the prompt will produce."""

    def __init__(self, lookup: Callable[[object], float] | dict):
        self._lookup = lookup.__getitem__ if isinstance(lookup, dict) else lookup

    def predict(self, prompts: Sequence) -> list[float]:
        return [float(self._lookup(p)) for p in prompts]

    def observe(self, prompts: Sequence, lengths: Sequence[float]) -> None:
        """Nothing to learn."""


def features(prompt: str, dim: int = 1024, n: int = 3) -> np.ndarray:
    """Hashed character n-gram counts (1..n), plus log character and word counts and a bias."""
    x = np.zeros(dim + 3)
    text = str(prompt)
    for k in range(1, n + 1):
        for j in range(len(text) - k + 1):
            x[zlib.crc32(text[j:j + k].encode()) % dim] += 1.0
    norm = math.sqrt(float(x[:dim] @ x[:dim])) or 1.0
    x[:dim] /= norm
    x[dim] = math.log1p(len(text))
    x[dim + 1] = math.log1p(len(text.split()))
    x[dim + 2] = 1.0
    return x


class OnlineLengthRanker:
    """Ridge regression of log(length) on prompt features, refit from completed (prompt, length) pairs.

    StreamRL fine-tunes a small LLM (§5.2); a linear model stands in, refit online every `refit_every`
    observations over a sliding window of the most recent `window` pairs (the distribution drifts).
    """

    def __init__(self, dim: int = 1024, ridge: float = 1.0, window: int = 8192, refit_every: int = 256):
        self.dim, self.ridge, self.window, self.refit_every = dim, ridge, window, refit_every
        self._X: list[np.ndarray] = []
        self._y: list[float] = []
        self._since = 0
        self._w: np.ndarray | None = None
        self.fits = 0  # refits so far: predictions change only when this does

    def observe(self, prompts: Sequence, lengths: Sequence[float]) -> None:
        for p, n in zip(prompts, lengths):
            self._X.append(features(p, self.dim))
            self._y.append(math.log(max(1.0, float(n))))
        del self._X[:-self.window], self._y[:-self.window]
        self._since += len(prompts)
        if self._w is None or self._since >= self.refit_every:
            self.fit()

    def fit(self) -> None:
        X, y = np.asarray(self._X), np.asarray(self._y)
        A = X.T @ X + self.ridge * np.eye(X.shape[1])
        self._w = np.linalg.solve(A, X.T @ y)
        self._since = 0
        self.fits += 1

    def predict(self, prompts: Sequence) -> list[float]:
        if self._w is None:
            return [0.0] * len(prompts)  # nothing learned yet: all equal, dispatch keeps input order
        return [float(math.exp(features(p, self.dim) @ self._w)) for p in prompts]


def recall_at_top(predicted: Sequence[float], actual: Sequence[float], fraction: float = 0.2) -> float:
    """Share of the truly longest `fraction` that the ranker also places in its top `fraction` (§7.2, Table 4)."""
    k = max(1, int(round(fraction * len(actual))))
    top_true = set(sorted(range(len(actual)), key=lambda j: (-actual[j], j))[:k])
    top_pred = set(sorted(range(len(predicted)), key=lambda j: (-predicted[j], j))[:k])
    return len(top_true & top_pred) / k
