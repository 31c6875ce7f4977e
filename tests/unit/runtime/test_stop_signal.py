"""A run stopped by a signal exits 128 + its number (Ctrl-C 130, SIGTERM 143); after SIGTERM the stop is bounded by a
grace period, past which the process exits 143 saying what it was waiting for."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlflow.cli import main
from rlflow.errors import PipelineInvalid
from rlflow.runtime import launch
from rlflow.runtime.stop_signal import Grace, StoppedAgain, exit_code, grace_s

REPO = Path(__file__).resolve().parents[3]


def rlflow_run_with(run_class, tmp_path, monkeypatch) -> int:
    """`rlflow run` of a compiled quickstart through the CLI and launch(), with `run_class` for the driver's Run and
    no cluster (as if one were joined)."""
    import ray

    import rlflow.runtime.driver as driver

    monkeypatch.chdir(tmp_path)
    assert main(["compile", str(REPO / "pipelines" / "quickstart.yaml")]) == 0
    monkeypatch.setattr(driver, "Run", run_class)
    monkeypatch.setattr(launch, "preflight", lambda plan: None)
    monkeypatch.setattr(launch, "check_cluster", lambda *a: None)
    monkeypatch.setattr(ray, "nodes", lambda: [])
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    return main(["run"])


@pytest.mark.parametrize("stopped_by, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143), (None, 0)])
def test_rlflow_run_exits_128_plus_the_signal_that_stopped_it(tmp_path, monkeypatch, stopped_by, code):
    """Through the CLI and launch(); only the Run is stood in for (it stops as the driver's handler leaves it)."""
    class StoppedRun:
        def __init__(self, plan, *, out_dir, resume, log, clock=None):
            self.stop_requested, self.stop_signal = stopped_by is not None, stopped_by

        def run(self):
            pass

        def summary(self):
            return {"steps": 1}

    assert rlflow_run_with(StoppedRun, tmp_path, monkeypatch) == code


def test_a_second_sigterm_while_stopping_exits_143_saying_what_was_left(tmp_path, monkeypatch, capsys):
    class AgainRun:
        def __init__(self, plan, **kwargs):
            pass

        def run(self):  # what Run._on_stop_signal raises on the second signal
            raise StoppedAgain(signal.SIGTERM, "the export of step 3 (its checkpoint is saved)")

    assert rlflow_run_with(AgainRun, tmp_path, monkeypatch) == 143 == exit_code(signal.SIGTERM)
    assert capsys.readouterr().err.strip().endswith(
        "SIGTERM again: quit at once, without the export of step 3 (its checkpoint is saved); rlflow run --resume "
        "continues from the last checkpoint")


def test_a_signal_after_the_run_is_rlflows_not_rays(tmp_path, monkeypatch, capsys):
    """Between the driver's handler going and the process exiting (the summary, Ray's shutdown) a stop signal is
    still rlflow's: 143 and what was left, not Ray's exit 15 with nothing said."""
    class DoneRun:
        history = [{"step": 1}]
        stop_requested, stop_signal = False, None

        def __init__(self, plan, **kwargs):
            pass

        def run(self):
            pass

        def summary(self):
            os.kill(os.getpid(), signal.SIGTERM)  # arrives while launch() writes the summary
            return {"steps": 1}

    before = signal.getsignal(signal.SIGTERM)
    assert rlflow_run_with(DoneRun, tmp_path, monkeypatch) == 143
    assert "SIGTERM: quit at once, without the run's summary and Ray's shutdown" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGTERM) is before


STUCK = """
import signal, sys, time
from rlflow.runtime.stop_signal import Grace
Grace(signal.SIGTERM, lambda: "the checkpoint of step 7", log=print, seconds=float(sys.argv[1]))
print("stopping", flush=True)
time.sleep(60)  # a checkpoint that never finishes
"""


def test_a_stop_that_outlasts_its_grace_exits_143_saying_what_it_waited_for():
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-c", STUCK, "0.5"], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 143, done
    assert time.monotonic() - t0 < 30
    assert "SIGTERM: the stop did not finish within its grace of 0.5 s (RLFLOW_STOP_GRACE_S); it was waiting for " \
           "the checkpoint of step 7. Exiting without it" in done.stdout, done.stdout


def test_a_stop_that_finishes_cancels_its_grace():
    exited = []
    grace = Grace(signal.SIGTERM, lambda: "nothing", log=exited.append, seconds=0.3)
    grace.cancel()
    grace.thread.join(timeout=5)
    assert not grace.thread.is_alive() and exited == []  # no message, no exit: this test process lives on


def test_the_grace_is_set_in_seconds_by_the_environment(monkeypatch):
    assert grace_s() == 120.0
    monkeypatch.setenv("RLFLOW_STOP_GRACE_S", "45")
    assert grace_s() == 45.0
    monkeypatch.setenv("RLFLOW_STOP_GRACE_S", "soon")
    with pytest.raises(PipelineInvalid) as e:
        grace_s()
    (p,) = e.value.problems
    assert p.rule == "stop-grace" and "RLFLOW_STOP_GRACE_S='soon' is not a number of seconds > 0" in p.message
