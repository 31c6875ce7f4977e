"""The watchdog: a run in which nothing happens for too long stops, saying what it was waiting for.

Nothing happening means no rollout step, scored group or train step returned for STALL_STEPS times the
mean step time so far (at least STALL_MIN_S; STALL_FIRST_S before the first step, which includes engine
start-up and the first batch). The driver then saves a checkpoint if the trainer is alive and stops.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from rlflow.errors import RunFailed

STALL_STEPS, STALL_MIN_S, STALL_FIRST_S = 20, 120.0, 600.0


class RunStalled(RunFailed):
    """Nothing happened for the stall limit; the message says what the run was waiting for."""


class Watchdog:
    def __init__(self, steps_done: Callable[[], int]):
        self.steps_done = steps_done
        self.t0 = self.last_event_t = time.monotonic()

    def fed(self) -> None:
        """Something happened."""
        self.last_event_t = time.monotonic()

    def limit(self) -> float:
        steps = self.steps_done()
        if not steps:
            return STALL_FIRST_S
        return max(STALL_MIN_S, STALL_STEPS * (time.monotonic() - self.t0) / steps)

    def check(self, waiting_for: Callable[[], str]) -> None:
        limit = self.limit()
        if time.monotonic() - self.last_event_t > limit:
            raise RunStalled(f"nothing happened for {limit:.0f} s; waiting for: {waiting_for()}")
