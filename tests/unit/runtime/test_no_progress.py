"""A run that is busy but trains nothing stops (rlflow/runtime/watchdog.py ProgressCheck): it counts the groups
that can never be trained since the last TRAINED step, not the events that feed the stall watchdog."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlflow.compiler import compile_pipeline
from rlflow.errors import PipelineInvalid, RunFailed
from rlflow.runtime.messages import ScoredBatch, ScoredTrajectory
from rlflow.runtime.watchdog import NO_PROGRESS_BATCHES, NoProgress, ProgressCheck

REPO = Path(__file__).resolve().parents[3]


def scored(groups: dict[str, list[tuple[float, str, bool]]]) -> ScoredBatch:
    """A reward stream's batch: {group id: [(reward, reward_error, kept), ...]}."""
    return ScoredBatch([ScoredTrajectory(f"{gid}/{i}", gid, "main", r, err, kept)
                        for gid, members in groups.items() for i, (r, err, kept) in enumerate(members)])


def test_filtered_groups_stop_the_run_naming_the_filter_and_the_way_out():
    check = ProgressCheck(6, {"score": "drop_uniform_groups"})
    zeros = [(0.0, "", False)] * 4
    check.scored_batch("score", scored({"g1": zeros, "g2": zeros, "g3": zeros}))
    check.scored_batch("score", scored({"g4": [(1.0, "", True), (0.0, "", True)], "g5": zeros}))  # g4 is trainable
    with pytest.raises(NoProgress) as e:
        check.scored_batch("score", scored({"g6": [(0.0, "boom", False)] * 4, "g7": zeros}))
    assert isinstance(e.value, RunFailed)  # exit 3
    msg = str(e.value)
    assert msg.startswith("no train step in 7 scored groups: 5 filtered by drop_uniform_groups (reward stage "
                          "'score'); 1 with every reward failed (the train stage's no_progress_groups is 6)")
    assert "their rewards: 0 x20" in msg
    assert "Check the reward on a few completions" in msg and "turn the group filter off" in msg
    assert "start from a model that can earn rewards" in msg


def test_a_trained_step_is_progress():
    check = ProgressCheck(4, {})
    zeros = [(0.0, "", False)] * 2
    for round_ in range(5):  # 3 untrainable groups per step, 15 in all: never 4 without a step between
        check.scored_batch("score", scored({f"{round_}-{i}": zeros for i in range(3)}))
        check.trained()
    check.scored_batch("score", scored({"a": zeros, "b": zeros, "c": zeros}))
    with pytest.raises(NoProgress, match="no train step in 4 scored groups: 4 filtered by its filter"):
        check.scored_batch("score", scored({"d": zeros}))


def test_kept_groups_waiting_for_a_slow_trainer_are_not_counted():
    check = ProgressCheck(2, {})
    check.scored_batch("score", scored({f"g{i}": [(1.0, "", True), (0.0, "", True)] for i in range(100)}))
    assert check.scored_groups == 100 and sum(check.filtered.values()) == 0


def test_no_progress_groups_is_lowered_into_the_plan_and_bounded():
    pipeline = REPO / "pipelines" / "quickstart.yaml"
    trainer = lambda plan: next(a for a in plan["actors"] if a["role"] == "trainer")  # noqa: E731
    assert trainer(compile_pipeline(pipeline))["no_progress_groups"] is None  # the driver takes 50 x batch_size
    assert NO_PROGRESS_BATCHES == 50
    assert trainer(compile_pipeline(pipeline, ["stages.train.no_progress_groups=8"]))["no_progress_groups"] == 8
    with pytest.raises(PipelineInvalid, match="no_progress_groups"):
        compile_pipeline(pipeline, ["stages.train.no_progress_groups=0"])
    with pytest.raises(ValueError):
        ProgressCheck(0, {})


def test_a_run_whose_every_group_so_far_is_untrainable_is_warned_once_after_a_batch():
    said: list[str] = []
    check = ProgressCheck(100, {"score": "drop_uniform_groups"}, warn_at=4, log=said.append)
    zeros = [(0.0, "", False)] * 4
    check.scored_batch("score", scored({f"g{i}": zeros for i in range(3)}))
    assert said == []  # not yet a batch's worth
    check.scored_batch("score", scored({"g3": zeros}))
    assert len(said) == 1 and said[0].startswith("warning: no train step in 4 scored groups: 4 filtered by "
                                                 "drop_uniform_groups (reward stage 'score')")
    assert "their rewards: 0 x16" in said[0] and "stops if this goes on for 100 groups" in said[0]
    check.scored_batch("score", scored({f"h{i}": zeros for i in range(8)}))
    assert len(said) == 1  # once


def test_no_warning_when_some_groups_were_trainable():
    said: list[str] = []
    check = ProgressCheck(100, {}, warn_at=2, log=said.append)
    check.scored_batch("score", scored({"a": [(1.0, "", True), (0.0, "", True)]}))
    check.scored_batch("score", scored({f"g{i}": [(0.0, "", False)] * 2 for i in range(5)}))
    assert said == []  # the filter drops some groups, as it should: not every one
