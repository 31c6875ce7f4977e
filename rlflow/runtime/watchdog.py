"""The watchdog: a run in which nothing happens for too long stops, saying what it was waiting for.

Nothing happening means no rollout step, scored group or train step returned for `factor` times the mean step
time (the plan's trainer `stall_factor`, STALL_FACTOR by default; at least STALL_MIN_S). Until this process has
seen a step finish (engine start-up and the first batch, also after a resume) the limit is STALL_FIRST_S. The
mean is taken over the steps finished so far, up to the last one, so a stall does not stretch its own limit.
The driver then saves a checkpoint if the trainer is alive and stops.

A run can also be busy and still learn nothing: every scored group filtered (a policy that never earns a reward
under drop_uniform_groups) or every reward failing feeds the watchdog above forever. `NoProgress` counts the groups
scored since the last TRAINED step that can never be trained (filtered, or every reward failed) and stops the run
once there are `limit` of them (the train stage's `no_progress_groups`), saying what was scored and what to do.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import ray

from rlflow.errors import RunFailed
from rlflow.runtime.messages import ScoredBatch

STALL_FACTOR, STALL_MIN_S, STALL_FIRST_S = 20.0, 120.0, 600.0
#: no_progress_groups default, in batches: a filter keeping 1 group in 25 still trains a batch (after about 24
#: batches' worth of filtered groups, on average) well before it
NO_PROGRESS_BATCHES = 50
#: batches' worth of groups in a row, none trainable, after which a run says so once (a warning, not a stop). One batch
#: was too few: the quickstart's first 17 groups were all filtered once (its tiny model starts with few mixed groups)
WARN_BATCHES = 4


CALL_TIMEOUT_S = 300  # one blocking actor call (publish, checkpoint save/load, the store taking restored groups)


class RunStalled(RunFailed):
    """Nothing happened for the stall limit; the message says what the run was waiting for."""


def get_within(refs, timeout_s: float, what: str):
    """ray.get, raising RunStalled (naming `what`) past `timeout_s`: a blocking call on an actor is bounded too."""
    try:
        return ray.get(refs, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise RunStalled(f"waited {timeout_s:.0f} s for {what}; see the Ray logs above") from None


class Watchdog:
    def __init__(self, steps_done: Callable[[], int], factor: float = STALL_FACTOR):
        if not factor > 1:
            raise ValueError(f"stall factor must be > 1 (a multiple of the mean step time), got {factor}")
        self.steps_done, self.factor = steps_done, factor
        self.t0 = self.last_event_t = self.last_step_t = time.monotonic()
        self.steps0 = self.steps = steps_done()  # a resumed run counts its steps from here

    def fed(self) -> None:
        """Something happened."""
        self.last_event_t = time.monotonic()
        self._steps(self.last_event_t)

    def _steps(self, now: float) -> int:
        """Steps finished in this process; notes when a new one was first seen."""
        steps = self.steps_done()
        if steps != self.steps:
            self.steps, self.last_step_t = steps, now
        return steps - self.steps0

    def limit(self) -> float:
        return self._limit()[0]

    def _limit(self) -> tuple[float, str]:
        """(the stall limit in seconds, how it was set)."""
        steps = self._steps(time.monotonic())
        if steps <= 0:
            return STALL_FIRST_S, "the limit before the first step"
        mean = (self.last_step_t - self.t0) / steps
        if self.factor * mean < STALL_MIN_S:
            return STALL_MIN_S, "the least limit"
        return self.factor * mean, f"{self.factor:g} x the mean step time of {mean:.0f} s: the train stage's stall_factor"

    def check(self, waiting_for: Callable[[], str]) -> None:
        limit, why = self._limit()
        if time.monotonic() - self.last_event_t > limit:
            raise RunStalled(f"nothing happened for {limit:.0f} s ({why}); waiting for: {waiting_for()}")


class NoProgress(RunFailed):
    """Scored groups keep coming, but none can be trained (filtered, or every reward failed)."""


class ProgressCheck:
    """Counts the untrainable groups scored since the last trained step; `scored` raises NoProgress at `limit`.
    filters: {reward stage: its group filter}, to name the filter in the message. With `warn_at` and `log`, it says so
    once, early, when `warn_at` groups in a row could not be trained (WARN_BATCHES batches' worth: seconds into a run
    whose rewards are all the same, long before the limit stops it)."""

    def __init__(self, limit: int, filters: dict[str, str], *, warn_at: int | None = None, log=None):
        if limit < 1:
            raise ValueError(f"no_progress_groups must be >= 1, got {limit}")
        self.limit, self.filters = limit, filters
        self.warn_at, self.log, self.warned = warn_at, log, False
        self.trained()

    def trained(self) -> None:
        """A train step finished: progress."""
        self.scored_groups, self.filtered, self.failed = 0, {}, 0
        self.rewards: dict[float, int] = {}  # reward value -> trajectories, of the untrainable groups

    def scored_batch(self, stage: str, batch: ScoredBatch) -> None:
        """A reward stream's output (one row per trajectory, whole groups): a group none of whose members is kept
        without an error can never be trained (buffer.py rewarded)."""
        groups: dict[str, list[tuple[float, bool, bool]]] = {}
        for t in batch.rows:
            groups.setdefault(str(t.group_id), []).append((float(t.reward), bool(t.reward_error), bool(t.kept)))
        dead = [rows for rows in groups.values() if not any(kept and not err for _, err, kept in rows)]
        failed = sum(all(err for _, err, _ in rows) for rows in dead)
        self.scored(stage, len(groups), len(dead) - failed, failed, [r for rows in dead for r, err, _ in rows if not err])

    def scored(self, stage: str, groups: int, filtered: int, failed: int, rewards: list[float]) -> None:
        """`groups` scored by reward stage `stage`: `filtered` of them dropped by its filter, `failed` with every
        reward failed; `rewards`: the rewards of those untrainable groups."""
        self.scored_groups += groups
        self.filtered[stage] = self.filtered.get(stage, 0) + filtered
        self.failed += failed
        for r in rewards:
            self.rewards[r] = self.rewards.get(r, 0) + 1
        untrainable = sum(self.filtered.values()) + self.failed
        if untrainable >= self.limit:
            raise NoProgress(self.message())
        if self.log and self.warn_at and untrainable >= self.warn_at and not self.warned and untrainable == self.scored_groups:
            self.warned = True  # once a run: every group so far untrainable
            self.log(f"warning: {self.message()}. The run stops if this goes on for {self.limit} groups")

    def message(self) -> str:
        by = [f"{n} filtered by {self.filters.get(s) or 'its filter'} (reward stage '{s}')"
              for s, n in sorted(self.filtered.items()) if n]
        if self.failed:
            by.append(f"{self.failed} with every reward failed")
        top = sorted(self.rewards.items(), key=lambda kv: -kv[1])[:5]
        seen = ", ".join(f"{r:g} x{n}" for r, n in top) or "none scored"
        return (f"no train step in {self.scored_groups} scored groups: {'; '.join(by)} (the train stage's "
                f"no_progress_groups is {self.limit}); their rewards: {seen}. Check the reward on a few completions "
                "(rlflow eval, or the reward function on rows of the data), turn the group filter off "
                "(drop_uniform_groups keeps only groups whose rewards differ), or start from a model that can earn rewards")
