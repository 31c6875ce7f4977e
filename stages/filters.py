"""Built-in group filters (`filter:` of a streaming edge): group rewards -> keep?"""

from __future__ import annotations


def drop_uniform_groups(rewards: list[float]) -> bool:
    """DAPO dynamic sampling: keep a group only if its rewards differ (equal rewards carry no GRPO signal)."""
    return len(set(rewards)) > 1
