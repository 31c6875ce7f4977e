"""The exactly-once ledger (rlflow/runtime/ledger.py): durable states, resume roll-back, the invariants."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlflow.operators.policy import InvariantViolation
from rlflow.runtime.ledger import TERMINAL, Ledger


def prompt(task: str, n: int) -> dict:
    return {"task": task, "n": n, "prompt": f"p{n}", "answer": "a", "prompt_ids": [1, 2], "row": {"k": n}}


def test_a_group_goes_from_drawn_to_trained_once(tmp_path):
    led = Ledger(tmp_path, eta=1, fresh=True)
    for n in range(3):
        led.drawn(f"main-{n}", prompt("main", n))
        led.state(f"main-{n}", "routed", 0)
    led.trained(1, {"main-0": 0, "main-1": 1}, [])
    assert led.counts() == {"trained": 2, "routed": 1}
    with pytest.raises(InvariantViolation, match="already trained"):
        led.trained(2, {"main-1": 0}, [])
    with pytest.raises(InvariantViolation, match="staleness 2 > eta 1"):
        led.trained(2, {"main-2": 2}, [])


def test_what_a_killed_driver_did_not_flush_is_lost_and_only_that(tmp_path):
    led = Ledger(tmp_path, eta=None, fresh=True)
    led.drawn("main-0", prompt("main", 0))
    led.flush()
    led.drawn("main-1", prompt("main", 1))  # never flushed: the process dies here
    again = Ledger(tmp_path, eta=None, fresh=False)
    replay, drawn = again.resume(0)
    assert [p["n"] for p in replay] == [0] and drawn == {"main": 1}


def test_resume_rolls_back_steps_after_the_checkpoint(tmp_path):
    led = Ledger(tmp_path, eta=None, fresh=True)
    for n in range(6):
        led.drawn(f"t-{n}", prompt("t", n))
    led.trained(1, {"t-0": 0, "t-1": 0}, [])
    led.trained(2, {"t-2": 0, "t-3": 0}, [])  # trained after the checkpoint at step 1: lost with the weights
    led.state("t-4", "filtered")
    led.flush()
    replay, drawn = Ledger(tmp_path, eta=None, fresh=False).resume(1)
    assert [p["n"] for p in replay] == [2, 3, 5] and drawn == {"t": 6}
    assert replay[0] == prompt("t", 2)  # the original prompt, row and all


def test_check_counts_each_step_once(tmp_path):
    led = Ledger(tmp_path, eta=None, fresh=True)
    for n in range(4):
        led.drawn(f"t-{n}", prompt("t", n))
    led.trained(1, {"t-0": 0, "t-1": 0}, [])
    led.trained(2, {"t-2": 0, "t-3": 0}, [])
    led.check(2, 2)
    with pytest.raises(InvariantViolation):
        led.check(3, 2)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 19), st.sampled_from(["routed", "generated", "buffered", *TERMINAL])),
                max_size=60),
       st.integers(0, 3), st.integers(0, 60))
def test_resume_replays_exactly_the_groups_not_finished(tmp_path_factory, moves, ckpt, flushed):
    """Random transitions, a kill after `flushed` of them, a resume at `ckpt`: every group drawn is either
    finished in the history that counts (terminal, trained at or before the checkpoint) or replayed, once."""
    path = tmp_path_factory.mktemp("ledger")
    led = Ledger(path, eta=None, fresh=True)
    for n in range(20):
        led.drawn(f"t-{n}", prompt("t", n))
    led.flush()
    for i, (n, state) in enumerate(moves):
        if i == flushed:
            led.flush()
        if state == "trained":
            led._q("update groups set state='trained', step=? where gid=?", (1 + n % 4, f"t-{n}"))
        else:
            led.state(f"t-{n}", state)
    if flushed >= len(moves):
        led.flush()
    db = led.db.execute("select gid, state, step from groups").fetchall()
    replay, _ = Ledger(path, eta=None, fresh=False).resume(ckpt)
    replayed = {f"t-{p['n']}" for p in replay}
    assert len(replayed) == len(replay)
    for gid, state, step in db:
        done = state in TERMINAL and not (state == "trained" and step > ckpt)
        assert (gid in replayed) != done, (gid, state, step)
