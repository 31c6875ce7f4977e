"""The run's watchdog (rlflow/runtime/watchdog.py): a stall limit that follows the step time."""

from __future__ import annotations

import pytest

from rlflow.runtime import watchdog
from rlflow.runtime.watchdog import RunStalled, Watchdog


def test_limit_follows_the_mean_step_time(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(watchdog.time, "monotonic", lambda: now[0])
    steps = [0]
    dog = Watchdog(lambda: steps[0])
    assert dog.limit() == watchdog.STALL_FIRST_S  # start-up and the first batch
    now[0] += 50.0
    steps[0] = 10  # 5 s per step: 20 x 5 = 100 s, below the floor
    assert dog.limit() == watchdog.STALL_MIN_S
    now[0] += 950.0
    assert dog.limit() == pytest.approx(20 * 100.0)  # 100 s per step


def test_check_raises_only_after_the_limit_and_says_what_it_waited_for(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(watchdog.time, "monotonic", lambda: now[0])
    dog = Watchdog(lambda: 0)
    now[0] = watchdog.STALL_FIRST_S - 1
    dog.check(lambda: "never asked")
    dog.fed()
    now[0] += watchdog.STALL_FIRST_S + 1
    with pytest.raises(RunStalled, match=r"nothing happened for 600 s; waiting for: train step 3"):
        dog.check(lambda: "train step 3")
