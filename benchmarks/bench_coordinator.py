"""Speed of one coordination cycle (Algorithm 1) at 128 instances and 4,096 trajectories.

python benchmarks/bench_coordinator.py      # writes benchmarks/results/coordinator.md
"""

from __future__ import annotations

import platform
import random
import statistics
import time
from pathlib import Path

from rlflow.operators.coordinator import CoordinationConfig, Coordinator
from rlflow.operators.routing import CostModel
from rlflow.operators.snapshot import InstanceSnapshot, Snapshot, TrajView

RESULTS = Path(__file__).resolve().parent / "results" / "coordinator.md"
COST = CostModel(k1=7.28e-8, k2=1.72e-3, k3=1.25e-4, k4=1.07e-2, k5=1.0, kv_budget=1_000_000, max_running=256)
N_INST, N_TRAJ, ETA = 128, 4096, 3


def snapshot(seed: int) -> Snapshot:
    """Mid-rollout state: 2,048 trajectories on instances (versions ps-2..ps), 2,048 in the TS (1,536 initial)."""
    rng = random.Random(seed)
    ps = 10
    insts = []
    tid = 0
    for i in range(N_INST):
        v = ps - rng.randint(0, 2)
        run = []
        for _ in range(16):
            run.append(TrajView(tid, tid // 16, v - rng.randint(0, 1), 256 + rng.randint(0, 16000)))
            tid += 1
        kv = sum(t.tokens for t in run)
        insts.append(InstanceSnapshot(i, kv, run, [], rng.randint(0, 20), v, kv * rng.uniform(0.9, 1.1)))
    ts = [TrajView(tid + j, (tid + j) // 16, ps - rng.randint(1, ETA), 256 + rng.randint(0, 8000)) for j in range(512)]
    ts += [TrajView(tid + 512 + j, 10_000 + j // 16, None, 256) for j in range(N_TRAJ - len(ts) - tid)]
    return Snapshot(insts, ts, ps)


def bench(cfg: CoordinationConfig, reps: int = 7) -> float:
    times = []
    for r in range(reps):
        snap = snapshot(r)
        coord = Coordinator(N_INST, cfg, cost=COST, validate=False)
        admitted = {"n": 0}
        verify = lambda v, snap=snap, admitted=admitted: admitted["n"] < 256 and v >= snap.ps_version - ETA  # noqa: E731
        reserve = lambda gid, v, admitted=admitted: admitted.__setitem__("n", admitted["n"] + 1)  # noqa: E731
        t = time.perf_counter()
        coord.cycle(snap, verify, reserve)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1000


def main() -> None:
    rows = []
    for name, cfg in [
        ("vanilla: least_loaded / greedy / none", CoordinationConfig("least_loaded", "greedy", "none")),
        ("StaleFlow: cost_model / throughput_aware / threshold", CoordinationConfig("cost_model", "throughput_aware", "threshold")),
        ("cost_model / greedy / none", CoordinationConfig("cost_model", "greedy", "none")),
        ("Laminar: least_loaded / per_instance / repack", CoordinationConfig("least_loaded", "per_instance", "repack")),
    ]:
        ms = bench(cfg)
        rows.append(f"| {name} | {ms:.1f} |")
        print(rows[-1], flush=True)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(
        "# Coordination-cycle speed\n\n"
        f"`python benchmarks/bench_coordinator.py` on {platform.processor() or platform.machine()}, Python {platform.python_version()}"
        " (shared 2-core machine; median of 7 cycles, snapshot building excluded).\n\n"
        f"{N_INST} instances (versions ps-2..ps, 16 running each = 2,048 trajectories), 4,096 trajectories in all: 2,048 on"
        " instances, 512 interrupted in the TS with V_traj and varied lengths, 1,536 initial; staleness policy admits 256 more groups.\n\n"
        "| strategies | ms per cycle |\n|---|---|\n" + "\n".join(rows) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
