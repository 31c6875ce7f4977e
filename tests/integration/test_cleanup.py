"""A killed driver leaves nothing of its embedded Ray cluster behind: Ray's agents (which outlive it by 60-90 s on
their own, reaper.py) are ended within seconds by the reaper that `rlflow run` starts beside the cluster."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DRIVER = """
import time, ray
from rlflow.runtime import reaper
ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
node = ray.get_runtime_context().get_node_id()
reaper.start(node)  # as launch.py does for an embedded cluster
kids = reaper.children(__import__("os").getpid())
cluster = lambda: kids | reaper.descendants({p for p, _ in kids}) | reaper._of_node(node)
deadline = time.monotonic() + 180  # the agents start last; slower when the machine is busy
while not any("Agent" in reaper._name(p) for p, _ in cluster()) and time.monotonic() < deadline:
    time.sleep(0.2)
time.sleep(2 * reaper.WATCH_S)  # the reaper has seen them
print(" ".join(str(p) for p, _ in cluster()), flush=True)
time.sleep(300)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return False


def test_a_killed_driver_leaves_no_ray_process_behind(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_USAGE_STATS_ENABLED": "0"}
    proc = subprocess.Popen([sys.executable, "-c", DRIVER], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]  # the cluster's processes, once its agents run
        assert len(pids) >= 4, f"the driver listed {pids} (exit {proc.poll()})"
        names = {p: Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")[0].decode() for p in pids if _alive(p)}
        if not any("DashboardAgent" in n or "RuntimeEnvAgent" in n for n in names.values()):
            # seen once on a loaded machine: without its agents the cluster has nothing that outlives the driver
            pytest.skip(f"Ray's agents had not started after 180 s (the cluster's processes: {names})")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    deadline = time.monotonic() + 30  # the reaper's 5 s grace, then SIGTERM, 5 s, SIGKILL; Ray alone: 60-90 s
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = {p: names.get(p) for p in pids if _alive(p)}
    for p in left:  # the test ends what it started, by id, whatever the outcome
        os.kill(p, signal.SIGKILL)
    assert not left, f"still running {time.monotonic() - deadline + 30:.0f} s after the driver was killed: {left}"
