"""A checkpoint is one unit, published by one rename: a save killed at each of its write points, then resumed, trains
every step exactly once; a damaged newest checkpoint falls back to the previous one, saying so; a unit whose state
and trainer checkpoint disagree is refused. Real DeepSpeed (tiny Llama, ZeRO-1) and a real ledger, in one
subprocess that forks a child per scenario (tests/checkpoint_drill.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from checkpoint_drill import CHECKPOINT_EVERY, CRASH_STEP, STEPS

from rlflow.runtime.fault_points import FAULT_EXIT, POINTS

TESTS = Path(__file__).resolve().parents[2]
PUBLISHED = POINTS.index("published")  # a kill from this point on leaves the new checkpoint published
FILLED = POINTS[:POINTS.index("published")]  # where a save can still fail for lack of space (it writes)
SCENARIOS = (["reference"] + [f"fault:{p}" for p in POINTS] + [f"enospc:{p}" for p in FILLED] + ["damaged:truncated", "damaged:missing",
             "damaged:unloadable", "disagree:new", "disagree:old", "old_layout", "branch"])


@pytest.fixture(scope="module")
def drill(tmp_path_factory, tiny_llama_dir):
    """Runs every scenario once (one import of torch and DeepSpeed); returns name -> result."""
    model_dir = tiny_llama_dir
    work = tmp_path_factory.mktemp("drill")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    env.pop("RLFLOW_FAULT_AT", None)
    done = subprocess.run([sys.executable, str(TESTS / "checkpoint_drill.py"), model_dir, str(work), *SCENARIOS], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    results = {}
    for name in SCENARIOS:
        path = work / name.replace(":", "-") / "result.json"
        assert path.is_file(), f"scenario {name} wrote no result:\n{done.stdout[-2000:]}\n{done.stderr[-5000:]}"
        results[name] = json.loads(path.read_text()) | {"dir": path.parent}
    return results


def same_weights(a: Path, b: Path) -> None:
    wa, wb = np.load(a / "weights.npz"), np.load(b / "weights.npz")
    assert set(wa.files) == set(wb.files)
    for name in wa.files:
        np.testing.assert_allclose(wa[name], wb[name], atol=1e-6, err_msg=name)


def trained_once(result: dict, reference: dict) -> None:
    """STEPS optimizer steps and weights version STEPS, and the weights of a run that never stopped: a step trained
    twice (or skipped) moves them elsewhere. (The drill already checked the ledger: one group per step, none twice.)"""
    assert result["final"] == {"version": STEPS, "optimizer_steps": STEPS}
    same_weights(result["dir"], reference["dir"])


@pytest.mark.parametrize("point", FILLED)
def test_a_disk_full_at_each_write_point_is_a_named_stop_keeping_the_last_checkpoint(drill, point):
    """ENOSPC at each write of step 4's save: DiskFull (rule disk-full, `rlflow run` exits 3) naming the path and the
    bytes the last checkpoint took; the unpublished tag and staged pointer are removed (the space is what is short),
    state.json still names step-2, and once space is back the resume trains every step once."""
    r = drill[f"enospc:{point}"]
    assert r["status"] == 0, "the save did not raise DiskFull"
    assert r["said"].startswith(f"disk-full: the checkpoint of step {CRASH_STEP} failed at ") and "needed" in r["said"]
    assert "No space left on device (injected at" in r["said"] and "`rlflow run --resume` continues" in r["said"]
    assert r["left"] == [f"step-{CHECKPOINT_EVERY}"] and r["published_after_full"] == f"step-{CHECKPOINT_EVERY}"
    assert r["step"] == CHECKPOINT_EVERY
    trained_once(r, drill["reference"])


@pytest.mark.parametrize("point", POINTS)
def test_a_save_killed_at_each_write_point_resumes_training_every_step_once(drill, point):
    r = drill[f"fault:{point}"]
    assert r["crash_status"] == FAULT_EXIT  # killed at the point, not earlier or later
    published = POINTS.index(point) >= PUBLISHED
    expected = CRASH_STEP if published else CRASH_STEP - CHECKPOINT_EVERY
    assert r["step"] == expected and r["history"] == list(range(expected))  # the unit's own state
    assert r["counters"] == {"version": expected, "optimizer_steps": expected}  # the trainer agrees with it
    # the ledger reopened exactly the groups trained after the checkpoint resumed from
    reopened = sorted([int(g[1:]) for g in r["restore"]] + [int(p.split()[-1]) for p in r["replay"]])
    assert reopened == list(range(expected + 1, CRASH_STEP + 1))
    trained_once(r, drill["reference"])
    if not published:  # the unpublished tag is never overwritten: the next save of that step takes a fresh tag
        assert r["partial_existed"] and r["partial_untouched"]
        assert r["tags_after"] == [f"step-{CRASH_STEP}.1", f"step-{STEPS}"]
        assert any(f"tag step-{CRASH_STEP} already exists" in m and f"writing step-{CRASH_STEP}.1 instead" in m
                   for m in r["log"]), r["log"]
        if point in ("manifest_written", "pointer_staged"):  # complete, never published: out of this run's history
            assert any(m.startswith(f"checkpoint: step-{CRASH_STEP} left out of this run") for m in r["log"]), r["log"]
    else:
        assert r["tags_after"] == [f"step-{STEPS}"]
    assert r["published"] == f"step-{STEPS}"


@pytest.mark.parametrize("how, says", [("truncated", "mp_rank_00_model_states.pt has 1000 bytes, the manifest says"),
                                       ("missing", "zero_pp_rank_0_mp_rank_00_optim_states.pt is missing"),
                                       ("unloadable", "the trainer could not load it")])
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one_saying_so(drill, how, says):
    r = drill[f"damaged:{how}"]
    older = CRASH_STEP - CHECKPOINT_EVERY
    assert any(m.startswith(f"checkpoint step-{CRASH_STEP} is damaged (") and says in m for m in r["log"]), r["log"]
    assert any(m.startswith(f"resuming from checkpoint step-{older} (step {older}), not the newest") for m in r["log"])
    assert r["step"] == older and r["counters"] == {"version": older, "optimizer_steps": older}
    # checkpointed(4) had dropped the payloads of groups 3 and 4: the ledger generates them again from their prompts
    assert r["restore"] == [] and r["replay"] == [f"prompt {s}" for s in range(older + 1, CRASH_STEP + 1)]
    trained_once(r, drill["reference"])
    assert r["tags_after"] == [f"step-{CRASH_STEP}.1", f"step-{STEPS}"]  # the damaged tag is left as it was


def test_a_fallback_never_takes_a_checkpoint_of_a_discarded_history(drill):
    """step-4 was complete but never published when the save was killed; the resume from step-2 discarded it (its
    weights were trained on groups the ledger then generated again). With step-6 and step-4.1 damaged, the fallback
    goes to step-2, not to step-4."""
    r = drill["branch"]
    assert r["step"] == CRASH_STEP - CHECKPOINT_EVERY, r["log"]
    assert r["abandoned"] == [f"step-{CRASH_STEP}", f"step-{CRASH_STEP}.1", f"step-{STEPS}"]
    assert any(m.startswith(f"checkpoint step-{STEPS} is damaged") for m in r["log"])
    assert any(m.startswith(f"checkpoint step-{CRASH_STEP}.1 is damaged") for m in r["log"])
    assert not any(m.startswith(f"checkpoint step-{CRASH_STEP} is") for m in r["log"])  # never even tried


def test_a_unit_whose_state_and_trainer_checkpoint_disagree_is_refused(drill):
    r = drill["disagree:new"]
    assert "refused" in r, r
    assert f"checkpoint step-{CRASH_STEP} disagrees with itself" in r["refused"]
    assert f"the run state's step is 3 but the step its trainer checkpoint saved is {CRASH_STEP}" in r["refused"]


def test_an_older_rlflows_state_and_latest_that_disagree_are_refused(drill):
    """The issue's case: state.json at step 2, DeepSpeed's `latest` at step 4 (killed between the two writes). The
    older rlflow resumed "at step 2" on step-4 weights and trained steps 3-4 twice; now it is refused."""
    r = drill["disagree:old"]
    assert "refused" in r, r
    assert "says step 2 but the DeepSpeed checkpoint global_step4" in r["refused"]
    assert "holds step 4" in r["refused"] and "write the tag of step 2 into" in r["refused"]


def test_an_older_rlflows_run_directory_that_agrees_is_resumed_and_published_anew(drill):
    r = drill["old_layout"]
    assert r["step"] == 2 and r["counters"] == {"version": 2, "optimizer_steps": 2}
    assert any("resuming a run directory of an older rlflow from global_step2" in m for m in r["log"]), r["log"]
    trained_once(r, drill["reference"])
    assert r["tags_after"] == ["step-4", "step-6"] and r["published"] == "step-6"
