"""`rlflow run --address` on a two-node Ray cluster started on this machine, exactly as a user would.

The nodes share this disk, so the test makes sure nothing is read through it: each node has its own model
cache ($RLFLOW_CACHE set on its `ray start`), the reward module lives beside the pipeline but not in the run's
working directory nor on any node's PYTHONPATH, and it records where it was imported from. The cluster is
separate processes with their own ports and temp dir (not the session's embedded cluster), stopped by pid.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
RAY = str(Path(sys.executable).parent / "ray")
RUN_TIMEOUT_S = 420

PIPELINE = """\
# a pipeline placed on two nodes: rollout where worker_node is, train where head_node is
name: multinode
model: {{path: "builtin:tiny-llama", max_model_len: 128}}
data: {{source: prompts.jsonl}}
stages:
  rollout: {{kind: rollout, engine: hf, group_size: 4, max_new_tokens: 8, resources: {{worker_node: 1}}}}
  score:   {{kind: reward, fn: "myreward:score"}}
  buffer:  {{kind: buffer, batch_groups: 2}}
  train:   {{kind: train, deepspeed: "{deepspeed}", steps: 2, lr: 1.0e-4, checkpoint_every: 0, resources: {{head_node: 1}}}}
edges:
  - {{from: data,    to: rollout, policy: {{kind: streaming}}}}
  - {{from: rollout, to: score,   policy: {{kind: streaming}}}}
  - {{from: score,   to: buffer,  policy: {{kind: streaming}}}}
  - {{from: buffer,  to: train,   policy: {{kind: barrier}}}}
  - {{from: train,   to: rollout, policy: {{kind: weight_sync}}}}
tracking: {{progress: false}}
"""

REWARD = """\
import os
from pathlib import Path

# where this process imported the module from (the test checks the workers got the shipped copy)
Path({markers!r}, f"{{os.getpid()}}.txt").write_text(os.path.abspath(__file__))


def score(completion, answer):
    return float(completion.strip() == answer)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node_ports() -> list[str]:
    """Every port a `ray start` would otherwise take at a fixed default (they clash with other clusters here)."""
    flags = ("--node-manager-port", "--object-manager-port", "--dashboard-agent-listen-port",
             "--dashboard-agent-grpc-port", "--runtime-env-agent-port", "--metrics-export-port")
    return [f"{flag}={free_port()}" for flag in flags]


def ray_start(args: list[str], env: dict, log: Path) -> None:
    with open(log, "a") as out:
        done = subprocess.run([RAY, "start", *args, "--disable-usage-stats", "--object-store-memory=100000000",
                               *node_ports()],
                              env=env, stdout=out, stderr=subprocess.STDOUT, timeout=120)
    assert done.returncode == 0, log.read_text()[-3000:]


def stop_nodes(temp_dir: str) -> None:
    """End the processes of the nodes started with `temp_dir` (their command lines name it) and their children
    (Ray's workers retitle themselves), by pid: SIGTERM, then SIGKILL after a grace period."""
    import psutil

    procs: dict[int, psutil.Process] = {}
    for p in psutil.process_iter(["cmdline"]):
        try:
            if any(temp_dir in arg for arg in p.info["cmdline"] or []):
                procs[p.pid] = p
                procs.update((c.pid, c) for c in p.children(recursive=True))
        except psutil.Error:
            continue
    for p in procs.values():
        try:
            p.send_signal(signal.SIGTERM)
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(list(procs.values()), timeout=5)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass


def test_run_on_two_nodes_places_stages_and_ships_model_code_and_data(tmp_path):
    project, workdir, markers = tmp_path / "project", tmp_path / "run", tmp_path / "markers"
    for d in (project, workdir, markers):
        d.mkdir()
    (project / "pipeline.yaml").write_text(PIPELINE.format(deepspeed=REPO / "configs" / "deepspeed" / "zero1.json"))
    (project / "myreward.py").write_text(REWARD.format(markers=str(markers)))
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(1, 7) for b in range(1, 7)]
    (project / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    caches = {"head": tmp_path / "head-cache", "worker": tmp_path / "worker-cache"}

    base = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RLFLOW_CACHE")}
    base.update(OMP_NUM_THREADS="1", RAY_AUTH_MODE="token", HF_HUB_OFFLINE="1")
    # Ray's unix sockets live under the temp dir and their paths may not exceed ~107 bytes: a short one in /tmp
    temp_dir = tempfile.mkdtemp(prefix="rf-mn-", dir="/tmp")
    port = free_port()
    log = tmp_path / "ray-start.log"
    started = time.monotonic()
    try:
        ray_start(["--head", f"--port={port}", "--num-cpus=4", '--resources={"head_node": 1}', f"--temp-dir={temp_dir}/head",
                   f"--ray-client-server-port={free_port()}", "--include-dashboard=false"], base | {"RLFLOW_CACHE": str(caches["head"])}, log)
        ray_start([f"--address=127.0.0.1:{port}", "--num-cpus=1", '--resources={"worker_node": 1}',
                   f"--temp-dir={temp_dir}/worker"], base | {"RLFLOW_CACHE": str(caches["worker"])}, log)

        rlflow = [sys.executable, "-m", "rlflow.cli"]
        t0 = time.monotonic()
        env = base | {"RAY_DEDUP_LOGS": "0"}
        compiled = subprocess.run([*rlflow, "compile", str(project / "pipeline.yaml")], cwd=workdir, env=env,
                                  capture_output=True, text=True, timeout=300)
        assert compiled.returncode == 0, compiled.stdout + compiled.stderr
        assert "rollout  rollout" in compiled.stdout and "on worker_node 1" in compiled.stdout
        # a stage asking for a resource no node offers: exit 2 at once, naming the stage (no actor left pending)
        bad = subprocess.run([*rlflow, "compile", str(project / "pipeline.yaml"), "-o", "unplaceable.json",
                              "--set", "stages.score.resources.gpu_node=1"], cwd=workdir, env=env, capture_output=True,
                             text=True, timeout=300)
        assert bad.returncode == 0, bad.stdout + bad.stderr
        bad = subprocess.run([*rlflow, "run", "unplaceable.json", "--address", f"127.0.0.1:{port}"], cwd=workdir,
                             env=env, capture_output=True, text=True, timeout=300)
        assert bad.returncode == 2 and "Traceback" not in bad.stderr, bad.stdout + bad.stderr
        assert (f"stages.score.resources.gpu_node: no node of the Ray cluster at 127.0.0.1:{port} offers 1 'gpu_node' "
                "(custom resources there: head_node, worker_node)") in bad.stderr, bad.stderr
        assert not (workdir / ".rlflow" / "runs").exists()  # failed before a run directory was made

        t1 = time.monotonic()
        run = subprocess.run([*rlflow, "run", "--address", f"127.0.0.1:{port}"], cwd=workdir, env=env,
                             capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
        out = run.stdout + run.stderr
        (tmp_path / "run.log").write_text(out)
        assert run.returncode == 0, out[-6000:]
        print(f"two nodes started in {t0 - started:.0f} s; compiled in {t1 - t0:.0f} s; ran in {time.monotonic() - t1:.0f} s")
    finally:
        t2 = time.monotonic()
        stop_nodes(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)
        print(f"nodes stopped in {time.monotonic() - t2:.0f} s")

    (run_dir,) = (workdir / ".rlflow" / "runs").glob("*/*/")
    summary = json.loads((run_dir / "summary.json").read_text())  # the run prints a short summary; the JSON is here
    assert summary["steps"] == 2, summary
    out += (run_dir / "run.log").read_text() if (run_dir / "run.log").is_file() else ""  # workers' model lines go there

    # the model reached each node through the object store, into that node's cache (the driver's copy is elsewhere)
    plan = json.loads((workdir / ".rlflow" / "plan.json").read_text())
    assert plan["pipeline"]["stages"]["rollout"]["resources"] == {"worker_node": 1.0}
    for where, actor in (("worker", "RolloutWorker"), ("head", "TrainerWorker")):
        copies = list((caches[where] / "shipped").iterdir())
        assert len(copies) == 1 and (copies[0] / "config.json").is_file(), (where, copies)
        lines = [ln for ln in out.splitlines() if f"({actor} pid=" in ln and "model " in ln]
        assert lines and all(str(caches[where]) in ln for ln in lines), (actor, lines or out[-4000:])
    assert re.search(r"\(RolloutWorker pid=\d+.*materialised \d+ files .* from the object store into "
                     + re.escape(str(caches["worker"])), out), out[-4000:]

    # the reward module: imported by the reward workers from the copy shipped with py_modules, not from project/
    assert "user code shipped to the cluster: myreward.py" in out
    imported = {int(p.stem): p.read_text() for p in markers.iterdir()}
    shipped = {pid: f for pid, f in imported.items() if not f.startswith(str(project))}
    assert shipped and all("runtime_resources" in f for f in shipped.values()), imported
    # from project/: only the drivers (two compiles; two runs, whose start re-checks the user code: user_code_check.py)
    assert len(imported) - len(shipped) <= 4, imported
