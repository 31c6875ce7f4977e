"""Every run has its own directory; `rlflow run --resume [RUN]` finds the newest resumable run or a named one."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest

from rlflow.cli import main
from rlflow.compiler import compile_pipeline
from rlflow.errors import PipelineInvalid
from rlflow.plan_model import Plan
from rlflow.runtime import launch, run_lock
from rlflow.runtime.launch import LATEST, find_run, list_runs, new_run_dir, new_run_id

REPO = Path(__file__).resolve().parents[3]
QUICKSTART = REPO / "pipelines" / "quickstart.yaml"
# the compiled quickstart as pipeline 'quick' (what the run directories below are named after); no cluster address
PLAN = Plan.of({**compile_pipeline(QUICKSTART), "name": "quick", "source": "pipelines/quick.yaml"})


def checkpointed(run_dir: Path) -> Path:
    (run_dir / "state.json").write_text("{}")
    return run_dir


def test_run_id_is_a_utc_timestamp_and_a_suffix():
    run_id = new_run_id(now=1795407302.0)  # 2026-11-23 04:15:02 UTC
    assert re.fullmatch(r"20261123-041502-[0-9a-f]{4}", run_id), run_id


def test_each_run_gets_its_own_directory(tmp_path):
    a, b = new_run_dir(PLAN, tmp_path), new_run_dir(PLAN, tmp_path)
    assert a != b and a.parent == b.parent == tmp_path / "quick"
    info = json.loads((a / "run.json").read_text())
    assert info["run_id"] == a.name and info["pipeline"] == "quick" and info["source"] == PLAN["source"]
    assert list_runs("quick", tmp_path) == [a, b]


def test_resume_takes_the_newest_run_with_a_checkpoint(tmp_path):
    old = checkpointed(new_run_dir(PLAN, tmp_path))
    time.sleep(0.01)
    newer = checkpointed(new_run_dir(PLAN, tmp_path))
    assert find_run(PLAN, LATEST, tmp_path) == newer
    time.sleep(0.01)
    newest = new_run_dir(PLAN, tmp_path)  # started, never checkpointed
    said = []
    assert find_run(PLAN, LATEST, tmp_path, log=said.append) == newer
    assert said == [f"resuming run {newer.name}: the newer run(s) {newest.name} have no checkpoint"]
    assert find_run(PLAN, old.name, tmp_path) == old  # by run id
    assert find_run(PLAN, str(old), tmp_path) == old  # by path


def test_resume_with_no_run_says_what_to_do(tmp_path):
    with pytest.raises(PipelineInvalid) as e:
        find_run(PLAN, LATEST, tmp_path)
    (p,) = e.value.problems
    assert (p.loc, p.rule) == (("--resume",), "no-run") and "no run of pipeline 'quick' to resume" in p.message
    assert "run without --resume first" in p.fix
    new_run_dir(PLAN, tmp_path)
    with pytest.raises(PipelineInvalid) as e:
        find_run(PLAN, LATEST, tmp_path)
    (p,) = e.value.problems
    assert p.rule == "no-checkpoint" and "(no checkpoint)" in p.message and "run without --resume" in p.fix


def test_resume_of_an_unknown_run_lists_the_runs(tmp_path):
    run = checkpointed(new_run_dir(PLAN, tmp_path))
    with pytest.raises(PipelineInvalid) as e:
        find_run(PLAN, "20200101-000000-beef", tmp_path)
    (p,) = e.value.problems
    assert p.rule == "no-run" and run.name in p.message


def test_a_checkpoint_from_before_run_directories_is_still_resumed(tmp_path):
    (tmp_path / "quick").mkdir()
    legacy = checkpointed(tmp_path / "quick")
    assert find_run(PLAN, LATEST, tmp_path) == legacy
    time.sleep(0.01)
    newer = checkpointed(new_run_dir(PLAN, tmp_path))
    assert find_run(PLAN, LATEST, tmp_path) == newer


def test_rlflow_run_resume_without_a_run_exits_2_before_ray(tmp_path, monkeypatch, capsys):
    import ray

    monkeypatch.chdir(tmp_path)
    assert main(["compile", str(QUICKSTART)]) == 0
    capsys.readouterr()
    for argv in (["run", "--resume"], ["run", "--resume", ".rlflow/plan.json"], ["run", ".rlflow/plan.json", "--resume"]):
        monkeypatch.setattr(ray, "is_initialized", lambda: False)  # ray.init would run (and fail: unit tests forbid it)
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert "Traceback" not in err
        assert err.strip().splitlines()[1] == (
            f"  --resume: no run of pipeline 'quickstart' to resume (nothing in {Path('.rlflow/runs/quickstart')}); "
            "run without --resume first (Ctrl-C saves a checkpoint) [no-run]")
    assert main(["run", "--resume", "20200101-000000-beef"]) == 2
    assert "no run '20200101-000000-beef' of pipeline 'quickstart'" in capsys.readouterr().err


def test_launch_runs_in_a_new_directory_or_the_resumed_one(tmp_path, monkeypatch):
    """launch() decides out_dir: a new run directory, or the resumed run's own (Run itself is stubbed)."""
    import ray

    import rlflow.runtime.driver as driver

    made = []

    class FakeRun:
        def __init__(self, plan, *, out_dir, resume, log, clock=None):
            made.append((Path(out_dir), resume))
            self.out_dir, self.stop_requested, self.stop_signal = Path(out_dir), False, None

        def run(self):  # the run directory is this process's own while it runs
            assert run_lock.holder(self.out_dir)["pid"] == os.getpid()

        def summary(self):
            return {"steps": 0}

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(driver, "Run", FakeRun)
    monkeypatch.setattr(launch, "preflight", lambda plan: None)
    monkeypatch.setattr(launch, "check_cluster", lambda *a: None)  # no cluster to ask (tests/unit/test_multinode_parts.py)
    monkeypatch.setattr(ray, "nodes", lambda: [])
    monkeypatch.setattr(ray, "is_initialized", lambda: True)  # as if joined: no cluster is started
    plan = PLAN
    assert plan.resources.cluster["address"] is None
    said = []
    first = launch.launch(plan, log=said.append)
    assert made[-1] == (Path(first["run_dir"]), False) and Path(first["run_dir"]).parent == Path(".rlflow/runs/quick")
    assert said[0] == f"run directory: {first['run_dir']}"
    assert said[1].startswith("done: 0 of 100 steps in ") and said[-1].startswith(f"next: rlflow eval {first['run_dir']}")
    assert json.loads((Path(first["run_dir"]) / "summary.json").read_text())["run_dir"] == first["run_dir"]
    second = launch.launch(plan, log=said.append)
    assert second["run_dir"] != first["run_dir"]
    checkpointed(Path(first["run_dir"]))
    resumed = launch.launch(plan, resume=True, log=said.append)
    assert made[-1] == (Path(first["run_dir"]), True) and resumed["run_dir"] == first["run_dir"]
    assert launch.launch(plan, resume=Path(first["run_dir"]).name, log=said.append)["run_dir"] == first["run_dir"]
    assert run_lock.holder(Path(first["run_dir"])) is None  # released when the run ended

    def fails(self):
        raise RuntimeError("a run that fails")

    monkeypatch.setattr(FakeRun, "run", fails)
    with pytest.raises(RuntimeError, match="a run that fails"):
        launch.launch(plan, resume=True, log=said.append)
    assert run_lock.holder(Path(first["run_dir"])) is None  # also when it failed
