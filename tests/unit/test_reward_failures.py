"""A reward that fails, returns a non-number or hangs fails its trajectory; too many failures stop the stage."""

from __future__ import annotations

import math
import queue
import threading
import time

import pyarrow as pa
import pytest

from rlflow.errors import PipelineInvalid
from rlflow.runtime import reward_stream
from rlflow.runtime.reward_call import (
    FailureRate,
    RewardStageFailing,
    TimedCall,
    as_reward,
    reward_caller,
)
from rlflow.runtime.reward_stream import Score, StreamRunner


def score_with(fn, timeout_s: float = 5.0, name: str = "mine:fn") -> Score:
    score = Score("exact_match", timeout_s)
    score.fn_ref, score.call = name, reward_caller(fn)
    return score


@pytest.mark.parametrize("value, expected", [(1, 1.0), (0.25, 0.25), (True, 1.0), (False, 0.0), (-2, -2.0)])
def test_numbers_are_rewards(value, expected):
    assert as_reward(value) == expected


def test_numpy_and_torch_scalars_are_rewards():
    import numpy as np
    import torch

    assert as_reward(np.float32(0.5)) == 0.5 and as_reward(np.int64(1)) == 1.0
    assert as_reward(torch.tensor(0.75)) == 0.75


@pytest.mark.parametrize("value, message", [
    ("yes", "returned 'yes' (str), not a number"),
    ("1.0", "returned '1.0' (str), not a number"),
    (None, "returned None (NoneType), not a number"),
    ([1.0], "returned [1.0] (list), not a number"),
    (float("nan"), "returned nan, not a finite number"),
    (float("inf"), "returned inf, not a finite number"),
    (float("-inf"), "returned -inf, not a finite number"),
])
def test_non_numbers_are_not_rewards(value, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[").replace("]", r"\]")):
        as_reward(value)


@pytest.mark.parametrize("fn, error", [
    (lambda c, a: "yes", "mine:fn returned 'yes' (str), not a number"),
    (lambda c, a: None, "mine:fn returned None (NoneType), not a number"),
    (lambda c, a: float("nan"), "mine:fn returned nan, not a finite number"),
    (lambda c, a: 1 / 0, "mine:fn raised ZeroDivisionError: division by zero"),
])
def test_a_bad_result_fails_the_trajectory(fn, error):
    reward, why = score_with(fn).score_one("2", "2", "1+1=", {})
    assert math.isnan(reward) and why == error


def test_a_good_result_scores():
    assert score_with(lambda c, a: c == a).score_one("2", "2", "1+1=", {}) == (1.0, "")


def test_score_marks_each_member():
    g = {"group_id": "g", "task": "main", "traj_id": ["g/0", "g/1"], "completion": ["2", "boom"], "answer": "2",
         "prompt": "1+1=", "row": "{}"}
    out = score_with(lambda c, a: float(c)).score(g)
    assert out["reward"][0] == 2.0 and math.isnan(out["reward"][1])
    assert out["reward_error"] == ["", "mine:fn raised ValueError: could not convert string to float: 'boom'"]


def sleepy(completion, answer):
    time.sleep(5)
    return 1.0


def spin(completion, answer):
    while True:
        pass


@pytest.mark.parametrize("fn", [sleepy, spin])
def test_a_slow_reward_times_out_on_the_main_thread(fn):
    score = score_with(fn, timeout_s=0.2)
    t0 = time.monotonic()
    reward, why = score.score_one("2", "2", "1+1=", {})
    assert time.monotonic() - t0 < 2
    assert math.isnan(reward) and why == "mine:fn timed out after 0.2 s"
    assert score.timed(lambda: 3.0) == 3.0  # the alarm is disarmed afterwards
    time.sleep(0.3)  # no stray alarm fires later


def test_after_timeouts_in_a_row_the_rest_of_the_bundle_fails_at_once():
    g = {"group_id": "g", "task": "main", "traj_id": [f"g/{i}" for i in range(6)], "completion": ["2"] * 6,
         "answer": "2", "prompt": "1+1=", "row": "{}"}
    score = score_with(sleepy, timeout_s=0.1)
    bundles = pa.Table.from_pydict({"groups": [[g]]})
    t0 = time.monotonic()
    (out,) = score(bundles).column("groups").to_pylist()[0]
    assert time.monotonic() - t0 < 1.5  # 3 calls of 0.1 s, not 6
    assert out["reward_error"] == ["mine:fn timed out after 0.1 s"] * 3 + ["mine:fn not called: its last 3 calls timed out after 0.1 s"] * 3
    score.call = reward_caller(lambda c, a: 1.0)
    (out,) = score(bundles).column("groups").to_pylist()[0]  # the next bundle calls it again
    assert out["reward"] == [1.0] * 6


def test_a_slow_reward_times_out_off_the_main_thread():
    score, result = score_with(sleepy, timeout_s=0.2), []

    def worker():
        result.append(score.score_one("2", "2", "1+1=", {}))
        score.call = reward_caller(lambda c, a: 0.5)
        result.append(score.score_one("2", "2", "1+1=", {}))  # a fresh worker thread: the stuck one is left

    thread = threading.Thread(target=worker)
    t0 = time.monotonic()
    thread.start()
    thread.join(5)
    assert time.monotonic() - t0 < 2
    assert math.isnan(result[0][0]) and result[0][1] == "mine:fn timed out after 0.2 s"
    assert result[1] == (0.5, "")


def reward_threads() -> list:
    return [t for t in threading.enumerate() if t.name == "reward-call"]


def test_a_spinning_reward_off_the_main_thread_is_interrupted():
    """Ray Data runs the reward off the actor's main thread: a call stuck in a Python loop is not only
    abandoned but stopped, so it does not keep a core busy."""
    score, result = score_with(spin, timeout_s=0.2), []
    before = len(reward_threads())
    thread = threading.Thread(target=lambda: result.append(score.score_one("2", "2", "1+1=", {})))
    thread.start()
    thread.join(5)
    assert result == [(pytest.approx(float("nan"), nan_ok=True), "mine:fn timed out after 0.2 s")]
    deadline = time.monotonic() + 5
    while len(reward_threads()) > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(reward_threads()) == before  # the spinning worker thread ended


def test_timed_call_passes_exceptions_through_from_a_worker_thread():
    timed, caught = TimedCall(1.0), []

    def worker():
        try:
            timed(lambda: 1 / 0)
        except ZeroDivisionError as e:
            caught.append(e)

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join(5)
    assert len(caught) == 1


# ------------------------------------------------------------------------------------------ failure rate
def test_failure_rate_needs_a_full_window_and_more_than_half():
    rate = FailureRate("score", window=64)
    rate.add(["exact_match raised ValueError: bad"] * 63)
    assert not rate.too_high()  # 63 scored: not judged yet
    rate.add([""])
    assert rate.too_high()  # 63 of 64 failed
    half = FailureRate("score", window=64)
    half.add(["x", ""] * 32)
    assert not half.too_high()  # exactly half
    half.add(["x", "x"])
    assert half.too_high()  # 33 of the last 64


def test_failure_rate_forgets_old_failures():
    rate = FailureRate("score", window=8)
    rate.add(["x"] * 8 + [""] * 5)
    assert not rate.too_high()


def test_failure_rate_error_is_a_runtime_error_and_a_pipeline_problem():
    rate = FailureRate("score")
    rate.add(["exact_match raised ValueError: no"] * 63 + ["exact_match returned 'x' (str), not a number"])
    err = rate.error("p.yaml", "exact_match")
    assert isinstance(err, RuntimeError) and isinstance(err, PipelineInvalid) and isinstance(err, RewardStageFailing)
    (p,) = err.problems
    assert (p.loc, p.rule) == (("stages", "score", "fn"), "reward-failing")
    assert p.message == "64 of the last 64 trajectories failed (last: exact_match returned 'x' (str), not a number)"
    assert p.fix == "fix the reward function 'exact_match': it must return a finite number within 30 s (try it on a few rows)"
    assert str(err) == f"{p.message}; {p.fix}"  # one line, for the driver's "reward stage 'score' failed: ..."
    assert err.render().splitlines()[1] == f"  stages.score.fn: {p.message}; {p.fix} [reward-failing]"


class FakeStore:
    class _Remote:
        def remote(self, *a):
            return None

    delivered = _Remote()


class FakeDataset:
    def __init__(self, bundles):
        self.bundles = bundles

    def iter_batches(self, **_):
        yield from self.bundles


def bundle(n_groups: int, failing: bool, start: int = 0) -> pa.Table:
    groups = [{"group_id": f"g{i}", "task": "main", "traj_id": [f"g{i}/{j}" for j in range(4)],
               "reward": [float("nan") if failing else 1.0] * 4,
               "reward_error": ["mine:fn raised ValueError: no" if failing else ""] * 4, "kept": not failing}
              for i in range(start, start + n_groups)]
    return pa.Table.from_pydict({"groups": [groups]})


def stream_over(bundles) -> queue.Queue:
    rs = StreamRunner.__new__(StreamRunner)
    rs.store, rs.stage, rs.reward_fn, rs.source = FakeStore(), "score", "mine:fn", "p.yaml"
    rs.failures, rs._closing, rs.dataset = FailureRate("score"), threading.Event(), FakeDataset(bundles)
    out: queue.Queue = queue.Queue()
    rs._run(out)
    return out


def drain(out: queue.Queue) -> list:
    events = []
    while not out.empty():
        events.append(out.get_nowait())
    return events


def test_stream_stops_its_stage_when_most_trajectories_fail():
    events = drain(stream_over([bundle(8, True, 0), bundle(8, True, 8), bundle(8, True, 16)]))
    assert [e[0] for e in events] == ["rewarded", "rewarded", "error"]  # 64 failed after two bundles: stop there
    _tag, stage, err = events[-1]
    assert stage == "score" and isinstance(err, RuntimeError)
    assert str(err).startswith("64 of the last 64 trajectories failed (last: mine:fn raised ValueError: no); ")


def test_stream_with_some_failures_goes_on():
    bundles = [bundle(4, i % 3 == 0, 4 * i) for i in range(12)]  # a third of the groups fail
    events = drain(stream_over(bundles))
    assert [e[0] for e in events[:-1]] == ["rewarded"] * 12  # then the end-of-source error of a stream not closed
    assert events[-1][0] == "error" and "reward stream 'score' stopped" in str(events[-1][2])


def test_timeout_is_a_documented_module_constant():
    assert reward_stream.REWARD_TIMEOUT_S == 30.0
    assert Score("exact_match").timeout_s == reward_stream.REWARD_TIMEOUT_S
