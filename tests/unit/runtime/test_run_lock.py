"""A run has one owner: a second `rlflow run` of a run directory is refused while its holder lives, named by pid
and host; the lock of a holder that died is taken over; two runs creating one MLflow store both succeed."""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlflow.cli import main
from rlflow.errors import PipelineInvalid, RunFailed
from rlflow.runtime import run_lock
from rlflow.runtime.run_lock import LOCK_FILE, acquire, holder, serialised

REPO = Path(__file__).resolve().parents[3]
HOLD = """
import sys, time
from rlflow.runtime.run_lock import acquire
lock = acquire(sys.argv[1], log=lambda *a: None)
print("locked", flush=True)
time.sleep(300)
"""


@pytest.fixture
def held(tmp_path):
    """A real process holding the lock of tmp_path/run; killed (by handle) at the end."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    line = proc.stdout.readline()  # the process prints once it holds the lock, or ends (EOF) if it cannot
    assert line.strip() == "locked", f"the holder process did not take the lock (exit {proc.poll()})"
    yield run_dir, proc
    proc.kill()
    proc.wait(timeout=10)


def test_a_live_holder_refuses_a_second_owner_naming_its_pid_and_host(held):
    run_dir, proc = held
    with pytest.raises(PipelineInvalid) as e:
        acquire(run_dir, source="pipelines/x.yaml")
    (p,) = e.value.problems
    assert p.rule == "run-in-use"
    assert f"process {proc.pid} on host {socket.gethostname()}" in p.message and run_dir.name in p.message
    assert f"kill -TERM {proc.pid}" in p.fix and "rlflow run without --resume" in p.fix
    assert holder(run_dir)["pid"] == proc.pid


def test_the_lock_of_a_killed_holder_is_taken_over_saying_whose_it_was(held):
    run_dir, proc = held
    proc.send_signal(signal.SIGKILL)  # no release: the file still names it, the kernel dropped the flock
    proc.wait(timeout=10)
    assert json.loads((run_dir / LOCK_FILE).read_text())["pid"] == proc.pid
    assert holder(run_dir) is None
    said = []
    with acquire(run_dir, log=said.append):
        assert holder(run_dir)["pid"] == os.getpid()
    assert len(said) == 1 and said[0].startswith(f"taking over run directory {run_dir}: its last owner, process")
    assert f"process {proc.pid} on host {socket.gethostname()}" in said[0] and "ended without releasing it" in said[0]
    assert (run_dir / LOCK_FILE).read_text() == "" and holder(run_dir) is None  # a clean release empties the file
    said.clear()
    acquire(run_dir, log=said.append).release()
    assert said == []  # nothing to take over after a clean release


def test_rlflow_run_resume_of_a_run_in_use_exits_2_before_ray(held, monkeypatch, capsys):
    """The second `rlflow run --resume` of a run is refused before Ray starts (unit tests make ray.init fail)."""
    import ray

    run_dir, proc = held
    monkeypatch.chdir(run_dir.parent)
    assert main(["compile", str(REPO / "pipelines" / "quickstart.yaml")]) == 0
    (run_dir / "state.json").write_text("{}")  # a checkpoint to resume
    capsys.readouterr()
    monkeypatch.setattr(ray, "is_initialized", lambda: False)  # ray.init would run, and fail the test
    assert main(["run", "--resume", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "[run-in-use]" in err, err
    assert f"is in use by process {proc.pid} on host {socket.gethostname()}" in err


def test_a_filesystem_without_locks_is_refused_by_name(tmp_path, monkeypatch):
    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(run_lock.fcntl, "flock", no_locks)  # what NFS without a lock manager answers
    with pytest.raises(PipelineInvalid) as e:
        acquire(tmp_path)
    (p,) = e.value.problems
    assert p.rule == "run-lock-unsupported" and "RLFLOW_RUN_LOCK=off" in p.fix
    monkeypatch.setenv("RLFLOW_RUN_LOCK", "off")
    said = []
    acquire(tmp_path, log=said.append).release()
    assert "not locked" in said[0]


def test_a_store_lock_wait_is_bounded_and_names_what_it_waited_for(tmp_path):
    lock = tmp_path / "mlflow.db.lock"
    with serialised(lock, what="creating the MLflow store x"):
        t0 = time.monotonic()
        with pytest.raises(RunFailed, match=r"waited 0.2 s for another process to finish creating the MLflow store x"):
            with serialised(lock, what="creating the MLflow store x", timeout_s=0.2):
                pass
        assert time.monotonic() - t0 < 2
    with serialised(lock, what="again"):  # released
        pass


TRACK = """
import sys, time
from pathlib import Path
import mlflow
from rlflow.compiler import compile_pipeline
from rlflow.plan_model import Plan
from rlflow.runtime.tracking import Tracker
raw = compile_pipeline(sys.argv[2])  # the quickstart, as pipeline 'race' with MLflow's defaults
raw["name"], raw["pipeline"]["tracking"]["mlflow"] = "race", {"uri": None, "experiment": None, "run_name": None}
plan = Plan.of(raw)
print("ready", flush=True)
go = Path(sys.argv[1])
while not go.exists():  # both processes past their imports, then at once
    time.sleep(0.01)
t = Tracker(plan)
t.end()
print("tracked", t.run_id, flush=True)
"""


def test_two_runs_creating_one_mlflow_store_both_succeed(tmp_path):
    """Two runs starting in a new directory both create mlflow.db at once (MLflow's migration raced: the second
    failed on "duplicate column" and exited 1)."""
    go = tmp_path / "go"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("MLFLOW_TRACKING_URI", None)
    quickstart = str(REPO / "pipelines" / "quickstart.yaml")
    procs = [subprocess.Popen([sys.executable, "-c", TRACK, str(go), quickstart], cwd=tmp_path, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    try:
        for p in procs:  # each prints "ready" once imported (or ends: EOF)
            assert p.stdout.readline().strip() == "ready", f"a tracker process ended early (exit {p.poll()})"
        go.touch()
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=10)
    assert [p.returncode for p in procs] == [0, 0], outs
    ids = {line.split()[1] for out in outs for line in out.splitlines() if line.startswith("tracked ")}
    assert len(ids) == 2, outs  # two MLflow runs in the one store


def test_rlflow_export_into_a_running_runs_directory_is_refused(held, capsys):
    """The run writes its own export/ when it ends; `rlflow export RUN` into the same place waits for it to end."""
    run_dir, proc = held
    (run_dir / "run.json").write_text("{}")
    assert main(["export", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert "[run-in-use]" in err and f"process {proc.pid}" in err and "now with --output DIR" in err, err
    main(["export", str(run_dir), "--output", str(run_dir.parent / "elsewhere")])  # reading it is fine
    assert "[run-in-use]" not in capsys.readouterr().err
