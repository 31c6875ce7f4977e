"""run_clock.RunClock: the start-up timeline and the steady-state shares (rlflow/runtime/run_clock.py)."""

import time

from rlflow.runtime.run_clock import RunClock


def test_marks_are_seconds_since_start_and_kept_from_the_first_time():
    clock = RunClock(t0=time.monotonic() - 2.0)
    clock.mark("ray")
    first = clock.marks["ray"]
    assert 2.0 <= first < 3.0
    time.sleep(0.02)
    clock.mark("ray")  # a phase ends once
    assert clock.marks["ray"] == first
    assert clock.describe().startswith("start-up: Ray 2.")


def test_loop_work_counts_only_after_the_first_step():
    clock = RunClock()
    clock.busy(5.0)  # start-up work is not steady-state control-plane cost
    assert clock.steady() == {}
    clock.first_step_done()
    assert "first_step" in clock.marks
    clock.busy(0.1)
    time.sleep(1.1)
    shares = clock.steady()
    assert 0.05 < shares["control_share"] < 0.1  # 0.1 s of work over ~1.1 s
    assert 0.0 <= shares["driver_cpu_share"] < 1.0  # sleeping costs no CPU
