"""Built-in reward functions (`fn:` of a reward stage): (completion, answer) -> float in [0, 1]."""

from __future__ import annotations


def exact_match(completion: str, answer: str) -> float:
    """1.0 if the completion, stripped, equals the answer."""
    return 1.0 if completion.strip() == str(answer).strip() else 0.0


def numeric_close(completion: str, answer: str) -> float:
    """1.0 for the exact number, partial credit decaying with relative error, 0.0 for non-numbers."""
    try:
        got, want = float(completion.strip()), float(answer)
    except ValueError:
        return 0.0
    if got == want:
        return 1.0
    return max(0.0, 1.0 - abs(got - want) / max(abs(want), 1.0)) * 0.5
