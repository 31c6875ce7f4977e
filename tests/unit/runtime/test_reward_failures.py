"""A reward that fails, returns a non-number or hangs fails its trajectory; too many failures stop the stage."""

from __future__ import annotations

import json
import math
import os
import queue
import signal
import threading
import time
from pathlib import Path

import pyarrow as pa
import pytest

from rlflow.errors import PipelineInvalid
from rlflow.runtime import reward_stream
from rlflow.runtime.messages import Rewarded, StreamFailed
from rlflow.runtime.reward_call import DEAD_WINDOW, FAILURE_WINDOW, FailureRate, RewardStageFailing, as_reward
from rlflow.runtime.reward_stream import Score, StreamRunner

INTEGRATION = Path(__file__).resolve().parents[2] / "integration"  # rewards_for_tests.py, imported by the child


@pytest.fixture(autouse=True)
def rewards_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(INTEGRATION))  # the reward's child process inherits sys.path


def score_with(name: str, timeout_s: float = 10.0) -> Score:
    return Score(f"rewards_for_tests:{name}", timeout_s)


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


@pytest.mark.parametrize("fn, completion, error", [
    ("returns", "'yes'", "rewards_for_tests:returns returned 'yes' (str), not a number"),
    ("returns", "None", "rewards_for_tests:returns returned None (NoneType), not a number"),
    ("returns", "float:nan", "rewards_for_tests:returns returned nan, not a finite number"),
    ("as_number", "boom", "rewards_for_tests:as_number raised ValueError: could not convert string to float: 'boom'"),
])
def test_a_bad_result_fails_the_trajectory(fn, completion, error):
    score = score_with(fn)
    reward, why = score.score_one(completion, "2", "1+1=", {})
    assert math.isnan(reward) and why == error
    assert score.process.spawned == 1  # a failing call does not cost its process


def test_a_good_result_scores():
    assert Score("exact_match").score_one("2", "2", "1+1=", {}) == (1.0, "")
    assert score_with("returns").score_one("True", "2", "1+1=", {}) == (1.0, "")


def test_score_marks_each_member():
    g = {"group_id": "g", "task": "main", "traj_id": ["g/0", "g/1"], "completion": ["2", "boom"], "answer": "2",
         "prompt": "1+1=", "row": "{}"}
    out = score_with("as_number").score(g)  # it prints too: the reward's stdout is not the channel
    assert out["reward"][0] == 2.0 and math.isnan(out["reward"][1])
    assert out["reward_error"] == ["", "rewards_for_tests:as_number raised ValueError: could not convert string to float: 'boom'"]
    assert out["stage_error"] == ""


def test_an_agents_result_is_its_members_row_agent_and_a_failed_rollout_is_not_scored():
    """Agent stages (issue 48): each member's agent result reaches the reward as row["agent"], and a member whose
    rollout failed (its agent raised) fails by name without a call."""
    g = {"group_id": "g", "task": "main", "traj_id": ["g/0", "g/1", "g/2"], "completion": ["", "", ""], "answer": "4",
         "prompt": "2+2?", "row": "{}", "agent": ['{"answer": 4}', '{"answer": 5}', ""],
         "rollout_error": ["", "", "agent-raised: RuntimeError: boom"]}
    score = score_with("agent_says")
    out = score.score(g)
    assert out["reward"][:2] == [1.0, 0.0] and math.isnan(out["reward"][2])
    assert out["reward_error"] == ["", "", "rollout failed: agent-raised: RuntimeError: boom"]


def test_a_group_goes_in_one_message_and_its_members_fail_alone():
    """The members go to the reward process together (reward_process.call_many); one that kills the process or
    hangs fails alone, and those after it are still scored (by a new process)."""
    g = {"group_id": "g", "task": "main", "traj_id": [f"g/{i}" for i in range(5)],
         "completion": ["2", "die", "3", "hang", "2"], "answer": "2", "prompt": "1+1=", "row": "{}"}
    score = score_with("dies_or_hangs_on", timeout_s=0.5)
    out = score.score(g)
    assert out["reward"][0] == 1.0 and out["reward"][2] == 0.0 and out["reward"][4] == 1.0
    assert math.isnan(out["reward"][1]) and math.isnan(out["reward"][3])
    assert out["reward_error"][1].startswith("rewards_for_tests:dies_or_hangs_on killed its process (exit code 1) "
                                             "on trajectory g/1 of task 'main'")
    assert out["reward_error"][3] == "rewards_for_tests:dies_or_hangs_on timed out after 0.5 s"
    assert out["stage_error"] == "" and score.timeouts_in_row == 0
    # the first process, its retry on "die", the one that hung on "hang", and the one that scored the last member
    assert score.process.spawned == 4


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_hanging_call_times_out_and_its_process_is_killed(tmp_path):
    pidfile = str(tmp_path / "pids")
    score = score_with("hangs_on", timeout_s=0.3)
    assert score.score_one("2", "2", "1+1=", {"pidfile": pidfile}) == (1.0, "")
    t0 = time.monotonic()
    reward, why = score.score_one("2", "2", "1+1=", {"pidfile": pidfile, "hang": True})
    assert time.monotonic() - t0 < 3  # the timeout and the kill, not the reward's sleep
    assert math.isnan(reward) and why == "rewards_for_tests:hangs_on timed out after 0.3 s"
    (stuck,) = set(pids(pidfile))
    assert not alive(stuck)  # killed and reaped, not left sleeping
    assert score.score_one("2", "2", "1+1=", {"pidfile": pidfile}) == (1.0, "")  # a new process
    assert len(set(pids(pidfile))) == 2 and score.timeouts_in_row == 0


def test_a_spinning_call_off_the_main_thread_is_stopped():
    """Ray Data calls the reward off the actor's main thread: the timeout does not depend on SIGALRM, and a call
    stuck in a Python loop does not keep a core busy afterwards (its process is gone)."""
    score, result = score_with("spins", timeout_s=0.3), []
    thread = threading.Thread(target=lambda: result.append(score.score_one("2", "2", "1+1=", {})))
    thread.start()
    thread.join(10)
    assert result == [(pytest.approx(float("nan"), nan_ok=True), "rewards_for_tests:spins timed out after 0.3 s")]
    assert score.process.proc is None and score.process.spawned == 1


def hanging_group(gid: str, n: int, hang: bool = True) -> dict:
    return {"group_id": gid, "task": "main", "traj_id": [f"{gid}/{i}" for i in range(n)], "completion": ["2"] * n,
            "answer": "2", "prompt": "1+1=", "row": json.dumps({"hang": hang})}


def score_bundle(score: Score, *groups) -> list[dict]:
    return score(pa.Table.from_pydict({"groups": [list(groups)]})).column("groups").to_pylist()[0]


def test_timeouts_in_a_row_across_bundles_stop_the_stage():
    score = score_with("hangs_on", timeout_s=0.2)
    (first,) = score_bundle(score, hanging_group("a", 2))
    assert first["stage_error"] == "" and first["reward_error"] == ["rewards_for_tests:hangs_on timed out after 0.2 s"] * 2
    t0 = time.monotonic()
    (second,) = score_bundle(score, hanging_group("b", 4))  # the third timeout in a row, in the next bundle
    assert time.monotonic() - t0 < 3  # one more timeout, then the rest fail at once
    assert second["reward_error"] == (["rewards_for_tests:hangs_on timed out after 0.2 s"]
                                      + ["rewards_for_tests:hangs_on not called: its last 3 calls timed out after 0.2 s"] * 3)
    assert second["stage_error"] == ("rewards_for_tests:hangs_on timed out on 3 calls in a row (0.2 s each; the last on "
                                     "trajectory b/0 of task 'main' (prompt '1+1='))")


def test_a_single_hanging_row_fails_only_its_trajectories():
    score = score_with("hangs_on", timeout_s=0.2)
    out = score_bundle(score, *[hanging_group(f"g{i}", 2, hang=i % 2 == 0) for i in range(4)])
    assert [g["reward"][0] == 1.0 for g in out] == [False, True, False, True]
    assert all(g["stage_error"] == "" for g in out)  # 2 timeouts, then a success: never 3 in a row


def test_a_row_that_kills_its_process_fails_only_its_trajectories():
    """A poison row (os._exit in the reward) fails its trajectories by name, after one retry in a new process;
    the actor, and the rows after it, go on."""
    score = score_with("exits_on")
    poison = {**hanging_group("p", 2), "row": json.dumps({"poison": True})}
    out = score_bundle(score, poison, hanging_group("ok", 2, hang=False))
    assert out[0]["reward_error"] == [
        f"rewards_for_tests:exits_on killed its process (exit code 1) on trajectory p/{i} of task 'main' (prompt "
        "'1+1='), twice; this trajectory fails, the stage goes on" for i in range(2)]
    assert out[1]["reward"] == [1.0, 1.0] and out[1]["reward_error"] == ["", ""]
    assert score.process.spawned == 5  # per poison trajectory: its process and one retry; then one for the rest


def test_a_process_killed_from_outside_once_costs_nothing(tmp_path):
    """One death is retried on a new process (the OOM killer, a kill): the row still scores."""
    pidfile = str(tmp_path / "pids")
    score = score_with("hangs_on")
    assert score.score_one("2", "2", "1+1=", {"pidfile": pidfile}) == (1.0, "")
    os.kill(score.process.proc.pid, signal.SIGKILL)
    assert score.score_one("2", "2", "1+1=", {"pidfile": pidfile}) == (1.0, "")
    assert score.process.spawned == 2


def pids(path: str) -> list[int]:
    with open(path) as f:
        return [int(p) for p in f.read().split()]


# ------------------------------------------------------------------------------------------ failure rate
def test_failure_rate_stops_a_dead_reward_after_its_first_answers_in_a_row():
    rate = FailureRate("score")
    rate.add(["exact_match raised ValueError: bad"] * (DEAD_WINDOW - 1))
    assert not rate.too_high()
    rate.add([""])  # one answer scored: the run of failures starts again
    rate.add(["exact_match raised ValueError: bad"] * (DEAD_WINDOW - 1))
    assert not rate.too_high()
    rate.add(["exact_match raised ValueError: bad"])
    assert rate.too_high()  # the last 64 answers all failed


def test_failure_rate_needs_a_full_window_and_more_than_half():
    half = FailureRate("score", window=64, dead=64)
    half.add(["x", ""] * 32)
    assert not half.too_high()  # exactly half
    half.add(["x", "x"])
    assert half.too_high()  # 33 of the last 64
    young = FailureRate("score", window=64, dead=64)
    young.add(["x", "x", ""] * 21)
    assert not young.too_high()  # 42 of 63 failed, but the window is not full yet


def test_failure_rate_forgets_old_failures():
    rate = FailureRate("score", window=8, dead=8)
    rate.add(["x"] * 7 + [""] * 5)
    assert not rate.too_high()


def answers_of_steps(steps: int, fail_share: float, seed: int = 0, groups_per_step: int = 16, group_size: int = 8):
    """The quickstart's answers (16 groups x 8 per step) as the reward stream delivers them, one group per batch:
    (errors, group ids) per batch, each answer failing with probability `fail_share` on its own (seeded)."""
    import random

    rng = random.Random(seed)
    for g in range(steps * groups_per_step):
        yield ([("flaky raised ValueError: nan" if rng.random() < fail_share else "") for _ in range(group_size)],
               [f"g{g}"] * group_size)


@pytest.mark.parametrize("seed", range(5))
def test_a_reward_failing_on_30_percent_of_answers_never_stops_40_steps(seed):
    """Issue #45's flaky reward: about 30% of answers fail, each on its own. Over the quickstart's 40 steps (5,120
    answers, judged after every group) the rule never trips. The old rule (more than half of the last 64) tripped on
    6% of such seeded streams, seed 1 here among them. Seeded, so each case is one fixed stream."""
    rate, failed, seen = FailureRate("score"), 0, 0
    for errors, gids in answers_of_steps(40, 0.3, seed):
        rate.add(errors, gids)
        failed, seen = failed + sum(map(bool, errors)), seen + len(errors)
        assert not rate.too_high(), rate.describe()
    assert seen == 5120 and 0.27 < failed / seen < 0.33  # the stream really failed on about 30%


def test_a_dead_reward_stops_within_its_first_groups():
    rate, groups = FailureRate("score"), 0
    for errors, gids in answers_of_steps(40, 1.0):
        rate.add(errors, gids)
        groups += 1
        if rate.too_high():
            break
    assert groups == DEAD_WINDOW // 8  # 8 groups of 8: the first 64 answers, seconds into a run
    assert rate.describe() == "64 of the last 64 answers failed (in 8 of their 8 groups; last: flaky raised ValueError: nan)"


def test_a_reward_failing_on_most_answers_stops_after_a_window():
    rate = FailureRate("score")
    for errors, gids in answers_of_steps(40, 0.7):
        rate.add(errors, gids)
        if rate.too_high():
            break
    assert rate.too_high() and len(rate.recent) == FAILURE_WINDOW
    failed = rate.failed()
    assert failed > FAILURE_WINDOW // 2
    assert rate.describe().startswith(f"{failed} of the last 512 answers failed (in ")
    assert "of their 64 groups; last: flaky raised ValueError: nan)" in rate.describe()


def test_failure_rate_error_is_a_runtime_error_and_a_pipeline_problem():
    rate = FailureRate("score")
    rate.add(["exact_match raised ValueError: no"] * 63 + ["exact_match returned 'x' (str), not a number"],
             [f"g{i // 8}" for i in range(64)])
    err = rate.error("p.yaml", "exact_match")
    assert isinstance(err, RuntimeError) and isinstance(err, PipelineInvalid) and isinstance(err, RewardStageFailing)
    (p,) = err.problems
    assert (p.loc, p.rule) == (("stages", "score", "fn"), "reward-failing")
    assert p.message == ("64 of the last 64 answers failed (in 8 of their 8 groups; last: exact_match returned 'x' "
                         "(str), not a number)")
    assert p.fix == "fix the reward function 'exact_match': it must return a finite number within 30 s (try it on a few rows)"
    assert str(err) == f"{p.message}; {p.fix} [reward-failing]"  # one line: "reward stage 'score' failed: ..."
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
    rs.reward_timeout_s = 0.2
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
    assert [type(e) for e in events] == [Rewarded, Rewarded, StreamFailed]  # 64 failed after two bundles: stop there
    stage, err = events[-1].stage, events[-1].error
    assert stage == "score" and isinstance(err, RuntimeError)
    assert str(err).startswith("64 of the last 64 answers failed (in 16 of their 16 groups; last: mine:fn raised "
                               "ValueError: no); ")


def test_stream_stops_its_stage_at_once_when_a_score_actor_hung():
    hung = bundle(1, True)
    groups = hung.column("groups").to_pylist()[0]
    groups[0]["stage_error"] = "mine:fn timed out on 3 calls in a row (0.2 s each; the last on trajectory g0/3 ...)"
    events = drain(stream_over([bundle(2, False, 5), pa.Table.from_pydict({"groups": [groups]})]))
    assert [type(e) for e in events] == [Rewarded, StreamFailed]
    err = events[-1].error
    assert isinstance(err, RewardStageFailing) and isinstance(err, RuntimeError)
    (p,) = err.problems
    assert (p.loc, p.rule) == (("stages", "score", "fn"), "reward-hangs")
    assert str(err) == (f"{groups[0]['stage_error']}; fix the reward function 'mine:fn': it must return within 0.2 s "
                        "(try it on that row) [reward-hangs]")


def test_stream_with_some_failures_goes_on():
    bundles = [bundle(4, i % 3 == 0, 4 * i) for i in range(12)]  # a third of the groups fail
    events = drain(stream_over(bundles))
    assert [type(e) for e in events[:-1]] == [Rewarded] * 12  # then the end-of-source error of a stream not closed
    assert isinstance(events[-1], StreamFailed) and "reward stream 'score' stopped" in str(events[-1].error)


def test_timeout_is_a_documented_module_constant():
    assert reward_stream.REWARD_TIMEOUT_S == 30.0
    assert Score("exact_match").timeout_s == reward_stream.REWARD_TIMEOUT_S
