"""Calling a user's reward function safely, inside the reward stream's Score actors (reward_stream.py).

Each call runs in the Score actor's child process (reward_process.py). A call fails that trajectory (not the
stream) when it raises ("<fn> raised <Type>: <msg>"), returns something that is not a finite number ("<fn> returned
'yes' (str), not a number", "... returned nan"), runs longer than REWARD_TIMEOUT_S ("<fn> timed out after 30 s";
the child is killed) or kills its process twice on the same row ("<fn> killed its process (exit code 1) ...": a
poison row; one death is retried in a new child, so a process lost to something else costs nothing).
Two rules stop the stage, with StreamFailed(stage, RewardStageFailing), and so the run: TIMEOUTS_IN_A_ROW timeouts in a
row in one actor (a reward that hangs on every row stops in a few timeouts, not after a window of them), and the
failure rate (FailureRate, counted per answer, i.e. per trajectory scored): every one of the last DEAD_WINDOW answers
failed (a dead reward stops within its first groups), or more than MAX_FAILED_FRACTION of the last FAILURE_WINDOW
(a reward that fails on most calls would otherwise starve the buffer forever). A failed answer is never retried: it is
recorded `failed` in the ledger and its group trains on the members that scored (buffer.py rewarded).
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
# A reward stage stops the run when every one of its last DEAD_WINDOW answers failed, or more than MAX_FAILED_FRACTION
# of its last FAILURE_WINDOW (judged once it has scored that many). A reward failing on 30% of answers never trips
# either (more than half of 512 is 10 standard deviations away, 64 in a row 0.3^64), while a dead one stops after
# DEAD_WINDOW answers, its first few groups. The old rule, more than half of the last 64, tripped on 30% failures:
# P(33+ of 64) = 2.5e-4, but checked after every batch of a run of thousands of answers (issue #45: 1 run in 3).
DEAD_WINDOW = 64
FAILURE_WINDOW = 512
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
    """A reward stage fails on too many trajectories, hangs, or its reward no longer loads (stops the run). A
    RuntimeError whose str() is one line (what failed; the way out [rule]); render() gives the exit-2 form naming
    stages.<stage>.fn."""

    def __str__(self) -> str:
        (p,) = self.problems
        return f"{p.message}; {p.fix} [{p.rule}]"


class FailureRate:
    """The failed answers of a reward stage, counted per answer (trajectory scored) over its last `window`;
    `too_high` once the last `dead` all failed or more than `max_fraction` of a full window did."""

    def __init__(self, stage: str, window: int = FAILURE_WINDOW, max_fraction: float = MAX_FAILED_FRACTION,
                 dead: int = DEAD_WINDOW):
        self.stage, self.max_fraction, self.dead = stage, max_fraction, min(dead, window)
        self.recent: collections.deque = collections.deque(maxlen=window)  # (failed, group id) per answer
        self.in_a_row = 0  # answers failed since the last that scored
        self.last_error = ""

    def add(self, errors: list[str], group_ids: list | None = None) -> None:
        """One batch's answers: their errors ("" when scored) and, to count groups in the message, group ids."""
        for err, gid in zip(errors, group_ids or [None] * len(errors), strict=True):
            self.recent.append((bool(err), gid))
            self.in_a_row = self.in_a_row + 1 if err else 0
            self.last_error = err or self.last_error

    def failed(self) -> int:
        return sum(f for f, _ in self.recent)

    def too_high(self) -> bool:
        if self.in_a_row >= self.dead:
            return True
        return len(self.recent) == self.recent.maxlen and self.failed() > self.max_fraction * len(self.recent)

    def describe(self) -> str:
        """'64 of the last 64 answers failed (in 8 of their 8 groups; last: ...)'."""
        if self.in_a_row >= self.dead:
            recent = list(self.recent)[-self.dead:]
            failed, n = self.dead, self.dead
        else:
            recent = list(self.recent)
            failed, n = self.failed(), len(recent)
        said = f"{failed} of the last {n} answers failed"
        groups = {g for _, g in recent if g is not None}
        if groups:
            bad = {g for f, g in recent if f and g is not None}
            said += f" (in {len(bad)} of their {len(groups)} groups; last: {self.last_error})"
        else:
            said += f" (last: {self.last_error})"
        return said

    def error(self, source: str, fn_ref: str) -> RewardStageFailing:
        return RewardStageFailing(source, [Problem(("stages", self.stage, "fn"), self.describe(), "reward-failing",
                                                   f"fix the reward function '{fn_ref}': it must return a finite "
                                                   f"number within {REWARD_TIMEOUT_S:g} s (try it on a few rows)")])


def hang_error(source: str, stage: str, fn_ref: str, message: str, timeout_s: float) -> RewardStageFailing:
    """Reward stage `stage` stops: its reward timed out TIMEOUTS_IN_A_ROW times in a row (`message` says where)."""
    return RewardStageFailing(source, [Problem(("stages", stage, "fn"), message, "reward-hangs",
                                               f"fix the reward function '{fn_ref}': it must return within "
                                               f"{timeout_s:g} s (try it on that row)")])


#: a Score actor's stage_rule when a new reward process cannot import the reward (its module was edited mid-run)
USER_CODE_ERROR = "user-code-error"


def stage_stop(source: str, stage: str, fn_ref: str, rule: str, message: str, timeout_s: float) -> RewardStageFailing:
    """The error that stops reward stage `stage` for a Score actor's stage_error `message`: `rule` reward-hangs
    (hang_error) or user-code-error (its reward no longer loads; `message` names the file and line)."""
    if rule != USER_CODE_ERROR:
        return hang_error(source, stage, fn_ref, message, timeout_s)
    return RewardStageFailing(source, [Problem(("stages", stage, "fn"), message, USER_CODE_ERROR,
                                               f"fix the reward function '{fn_ref}' (it changed since the run started)")])
