"""Calling a user's reward function safely, inside the reward stream's Score actors (reward_stream.py).

Each call runs in the Score actor's child process (reward_process.py). A call fails that trajectory (not the
stream) when it raises ("<fn> raised <Type>: <msg>"), returns something that is not a finite number ("<fn> returned
'yes' (str), not a number", "... returned nan"), runs longer than REWARD_TIMEOUT_S ("<fn> timed out after 30 s";
the child is killed) or kills its process twice on the same row ("<fn> killed its process (exit code 1) ...": a
poison row; one death is retried in a new child, so a process lost to something else costs nothing).
Two rules stop the stage, with ("error", stage, RewardStageFailing), and so the run: TIMEOUTS_IN_A_ROW timeouts in a
row in one actor (a reward that hangs on every row stops in a few timeouts, not after a window of them), and more
than MAX_FAILED_FRACTION of the last FAILURE_WINDOW trajectories failed (FailureRate: a reward that fails on most
calls would otherwise starve the buffer forever).
"""

from __future__ import annotations

import collections
import inspect
import math

from rlflow.errors import PipelineInvalid, Problem

# One reward call may take this long; past it the trajectory fails with "timed out after 30 s" and the child process
# running the call is killed (a sleep, a C call or a Python loop alike).
REWARD_TIMEOUT_S = 30.0
# A Score actor whose last TIMEOUTS_IN_A_ROW calls (across bundles) all timed out stops its stage
# ("reward-hangs"): one hanging row fails only its trajectory, a reward that hangs on every row stops the run
# after TIMEOUTS_IN_A_ROW x REWARD_TIMEOUT_S.
TIMEOUTS_IN_A_ROW = 3
# A reward stage stops the run when more than MAX_FAILED_FRACTION of its last FAILURE_WINDOW trajectories failed
# (judged once it has scored FAILURE_WINDOW): a reward that fails on every call would otherwise run forever.
FAILURE_WINDOW = 64
MAX_FAILED_FRACTION = 0.5


def reward_caller(fn):
    """fn(completion, answer[, prompt=][, row=]) as call(completion, answer, prompt, row): passes the extra
    keywords only when fn's signature accepts them (by name, or through **kwargs)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # no signature (some builtins): the two-argument form
        params = []
    names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    takes_any = any(p.kind == p.VAR_KEYWORD for p in params)
    extra = [k for k in ("prompt", "row") if takes_any or k in names]

    def call(completion: str, answer: str, prompt: str, row: dict):
        given = {"prompt": prompt, "row": row}
        return fn(completion, answer, **{k: given[k] for k in extra})

    return call


def filter_verdict(fn, rewards: list[float], errors: list[str]) -> bool:
    """Keep a group? Judged on its members that scored; a group with none is dropped."""
    ok = [r for r, e in zip(rewards, errors, strict=True) if not e]
    return bool(ok) and (fn is None or bool(fn(ok)))


class RewardTimeout(Exception):
    """A reward call ran past its timeout (its process was killed)."""


def as_reward(value) -> float:
    """A reward function's result as a float: a finite real number (bool counts as 0/1; numpy and 0-d torch
    scalars convert). Else ValueError saying what it was."""
    if isinstance(value, (str, bytes)) or value is None or not hasattr(type(value), "__float__"):
        shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
        raise ValueError(f"returned {shown} ({type(value).__name__}), not a number")
    try:
        r = float(value)
    except (TypeError, ValueError, RuntimeError) as err:  # e.g. a tensor of several elements
        raise ValueError(f"returned a {type(value).__name__} that is not one number ({err})") from None
    if not math.isfinite(r):
        raise ValueError(f"returned {r}, not a finite number")
    return r


def first_line(e: BaseException) -> str:
    """An exception's message in one line of at most 200 characters."""
    text = (str(e).splitlines() or [""])[0]
    return text if len(text) <= 200 else text[:197] + "..."


def excerpt(text: str, n: int = 40) -> str:
    """The start of a prompt, quoted, for a message that names a row."""
    return repr(text if len(text) <= n else text[:n - 3] + "...")


class RewardStageFailing(PipelineInvalid, RuntimeError):
    """A reward stage fails on too many trajectories: its reward function is broken (stops the run). A
    RuntimeError whose str() is one line (what failed; the way out); render() gives the exit-2 form naming
    stages.<stage>.fn."""

    def __str__(self) -> str:
        (p,) = self.problems
        return f"{p.message}; {p.fix}"


class FailureRate:
    """Failed / scored over a reward stage's last `window` trajectories."""

    def __init__(self, stage: str, window: int = FAILURE_WINDOW, max_fraction: float = MAX_FAILED_FRACTION):
        self.stage, self.max_fraction = stage, max_fraction
        self.recent: collections.deque = collections.deque(maxlen=window)
        self.last_error = ""

    def add(self, errors: list[str]) -> None:
        for err in errors:
            self.recent.append(bool(err))
            self.last_error = err or self.last_error

    def too_high(self) -> bool:
        return len(self.recent) == self.recent.maxlen and sum(self.recent) > self.max_fraction * len(self.recent)

    def error(self, source: str, fn_ref: str) -> RewardStageFailing:
        failed, n = sum(self.recent), len(self.recent)
        message = f"{failed} of the last {n} trajectories failed (last: {self.last_error})"
        return RewardStageFailing(source, [Problem(("stages", self.stage, "fn"), message, "reward-failing",
                                                   f"fix the reward function '{fn_ref}': it must return a finite "
                                                   f"number within {REWARD_TIMEOUT_S:g} s (try it on a few rows)")])


def hang_error(source: str, stage: str, fn_ref: str, message: str, timeout_s: float) -> RewardStageFailing:
    """Reward stage `stage` stops: its reward timed out TIMEOUTS_IN_A_ROW times in a row (`message` says where)."""
    return RewardStageFailing(source, [Problem(("stages", stage, "fn"), message, "reward-hangs",
                                               f"fix the reward function '{fn_ref}': it must return within "
                                               f"{timeout_s:g} s (try it on that row)")])
