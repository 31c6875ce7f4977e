"""A reward runs in a long-lived child process of its Score actor: a call costs a pipe round trip, and the child
never outlives the actor."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from rlflow.runtime.reward_process import RewardDied, RewardProcess


def test_a_call_costs_a_round_trip_not_a_process():
    process = RewardProcess("exact_match", timeout_s=10.0)
    process.call("2", "2", "1+1=", {})  # the child starts once
    n, t0 = 500, time.perf_counter()
    rewards = [process.call(str(i % 3), "1", "0+1=", {"i": i}) for i in range(n)]
    per_call_ms = (time.perf_counter() - t0) / n * 1e3
    assert rewards == [float(i % 3 == 1) for i in range(n)] and process.spawned == 1
    assert per_call_ms < 5, per_call_ms  # measured ~0.1 ms here; a process per call would cost ~50 ms
    process.close()


def test_a_reward_that_cannot_load_is_named():
    process = RewardProcess("no_such_module_here:fn", timeout_s=10.0)
    with pytest.raises(RewardDied, match="could not load it: .*no_such_module_here"):
        process.call("2", "2", "1+1=", {})


def test_the_child_exits_when_its_actor_dies(tmp_path):
    """The Score actor is SIGKILLed (or Ray ends it): its reward process notices within a second or so and exits,
    even in the middle of a call that hangs."""
    script = textwrap.dedent(f"""
        import os, sys, threading
        sys.path.insert(0, {str(os.path.join(os.path.dirname(__file__), '..', '..', 'integration'))!r})
        from rlflow.runtime.reward_process import RewardProcess
        p = RewardProcess("rewards_for_tests:hangs_on", timeout_s=60)
        p.call("2", "2", "1+1=", {{}})
        print(p.proc.pid, flush=True)
        threading.Thread(target=p.call, args=("2", "2", "1+1=", {{"hang": True}}), daemon=True).start()
        threading.Event().wait(0.5)
        os._exit(9)  # no cleanup: as a SIGKILL would
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    child = int(out.stdout.split()[0])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    pytest.fail(f"reward process {child} outlived its parent by 10 s")
