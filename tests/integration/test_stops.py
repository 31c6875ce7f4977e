"""Runs that would never end stop by name, on the real stack: every group filtered (exit 3 from NoProgress, with a
checkpoint); a train step that is not finite (exit 3, its weights neither published nor saved); every rollout
instance lost (exit 3, with the checkpoint the live trainer can write)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import runs

from rlflow.errors import RunFailed
from rlflow.runtime.watchdog import NoProgress

pytestmark = pytest.mark.integration


def stopped_run(plan: dict, error, log=lambda *a: None):
    from rlflow.runtime.driver import Run

    run = Run(plan, out_dir=Path(".rlflow") / "runs" / plan["name"], log=log)
    with pytest.raises(error) as e:
        run.run()
    return run, e.value


def test_a_run_whose_every_group_is_filtered_is_warned_then_stops_and_says_why(ray_cluster, workdir, monkeypatch):
    """A policy that never earns a reward under drop_uniform_groups: every scored group is filtered, which kept the
    stall watchdog fed forever. Four batches' worth of untrainable groups in a row (8 here) is said at once, naming
    the filter, seconds into the run; 40 of them with no train step stop the run, with a checkpoint. (One run for
    both: the stop at 4 groups was a second run of the same policy.)"""
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    said: list[tuple[float, str]] = []
    plan = runs.plan_for("quickstart", "stages.score.fn=rewards_for_tests:always_zero", "stages.train.no_progress_groups=40")
    run, err = stopped_run(plan, NoProgress, log=lambda *a, **k: said.append((time.monotonic(), " ".join(map(str, a)))))
    warnings = [(t, line) for t, line in said if line.startswith("warning: no train step in")]
    assert len(warnings) == 1, said
    t, line = warnings[0]
    assert "filtered by drop_uniform_groups (reward stage 'score')" in line and "stops if this goes on for 40 groups" in line
    first_scored = run.clock.t0 + run.clock.marks["first_scored"]
    assert t - first_scored < 60  # within a minute of the first scored groups
    assert isinstance(err, RunFailed)  # exit 3
    msg = str(err)
    assert "no train step in" in msg
    assert "filtered by drop_uniform_groups (reward stage 'score') (the train stage's no_progress_groups is 40)" in msg
    assert "their rewards: 0 x" in msg and "turn the group filter off" in msg
    assert run.history == [] and run.counts["filtered_groups"] >= 40
    assert run.saved_step == 0  # the trainer was alive: a checkpoint to resume from (after fixing the reward)


def test_a_step_that_makes_the_weights_non_finite_stops_the_run_unsaved(ray_cluster, workdir):
    """lr inf (compile refuses it: rule lr-out-of-range; here set in the plan behind its back): step 1's update is
    not finite; its weights are never published nor saved, and the run stops by name."""
    plan = runs.plan_for("quickstart", "stages.train.steps=2")
    next(a for a in plan["actors"] if a["role"] == "trainer")["trainer_kwargs"]["lr"] = float("inf")
    run, err = stopped_run(plan, RunFailed)
    assert str(err).startswith("train step 1 was not finite")
    assert "the update made the weights non-finite, so they were neither published nor saved; lower the train " \
           "stage's lr" in str(err)
    assert run.trainer_dead and run.saved_step is None and run.counts["nonfinite_steps"] == 1
    assert run.weights.version == 0  # rollouts never saw the poisoned weights


def test_losing_every_rollout_instance_stops_with_a_checkpoint(ray_cluster, workdir):
    """The rollout node lost (here its one instance killed after step 1, as a lost node kills it): a named stop,
    exit 3, with a checkpoint of the live trainer; once it was a RuntimeError, "a bug in rlflow"."""
    import ray

    from rlflow.runtime.driver import Run

    plan = runs.plan_for("quickstart", "stages.train.steps=50", "stages.train.checkpoint_every=0")
    run = Run(plan, out_dir=Path(".rlflow") / "runs" / plan["name"], log=lambda *a: None)
    killed = []

    def kill_after_step_1():
        deadline = time.monotonic() + 300
        while run.step < 1 and time.monotonic() < deadline:
            time.sleep(0.2)
        killed.append(run.step)
        ray.kill(run.fleets[0].instances[0].handle, no_restart=True)

    threading.Thread(target=kill_after_step_1, daemon=True).start()
    with pytest.raises(RunFailed) as e:
        run.run()
    assert killed and killed[0] >= 1
    assert "every instance of rollout stage 'rollout' has died (the last: ActorDiedError" in str(e.value)
    assert "rlflow run --resume continues from the checkpoint the run saves now" in str(e.value)
    assert not run.trainer_dead and run.saved_step == run.step >= 1
