"""Reward functions the integration tests reference by import string."""


def flaky_exact(completion: str, answer: str) -> float:
    """exact_match, but raises for answers containing the letter 'a' (a buggy user reward)."""
    if "a" in answer:
        raise RuntimeError(f"cannot score answer {answer!r}")
    return 1.0 if completion.strip() == answer.strip() else 0.0
