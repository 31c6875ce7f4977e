"""Built-in verifiable tasks (`data.source: builtin:<name>`): prompts whose answers vary in length.

Each task is a function (seed, count) -> list of {"prompt", "answer"} rows; pure Python, no download.
"""

from __future__ import annotations

import random


def arith(seed: int = 0, count: int = 1024) -> list[dict]:
    """Sums of two numbers of 1-2 digits: `12+7=` -> `19`. Small enough for a 0.6M-param model to half-learn
    in a minute of warm start, so RL has signal to improve on."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        a, b = (rng.randint(0, 10 ** rng.randint(1, 2) - 1) for _ in range(2))
        rows.append({"prompt": f"{a}+{b}=", "answer": str(a + b)})
    return rows


def repeat(seed: int = 0, count: int = 1024) -> list[dict]:
    """Repeat a short word n times: `ab*5=` -> `ab ab ab ab ab`. Lengths are long-tailed in n."""
    rng = random.Random(seed)
    letters = "abcdefghij"
    rows = []
    for _ in range(count):
        word = "".join(rng.choice(letters) for _ in range(rng.randint(1, 3)))
        n = min(1 + int(rng.lognormvariate(0.8, 0.7)), 16)
        rows.append({"prompt": f"{word}*{n}=", "answer": " ".join([word] * n)})
    return rows
