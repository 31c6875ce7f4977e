"""The exactly-once ledger (rlflow/runtime/ledger.py): durable states, resume roll-back, the invariants."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlflow.operators.policy import InvariantViolation
from rlflow.runtime.ledger import TERMINAL, Ledger
from rlflow.runtime.messages import Prompt
from rlflow.stages.trajectory import Trajectory


def prompt(task: str, n: int) -> Prompt:
    return Prompt(task=task, n=n, prompt=f"p{n}", answer="a", prompt_ids=[1, 2], row={"k": n})


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
    resumed = again.resume(0)
    assert [p.n for p in resumed.replay] == [0] and resumed.drawn == {"main": 1} and resumed.restore == []


def test_resume_rolls_back_steps_after_the_checkpoint(tmp_path):
    led = Ledger(tmp_path, eta=None, fresh=True)
    for n in range(6):
        led.drawn(f"t-{n}", prompt("t", n))
    led.trained(1, {"t-0": 0, "t-1": 0}, [])
    led.trained(2, {"t-2": 0, "t-3": 0}, [])  # trained after the checkpoint at step 1: lost with the weights
    led.state("t-4", "filtered")
    led.flush()
    resumed = Ledger(tmp_path, eta=None, fresh=False).resume(1)
    assert [p.n for p in resumed.replay] == [2, 3, 5] and resumed.drawn == {"t": 6}
    assert resumed.replay[0] == prompt("t", 2)  # the original prompt, row and all


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
    replay = Ledger(path, eta=None, fresh=False).resume(ckpt).replay
    replayed = {f"t-{p.n}" for p in replay}
    assert len(replayed) == len(replay)
    for gid, state, step in db:
        done = state in TERMINAL and not (state == "trained" and step > ckpt)
        assert (gid in replayed) != done, (gid, state, step)


# ---------------------------------------------------------------------------------------------- buffered payloads
def member(gid: str, i: int, version: int, seen: list[int] | None = None) -> Trajectory:
    """A finished trajectory as the store holds it."""
    return Trajectory(group_id=gid, index=i, prompt="p", answer="a", prompt_ids=[1, 2], completion_ids=[3, 4],
                      behaviour_logprobs=[-0.5, -0.25], version=version, versions_seen=seen or [version],
                      finish_reason="stop", completion="c", task="t", row={"k": 1})


def buffer_group(led: Ledger, gid: str, version: int, seen: list[int] | None = None) -> list[Trajectory]:
    rows = [member(gid, i, version, seen) for i in range(2)]
    led.state(gid, "generated", version)
    for r in rows:
        led.finished(r.traj_id, gid, version, 2)
    led.buffered(gid, rows, {f"{gid}/{i}": float(i) for i in range(2)})
    return rows


def test_buffered_groups_generated_by_surviving_weights_are_restored_as_they_were(tmp_path):
    led = Ledger(tmp_path, eta=2, fresh=True)
    for n in range(8):
        led.drawn(f"t-{n}", prompt("t", n))
    for n in range(6):
        buffer_group(led, f"t-{n}", version=n // 2)
    led.trained(1, {"t-0": 0, "t-1": 0}, ["t-0/0", "t-0/1", "t-1/0", "t-1/1"])
    led.checkpointed(1)  # t-0, t-1 trained into the checkpoint: their payloads are needed no more
    led.trained(2, {"t-2": 1, "t-3": 1}, ["t-2/0"])  # lost with the weights of step 2
    buffer_group(led, "t-6", version=1, seen=[1, 2])  # a partial rollout finished on version 2: lost weights
    led.state("t-7", "routed", 1)  # in flight
    led.flush()
    assert led.db.execute("select count(*) from payloads").fetchone()[0] == 5
    resumed = Ledger(tmp_path, eta=2, fresh=False).resume(1)
    restored = {r.gid: r for r in resumed.restore}
    # t-2, t-3 (trained after the checkpoint, v 1) and t-4, t-5 (buffered, v 2 > 1: generated by lost weights)
    assert list(restored) == ["t-2", "t-3"]
    assert {p.n for p in resumed.replay} == {4, 5, 6, 7}
    r = restored["t-2"]
    assert (r.task, r.v_traj, r.rewards) == ("t", 1, {"t-2/0": 0.0, "t-2/1": 1.0})
    assert r.members == [member("t-2", 0, 1), member("t-2", 1, 1)] and r.prompt == prompt("t", 2)
    db = Ledger(tmp_path, eta=2, fresh=False).db
    states = dict(db.execute("select gid, state from groups where gid in ('t-2', 't-3')").fetchall())
    assert states == {"t-2": "buffered", "t-3": "buffered"}  # no longer trained; attempt unchanged
    assert db.execute("select state, step from trajectories where tid='t-2/0'").fetchone() == ("finished", None)
    assert db.execute("select count(*) from trajectories where gid in ('t-4', 't-6')").fetchone()[0] == 0
    assert {g for (g,) in db.execute("select gid from payloads")} == {"t-2", "t-3"}


def test_a_partial_rollout_records_its_version_span(tmp_path):
    led = Ledger(tmp_path, eta=None, fresh=True)
    led.drawn("t-0", prompt("t", 0))
    buffer_group(led, "t-0", version=0, seen=[0, 1])
    led.flush()
    assert led.db.execute("select v_min, v_max from trajectories where gid='t-0'").fetchall() == [(0, 1), (0, 1)]
    led.spans({"t-0/1": (0, 0)})  # as the reward stream reports it
    led.flush()
    assert led.db.execute("select v_min, v_max from trajectories where gid='t-0'").fetchall() == [(0, 1), (0, 0)]
    led.trained(2, {"t-0": 1}, ["t-0/0", "t-0/1"])  # step 2 starts from version 1: both spans fit
    with pytest.raises(InvariantViolation, match="trained groups per step"):
        led.check(1, 1)  # one step of one group, but it is step 2: step 1 trained nothing


def test_check_refuses_a_trajectory_newer_than_its_step(tmp_path):
    led = Ledger(tmp_path, eta=None, fresh=True)
    led.drawn("t-0", prompt("t", 0))
    buffer_group(led, "t-0", version=0, seen=[0, 1])  # version 1 generated part of it
    led.trained(1, {"t-0": 0}, ["t-0/0", "t-0/1"])  # but step 1 starts from version 0
    with pytest.raises(InvariantViolation, match="version spans"):
        led.check(1, 1)
    led.db.execute("update trajectories set v_max=0")
    led.check(1, 1)
    led.db.execute("update trajectories set v_min=1 where tid='t-0/0'")  # v_min > v_max
    with pytest.raises(InvariantViolation, match=r"\('t-0/0', 1, 0, 1\)"):
        led.check(1, 1)


def test_a_ledger_from_before_version_spans_gains_the_columns(tmp_path):
    import sqlite3

    db = sqlite3.connect(tmp_path / "ledger.sqlite")
    db.execute("create table trajectories (tid text primary key, gid text, state text, version integer, tokens integer, "
               "step integer)")
    db.commit()
    db.close()
    led = Ledger(tmp_path, eta=None, fresh=False)
    led.finished("t-0/0", "t-0", 3, 5)
    led.flush()
    assert led.db.execute("select v_min, v_max from trajectories").fetchall() == [(3, 3)]


def test_a_payload_goes_once_no_resume_can_restore_its_group(tmp_path):
    led = Ledger(tmp_path, eta=None, fresh=True)
    for n in range(4):
        led.drawn(f"t-{n}", prompt("t", n))
        buffer_group(led, f"t-{n}", version=n)
    payloads = lambda: {g for (g,) in led.db.execute("select gid from payloads")}
    led.trained(1, {"t-0": 0}, [])  # no checkpoint yet: nothing to restore it into
    assert payloads() == {"t-1", "t-2", "t-3"}
    led.checkpointed(1)
    led.trained(2, {"t-1": 1}, [])  # generated by version 1, which the checkpoint at step 1 has: kept
    assert payloads() == {"t-1", "t-2", "t-3"}
    led.trained(3, {"t-2": 1}, [])  # version 2: a resume to step 1 would generate it again
    assert payloads() == {"t-1", "t-3"}
    led.checkpointed(3)  # step 2 is covered now
    assert payloads() == {"t-3"}
