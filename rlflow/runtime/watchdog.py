"""The watchdog: a run in which nothing happens for too long stops, saying what it was waiting for.

Nothing happening means no rollout step, scored group or train step returned for `factor` times the mean step
time (the plan's trainer `stall_factor`, STALL_FACTOR by default; at least STALL_MIN_S). Until this process has
seen a step finish (engine start-up and the first batch, also after a resume) the limit is STALL_FIRST_S. The
mean is taken over the steps finished so far, up to the last one, so a stall does not stretch its own limit.
The driver then saves a checkpoint if the trainer is alive and stops.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from rlflow.errors import RunFailed

STALL_FACTOR, STALL_MIN_S, STALL_FIRST_S = 20.0, 120.0, 600.0


class RunStalled(RunFailed):
    """Nothing happened for the stall limit; the message says what the run was waiting for."""


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
