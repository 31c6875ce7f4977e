"""Checkpoint and resume: the trainer's DeepSpeed state plus the run's counters, under the run directory.

What the driver keeps besides the trainer: the step, how many prompts each task has drawn (the prompt
source skips them on resume: its order is fixed by data.seed), the prompts drawn ahead but never routed
(drawn first after a resume), the history and counters, and the MLflow run to continue.
"""

from __future__ import annotations

import json
from pathlib import Path

import ray

STATE_FILE = "state.json"


def save(out_dir: Path, trainer, state: dict, *, timeout_s: float) -> Path:
    ckpt = out_dir / "checkpoint"
    ckpt.mkdir(parents=True, exist_ok=True)
    ray.get(trainer.save.remote(str(ckpt), {"step": state["step"]}), timeout=timeout_s)
    tmp = out_dir / (STATE_FILE + ".tmp")
    tmp.write_text(json.dumps(state))
    tmp.replace(out_dir / STATE_FILE)  # the state file names a complete checkpoint, or the previous one
    return ckpt


def load(out_dir: Path, trainer, *, source: str, timeout_s: float) -> dict:
    path = out_dir / STATE_FILE
    if not path.exists():
        from rlflow.errors import PipelineInvalid, Problem

        raise PipelineInvalid(source, [Problem((), f"no checkpoint to resume from in {out_dir}", "no-checkpoint",
                                               "run without --resume first (Ctrl-C saves a checkpoint)")])
    state = json.loads(path.read_text())
    ray.get(trainer.load.remote(str(out_dir / "checkpoint")), timeout=timeout_s)
    return state
