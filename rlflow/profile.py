"""`rlflow profile`: fit StaleFlow's per-instance cost model (Appendix B, Eq. 11) to an engine's measured steps.

    latency per decode step = k1 * kv_cache + max(k2, k3 * n) + k4

k2 = k3 * n* at the crossover n*, so for a fixed n* the model is linear in (kv_cache, max(n*, n), 1):
each candidate n* is one least-squares fit, and the best one wins. The result is written in the
configs/profiles/ format, so cost-model routing and the simulator work on any engine.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class Sample:
    """One measured decode step: KV units held, running trajectories, seconds per decode step."""

    kv_cache: float
    running: int
    latency_s: float


def _nonnegative_lstsq(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """min |a c - b| subject to c >= 0, exactly, by trying every support (a has three columns here).

    Every coefficient of Eq. 11 is a cost, so a negative one is timing noise fitted as signal (on a
    tiny CPU model the step time is nearly all fixed overhead). The constrained optimum is the
    unconstrained fit on some subset of the columns with every coefficient non-negative; with three
    columns there are seven subsets, so trying them all is exact and cheaper than an active-set solver.
    """
    best, best_err = np.zeros(a.shape[1]), float(np.sum(b**2))
    for mask in range(1, 2 ** a.shape[1]):
        cols = [j for j in range(a.shape[1]) if mask >> j & 1]
        sub, *_ = np.linalg.lstsq(a[:, cols], b, rcond=None)
        if np.any(sub < 0):
            continue
        coef = np.zeros(a.shape[1])
        coef[cols] = sub
        err = float(np.sum((a @ coef - b) ** 2))
        if err < best_err:
            best, best_err = coef, err
    return best


def fit_profile(samples: list[Sample], *, kv_per_token: float = 1.0, weights: list[float] | None = None,
                relative: bool = True) -> dict:
    """k1..k5 (all >= 0) by least squares with a searched crossover; raises ValueError on too few distinct points.
    weights: each sample's weight; default equal. relative: residuals relative to each sample's latency (else in
    seconds: the fit then gets the total time of the samples right, which a noisy in-run profile needs)."""
    if len({s.running for s in samples}) < 3 or len(samples) < 6:
        raise ValueError("need at least 6 samples over 3 or more batch sizes to fit k1..k4")
    kv = np.array([s.kv_cache for s in samples], dtype=float)
    n = np.array([s.running for s in samples], dtype=float)
    y = np.array([s.latency_s for s in samples], dtype=float)
    root_w = np.sqrt(np.asarray(weights, dtype=float) if weights is not None else np.ones_like(y))
    scale = y if relative else np.ones_like(y)
    best = None
    # the crossover n* = k2 / k3 need not be a measured batch size: search a fine grid over the range
    grid = np.geomspace(max(n.min(), 1.0), n.max(), 400)
    for cross in sorted(set(n.tolist()) | set(grid.tolist())):
        x = np.column_stack([kv, np.maximum(n, cross), np.ones_like(kv)])
        # relative least squares: timing noise is proportional to the step time, and small batches
        # (the latency floor) matter as much to routing as large ones
        coef = _nonnegative_lstsq(x * (root_w / scale)[:, None], root_w * y / scale)
        err = float(np.sum((root_w * (x @ coef - y) / scale) ** 2))
        if best is None or err < best[0]:
            best = (err, *(float(c) for c in coef), cross)
    err, k1, k3, k4, cross = best
    pred = k1 * kv + np.maximum(k3 * cross, k3 * n) + k4
    r2 = 1 - float(np.sum((pred - y) ** 2)) / max(float(np.sum((y - y.mean()) ** 2)), 1e-30)
    return {"k1": k1, "k2": k3 * cross, "k3": k3, "k4": k4, "k5": kv_per_token, "crossover": float(cross), "r2": r2}


def measure_engine(engine, prompt_ids: list[int], batch_sizes=(1, 2, 4, 8, 16, 32), repeats: int = 2,
                   log=print) -> list[Sample]:
    """Step an engine (the rollout-engine interface) at several batch sizes; one sample per clean step call.

    A step call counts only if no trajectory finished or joined during it: then every running
    trajectory decoded the same number of tokens, d = (growth of kv_cache) / n, and the latency per
    decode step is the time between the two snapshots / d.
    """
    from rlflow.stages.trajectory import Trajectory

    samples: list[Sample] = []
    for n in batch_sizes:
        for r in range(repeats):
            for i in range(n):
                engine.start(Trajectory(group_id=f"p{n}-{r}", index=i, prompt="", answer="", prompt_ids=list(prompt_ids)))
            before, t_before = engine.snapshot(), time.perf_counter()
            while not engine.idle:
                finished = engine.step()
                after, t_after = engine.snapshot(), time.perf_counter()
                # Time between snapshots, not inside step(): an engine that generates in the background
                # (vllm) also decodes between calls, and the snapshots bracket exactly the tokens counted.
                dt, t_before = t_after - t_before, t_after
                same = set(after.run_trajs) == set(before.run_trajs) and not before.wait_trajs
                decoded = (after.kv_cache - before.kv_cache) / max(len(before.run_trajs), 1)
                if not finished and same and decoded > 0:
                    samples.append(Sample(before.kv_cache, len(before.run_trajs), dt / decoded))
                before = after
        log(f"profile: batch {n}: {sum(1 for s in samples if s.running == n)} clean steps")
    return samples


def measure_pull(engine, model_dir: str | Path, repeat: int = 3) -> float:
    """Seconds the engine is blocked loading one weight version: its own checkpoint, in the runtime's buckets, through
    `load_weights` (copy in plus the read-back checksum), best of `repeat`. On the object store a pull's bytes are
    already local (a zero-copy get), so this is the instance's whole share of a pull; the simulator stalls an instance
    this long per pull (StaleFlow's cost model has a pull term, Appendix B). Publishing costs the trainer, not the
    instance (benchmarks/bench_scale.py measures both)."""
    from safetensors.torch import load_file

    from rlflow.stages.weight_buckets import state_buckets

    state = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        state.update(load_file(str(f)))
    if not state:
        raise ValueError(f"no safetensors weights in {model_dir}: cannot measure a pull")
    best = float("inf")
    for version in range(1, repeat + 1):
        buckets = ({n: t for n, t in zip(layout.names, tensors)} for layout, tensors in state_buckets(state))
        t0 = time.perf_counter()
        engine.load_weights(buckets, version)
        best = min(best, time.perf_counter() - t0)
    return best


def machine() -> str:
    """The machine a profile was measured on, in words: CPU cores this process may use, and its GPU if any."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    try:
        import torch

        gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    except ImportError:
        gpu = "no GPU"
    return f"{cores} CPU cores, {gpu}"


def write_profile(fit: dict, path: str | Path, *, name: str, engine: str, model: str, source: str, max_running: int,
                  kv_budget: float, pull_s: float | None = None) -> Path:
    """Write a configs/profiles/ JSON; values the fit does not give are stated as assumptions.

    `engine` (registry name) and `model` (the path the engine loaded) say what was measured, so a pipeline
    naming this profile can be checked against its own engine and model.
    """
    path = Path(path)
    doc = {
        "name": name,
        "engine": engine,
        "model": model,
        "source": source,
        "latency": "per decode step: k1 * kv_cache + max(k2, k3 * n) + k4 seconds",
        **{k: {"value": fit[k], "from": "rlflow profile (least squares)"} for k in ("k1", "k2", "k3", "k4")},
        "k5": {"value": fit["k5"], "unit": "KV units per token", "from": "engine reports KV in tokens"},
        "kv_budget": {"value": kv_budget, "unit": "KV units", "from": "assumption: engine's max_running x max_model_len"},
        "max_running": {"value": max_running, "from": "engine setting"},
        "prefill_s_per_token": {"value": fit["k3"], "from": "assumption: one decode slot's cost per prompt token"},
        "pull_s": ({"value": pull_s, "unit": "s per pull", "from": "rlflow profile: the engine loading its own weights "
                    "in buckets (profile.measure_pull)"} if pull_s is not None else
                   {"value": 0.0, "from": "assumption: not measured"}),
        "fit": {"crossover": fit["crossover"], "r2": fit["r2"]},
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2) + "\n")
    return path
