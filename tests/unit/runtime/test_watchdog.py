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
    now[0] += 1950.0
    steps[0] = 20  # 100 s per step on average
    assert dog.limit() == pytest.approx(20 * 100.0)
    now[0] += 5000.0  # a stall does not stretch its own limit: the mean runs to the last step
    assert dog.limit() == pytest.approx(20 * 100.0)


def test_a_resumed_run_waits_the_first_step_limit_for_its_own_first_step(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(watchdog.time, "monotonic", lambda: now[0])
    steps = [5]  # history restored from the checkpoint
    dog = Watchdog(lambda: steps[0])
    now[0] = 300.0
    assert dog.limit() == watchdog.STALL_FIRST_S
    steps[0] = 6  # its first step took 300 s
    assert dog.limit() == pytest.approx(20 * 300.0)


def test_check_raises_only_after_the_limit_and_says_what_it_waited_for(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(watchdog.time, "monotonic", lambda: now[0])
    dog = Watchdog(lambda: 0)
    now[0] = watchdog.STALL_FIRST_S - 1
    dog.check(lambda: "never asked")
    dog.fed()
    now[0] += watchdog.STALL_FIRST_S + 1
    with pytest.raises(RunStalled, match=r"nothing happened for 600 s \(the limit before the first step\); "
                                          r"waiting for: train step 3"):
        dog.check(lambda: "train step 3")


def test_the_stall_factor_sets_the_multiple_of_the_mean_step_time(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(watchdog.time, "monotonic", lambda: now[0])
    steps = [0]
    dog = Watchdog(lambda: steps[0], factor=3)
    now[0], steps[0] = 1000.0, 10  # 100 s per step: 3 x 100 = 300 s
    assert dog.limit() == pytest.approx(300.0)
    dog.fed()
    now[0] += 299.0
    dog.check(lambda: "never asked")
    now[0] += 2.0
    with pytest.raises(RunStalled, match=r"for 300 s \(3 x the mean step time of 100 s: the train stage's stall_factor\)"):
        dog.check(lambda: "reward stages score")
    assert Watchdog(lambda: 10, factor=2.5).factor == 2.5
    with pytest.raises(ValueError, match="stall factor must be > 1"):
        Watchdog(lambda: 0, factor=1)


def test_stall_factor_is_lowered_into_the_plan_and_bounded():
    from pathlib import Path

    from rlflow.compiler import compile_pipeline
    from rlflow.errors import PipelineInvalid

    pipeline = Path(__file__).resolve().parents[3] / "pipelines" / "quickstart.yaml"
    trainer = lambda plan: next(a for a in plan["actors"] if a["role"] == "trainer")
    assert trainer(compile_pipeline(pipeline))["stall_factor"] == watchdog.STALL_FACTOR == 20
    assert trainer(compile_pipeline(pipeline, ["stages.train.stall_factor=5"]))["stall_factor"] == 5
    for nonsense in ("0", "1.5", "1e9", "fast"):
        with pytest.raises(PipelineInvalid, match="stall_factor"):
            compile_pipeline(pipeline, [f"stages.train.stall_factor={nonsense}"])
