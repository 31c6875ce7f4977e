"""`rlflow run PIPELINE.yaml` in an 80-column terminal (issue #32): no warning printed twice, the progress line redrawn in
place and never wider than the terminal, a short summary at the end, the JSON summary and the log file in the run
directory; the pipeline is compiled first where `rlflow compile` writes its plan, and the overrides given to `run`
apply to that run alone, recorded in its run directory. The run is a subprocess on a pseudo-terminal, as a person
would start it; it starts its own Ray."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time
from collections import Counter

import pytest
from runs import REPO

pytestmark = pytest.mark.integration
QUICKSTART = REPO / "pipelines" / "quickstart.yaml"
COLUMNS = 80
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
WORKER_PREFIX = re.compile(r"^\((\S+) pid=\d+\)\s*")  # Ray's prefix on a worker's line


def run_on_a_terminal(args: list[str], cwd, timeout_s: float = 600) -> tuple[int, str]:
    """Run `args` with a pseudo-terminal of COLUMNS columns as stdin, stdout and stderr; its exit code and output."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, COLUMNS, 0, 0))
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "NO_COLOR")}
    env |= {"COLUMNS": str(COLUMNS), "LINES": "24", "TERM": "xterm-256color", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(args, cwd=cwd, env=env, stdin=slave, stdout=slave, stderr=slave, start_new_session=True)
    os.close(slave)
    out, deadline = b"", time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 1.0)
            if not ready:
                if proc.poll() is not None:
                    break
                continue
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: every holder of the terminal closed it
                break
            if not data:
                break
            out += data
        else:
            proc.kill()
        return proc.wait(timeout=60), out.decode("utf-8", "replace")
    finally:
        os.close(master)


def visible_lines(raw: str) -> list[str]:
    """What stays on the screen: for each line, the text after its last carriage return (a redraw), escapes removed."""
    return [ANSI.sub("", line).split("\r")[-1] if line.rstrip("\r") else "" for line in
            (ln[:-1] if ln.endswith("\r") else ln for ln in raw.split("\n"))]


def test_a_quickstart_run_in_an_80_column_terminal_stays_readable(workdir):
    steps = 4
    overrides = [f"stages.train.steps={steps}", "stages.buffer.batch_groups=2", "stages.rollout.group_size=4"]
    code, raw = run_on_a_terminal([sys.executable, "-m", "rlflow.cli", "run", str(QUICKSTART), *overrides], workdir)
    assert code == 0, raw[-6000:]
    drawn = [row for line in ANSI.sub("", raw).split("\n") for row in line.split("\r")
             if re.search(r"step \d+/\d+  reward\(all\)", row)]
    assert drawn and all(len(row) <= COLUMNS for row in drawn), [r for r in drawn if len(r) > COLUMNS]
    assert "\r\x1b[2K" in raw  # the progress line is redrawn over itself, not printed below
    shown = visible_lines(raw)
    steps_shown = [line for line in shown if re.search(r"step \d+/\d+  reward\(all\)", line)]
    assert len(steps_shown) == 1 and f"step {steps}/{steps}" in steps_shown[0], steps_shown  # one line, no stale rows
    warnings = Counter(WORKER_PREFIX.sub("", line).strip() for line in shown if re.search(r"warn", line, re.IGNORECASE))
    assert not [w for w, n in warnings.items() if n > 1], warnings
    assert not [w for w in warnings if w.startswith("warning: no train step")], warnings  # the quickstart learns
    for harmless in ("Started a local Ray instance", "has constructor arguments in the object store",
                     "Creating initial MLflow database tables"):
        assert harmless not in raw
    # no WARNING line at all (DeepSpeed's "Setting accelerator to CPU", logged when the export imports it, goes to
    # run.log), no materialised-model line of an actor, and no traceback
    assert not [line for line in shown if "WARNING" in line], [line for line in shown if "WARNING" in line]
    assert "Traceback" not in raw and "materialised" not in raw, raw[-6000:]
    assert any(line.startswith(f"done: {steps} steps in ") for line in shown), shown[-12:]
    (run_dir,) = (workdir / ".rlflow" / "runs" / "quickstart").iterdir()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == steps and summary["run_dir"] == str(run_dir.relative_to(workdir))
    logged = (run_dir / "run.log").read_text()
    assert "Started a local Ray instance" in logged
    import torch

    if not torch.cuda.is_available():  # DeepSpeed picks the CPU and says so: here, not on the terminal
        assert "Setting accelerator to CPU" in logged
    assert not raw.lstrip().startswith("{") and '"workload_measured"' not in raw  # the JSON is in the file, not printed
    # compiled first, as `rlflow compile` would; the overrides are this run's alone
    assert f"compiled {QUICKSTART} to .rlflow/plan.json" in raw, raw[-6000:]
    assert json.loads((workdir / ".rlflow" / "plan.json").read_text())["overrides"] == []  # the shared plan, as compiled
    assert json.loads((run_dir / "run.json").read_text())["overrides"] == overrides
    ran = json.loads((run_dir / "plan.json").read_text())
    assert ran["pipeline"]["stages"]["train"]["steps"] == steps and ran["overrides"] == overrides
